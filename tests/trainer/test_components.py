"""Building `_target_` nodes: signature checks, offered keys, imports, one-line errors."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from trainer.components import accepts, build, build_callable, call, locate, parameters
from trainer.config import ConfigError


def node(**kw):
    return OmegaConf.create(kw)


def test_offered_keys_reach_only_constructors_that_name_them():
    mlp = build(node(_target_="trainer.models.MLP", hidden=[4]), "model",
                {"input_shape": [3], "num_classes": 2, "unused": 1})
    assert mlp.head.out_features == 2
    lin = build(node(_target_="torch.nn.Linear", in_features=3, out_features=2), "model",
                {"input_shape": [3], "num_classes": 2})
    assert isinstance(lin, torch.nn.Linear)


def test_subclasses_passing_kwargs_on_take_their_bases_parameters():
    from tests.helpers import WithUnusedBranch

    assert {"input_shape", "num_classes", "hidden"} <= set(parameters(WithUnusedBranch))
    assert accepts(WithUnusedBranch, "hidden") and not accepts(WithUnusedBranch, "width")
    assert parameters(lambda **kw: None) is None  # only the target itself can tell


def test_an_init_wrapped_to_take_any_keyword_is_not_held_to_the_signature_it_shows():
    """Hugging Face's configs take keywords their signature does not show (`num_labels`):
    refused, the standard classification setup could not be written."""
    import functools

    def any_keyword(init):
        @functools.wraps(init)
        def wrapper(self, *args, **kwargs):
            extra = {k: kwargs.pop(k) for k in list(kwargs) if k != "width"}
            init(self, *args, **kwargs)
            self.__dict__.update(extra)
        return wrapper

    class Config:
        @any_keyword
        def __init__(self, width: int = 2):
            self.width = width

    assert parameters(Config) is None
    transformers = pytest.importorskip("transformers")
    config = build(node(_target_="transformers.BertConfig", num_labels=3, hidden_size=8,
                        num_hidden_layers=1, num_attention_heads=2, intermediate_size=8),
                   "model.config")
    assert isinstance(config, transformers.BertConfig) and config.num_labels == 3


def test_a_hugging_face_configs_misspelt_setting_is_refused_and_an_extra_one_said(caplog):
    """BertConfig keeps any keyword as an attribute: `num_hiden_layers: 1` built 12 layers."""
    pytest.importorskip("transformers")
    with pytest.raises(ConfigError) as e:
        build(node(_target_="transformers.BertConfig", num_hiden_layers=1, hidden_size=8),
              "model.config")
    assert str(e.value) == ("model.config.num_hiden_layers: transformers.BertConfig has no "
                            "setting 'num_hiden_layers'; did you mean num_hidden_layers? (it "
                            "would be kept as an extra attribute, and num_hidden_layers left "
                            "at its default, 12)")
    # settings by their other names (GPT-2's n_layer is num_hidden_layers), a base class's
    # keyword (num_labels), token ids of any name (sep_token_id is no misspelt pad_token_id),
    # one the config reads into others (Llama's rope_theta), and one of the user's own, kept
    # and said
    with caplog.at_level("WARNING", logger="trainer.spelling"):
        config = build(node(_target_="transformers.GPT2Config", n_layer=1, num_hidden_layers=1,
                            num_labels=3, n_embd=8, sep_token_id=3, my_head_width=5),
                       "model.config")
        build(node(_target_="transformers.LlamaConfig", rope_theta=5e5, hidden_size=8,
                   intermediate_size=8, num_attention_heads=2, num_key_value_heads=2),
              "model.config")
    assert (config.n_layer, config.num_labels, config.my_head_width) == (1, 3, 5)
    assert [r.getMessage() for r in caplog.records if r.name == "trainer.spelling"] == [
        "model.config.my_head_width: not a setting transformers.GPT2Config reads; kept on the "
        "config as an extra attribute, for code that reads it (is it misspelt?)"]


def test_unknown_and_missing_arguments_are_named():
    with pytest.raises(ConfigError, match=r"^model.hiden: trainer.models.MLP takes no argument "
                                          r"'hiden' \(did you mean model.hidden\? it takes: "
                                          r"input_shape, num_classes"):
        build(node(_target_="trainer.models.MLP", hiden=[4]), "model", {"input_shape": [3]})
    # a word for another is no misspelling: no guess (sched's warmup is not warmup_steps)
    with pytest.raises(ConfigError, match=r"^sched.warmup: trainer.schedules.warmup_cosine "
                                          r"takes no argument 'warmup' \(it takes: "):
        build(node(_target_="trainer.schedules.warmup_cosine", warmup=5), "sched")
    with pytest.raises(ConfigError, match=r"^model: trainer.models.MLP needs 'num_classes': set "
                                          r"data.num_classes \(the classes of a classification\) "
                                          r"or \+model.num_classes=N \(its outputs: 1 for one "
                                          r"regression target\)$"):
        build(node(_target_="trainer.models.MLP"), "model",
              {"input_shape": [3], "num_classes": None})
    positional = build(node(_target_="torch.nn.Linear", _args_=[3, 2]), "model")
    assert positional.out_features == 2


@pytest.mark.parametrize("path,fragment", [
    ("trainer.models.MLPP", r"trainer.models has no attribute 'MLPP' \(did you mean "
                            r"trainer.models.MLP\?\)$"),
    ("torch.nn.Linearr", r"torch.nn has no attribute 'Linearr' \(did you mean "
                         r"torch.nn.Linear\?\)$"),  # a class in a package
    ("torch.optim.Adamw", r"torch.optim has no attribute 'Adamw' \(did you mean "
                          r"torch.optim.AdamW\?\)$"),  # (letters of another case)
    ("trainer.models.Perceptron", r"trainer.models has no attribute 'Perceptron'$"),  # (none)
    # a class renamed with a word more (torchmetrics' F1, F1Score since 0.7); not a guess
    # between several (Conv1d, Conv2d, Conv3d) nor a word cut short (Lin)
    ("torchmetrics.F1", r"torchmetrics has no attribute 'F1' \(did you mean "
                        r"torchmetrics.F1Score\?\)$"),
    ("torch.nn.Conv", r"torch.nn has no attribute 'Conv'$"),
    ("torch.nn.Lin", r"torch.nn has no attribute 'Lin'$"),
    # a module named where a class goes: Hydra's "Expected a callable target" named no key
    ("trainer.models", r"a module, not a class or function in it \(it defines .*\bMLP\b"),
    ("nopkg.models.MLP", r"no module named 'nopkg' \(is it installed, or in the directory "),
    ("troch.nn.Linear", r"no module named 'troch' \(did you mean torch\? is it installed"),
    # a package: the module is what was meant, a misspelt one or none of its own
    ("trainer.modelz.MLP", r"no module named 'trainer.modelz' \(and trainer has no attribute "
                           r"'modelz'\); did you mean trainer.models\?$"),
    ("torch.optimm.SGD", r"no module named 'torch.optimm' \(and torch has no attribute "
                         r"'optimm'\); did you mean torch.optim\?$"),
    ("trainer.homemade.MLP", r"no module named 'trainer.homemade' \(and trainer has no "
                             r"attribute 'homemade'\); 'trainer' is Stoker's own package "
                             r"\(.*trainer\), which a package of yours named trainer cannot "
                             r"replace: rename yours$"),
    # a package of one's own named data: Stoker's data/ is found first
    ("data.mydata.Diabetes", r"no module named 'data.mydata' \(and data has no attribute "
                             r"'mydata'\); 'data' is Stoker's own package"),
])
def test_locate_names_what_is_missing(path, fragment):
    with pytest.raises(ConfigError, match=f"^model._target_={path}: {fragment}"):
        locate(path, "model._target_")


def test_optimizer_value_errors_name_the_key_but_user_bugs_keep_their_traceback():
    optim = node(_target_="torch.optim.SGD", _partial_=True, lr=-1.0)
    with pytest.raises(ConfigError, match=r"^optim.lr=-1.0: torch.optim.SGD refused it: "
                                          r"Invalid learning rate"):
        call(build(optim, "optim"), "optim", optim, [torch.nn.Parameter(torch.zeros(1))])

    def factory(params):
        raise ValueError("a bug in my factory")

    with pytest.raises(ValueError, match="a bug in my factory"):
        call(factory, "optim", node(_target_="x"), [])


def test_a_function_is_a_collate_as_it_stands():
    from tests.helpers import pad_collate

    assert build_callable(node(_target_="tests.helpers.pad_collate"), "data.collate_fn") \
        is pad_collate
    assert build_callable(None, "data.collate_fn") is None


def test_a_function_given_arguments_but_not_its_samples_is_told_to_be_partial():
    """It was told to set `+data.collate_fn.samples=`: the batch's samples, never a config
    value."""
    import functools

    from tests.helpers import pad_collate

    with pytest.raises(ConfigError, match=r"^data.collate_fn: tests.helpers.pad_collate takes "
                       r"'samples' when it is called, and pad_id from the config: set "
                       r"\+data.collate_fn._partial_=true to bind those$"):
        build_callable(node(_target_="tests.helpers.pad_collate", pad_id=3), "data.collate_fn")
    bound = build_callable(node(_target_="tests.helpers.pad_collate", pad_id=3,
                                _partial_=True), "data.collate_fn")
    assert isinstance(bound, functools.partial) and bound.keywords == {"pad_id": 3}
    # a factory given all its arguments is called: what it returns is the collate
    made = build_callable(node(_target_="tests.helpers.collate_padding_with", pad_id=3),
                          "data.collate_fn")
    assert made.keywords == {"pad_id": 3} and made.func is pad_collate
    # a collate of more arguments, one of them given: _partial_, and the other one too
    with pytest.raises(ConfigError, match=r"^data.collate_fn: re.sub takes 'pattern' when it "
                       r"is called, and repl from the config: set \+data.collate_fn._partial_="
                       r"true to bind those \(with \+data.collate_fn.string=\.\.\., which it "
                       r"takes too\)$"):
        build_callable(node(_target_="re.sub", repl="x"), "data.collate_fn")
    # a factory missing another of its own arguments is told that one (not _partial_)
    with pytest.raises(ConfigError, match=r"^data.collate_fn: shutil.copyfile needs 'dst': "
                       r"set \+data.collate_fn.dst=\.\.\.$"):
        build_callable(node(_target_="shutil.copyfile", src="a"), "data.collate_fn")


@pytest.mark.parametrize("metric,message", [
    (dict(_target_="trainer.metrics.Acuracy"),
     r"^task.metrics.acc._target_=trainer.metrics.Acuracy: trainer.metrics has no attribute "
     r"'Acuracy'"),
    (dict(_target_="trainer.metrics.Accuracy", ignore_indx=3),
     r"^task.metrics.acc.ignore_indx: trainer.metrics.Accuracy takes no argument 'ignore_indx'"),
    (dict(_target_="torch.nn.Linear", in_features=3),
     r"^task.metrics.acc: torch.nn.Linear needs 'out_features': set "
     r"\+task.metrics.acc.out_features=...$"),
    (dict(_target_="tests.helpers.BrokenMetric", fails="compute", _args_=["update", 2]),
     r"^task.metrics.acc: tests.helpers.BrokenMetric refused its arguments \(TypeError: "),
    # torchmetrics' classes take **kwargs and refuse a misspelt one themselves: named
    (dict(_target_="torchmetrics.R2Score", multioutpt="raw_values"),
     r"^task.metrics.acc: torchmetrics.regression.r2.R2Score refused its arguments "
     r"\(ValueError: Unexpected keyword arguments: `multioutpt`\); did you mean "
     r"task.metrics.acc.multioutput\?$"),
    # a target taking **kwargs took the misspelt key, then missed the one it misspells
    (dict(_target_="tests.helpers.KeywordMetric", num_clases=3),
     r"^task.metrics.acc.num_clases: tests.helpers.KeywordMetric needs 'num_classes', which it "
     r"was not given \(did you mean task.metrics.acc.num_classes\?\)$"),
    # a function (sklearn's f1_score) is called as the task is built, and is no metric
    (dict(_target_="sklearn.metrics.f1_score"),
     r"^task.metrics.acc: sklearn.metrics._classification.f1_score refused its arguments "
     r"\(TypeError: missing a required argument: 'y_true'\); a function is not a metric: give "
     r"an object with update/compute/reset \(e.g. a torchmetrics.Metric, or a class of your "
     r"own\)$"),
    # given _partial_: true, it is no metric either: named, not as Hydra's partial class
    (dict(_target_="sklearn.metrics.f1_score", _partial_=True),
     r"^task.metrics.acc: sklearn.metrics._classification.f1_score given _partial_: true \(a "
     r"function waiting for its arguments\) is not a metric with update/compute/reset \(e.g. "
     r"a torchmetrics.Metric, or a class of your own\)$"),
    # a class given _partial_: true is left unbuilt
    (dict(_target_="torchmetrics.classification.MulticlassAccuracy", _partial_=True,
          num_classes=3),
     r"^task.metrics.acc: torchmetrics.classification.accuracy.MulticlassAccuracy given "
     r"_partial_: true \(a class left unbuilt: leave _partial_ out\) is not a metric"),
    # a factory of metrics failing on its own argument is no function mistaken for a metric
    (dict(_target_="tests.helpers.accuracy_of", num_classes=0),
     r"^task.metrics.acc: tests.helpers.accuracy_of refused its arguments \(ValueError: "
     r"[^;]*\)$"),
])
def test_the_nodes_inside_a_node_are_named_by_their_own_keys(metric, message):
    """A task's metrics are built inside it (Hydra's recursion): their mistakes name
    task.metrics.<name>, as a model's name model.<key>, not Hydra's whole message."""
    with pytest.raises(ConfigError, match=message):
        build(node(_target_="trainer.tasks.Classification", metrics={"acc": metric}), "task")


def test_a_misspelt_argument_is_said_without_the_hint_for_keys_left_from_another_choice():
    with pytest.raises(ConfigError) as info:
        build(node(_target_="tests.helpers.TwoHeads", input_shape=[4], num_classes=2, widht=3),
              "model", hint="; model=custom starts from no keys but _target_")
    assert str(info.value) == ("model.widht: tests.helpers.TwoHeads takes no argument 'widht' "
                               "(did you mean model.width? it takes: input_shape, num_classes, "
                               "width)")


def test_of_two_inner_nodes_with_one_target_the_failing_ones_key_is_named():
    metrics = {"a": dict(_target_="tests.helpers.BrokenMetric"),
               "b": dict(_target_="tests.helpers.BrokenMetric", _args_=["update", 2])}
    with pytest.raises(ConfigError, match=r"^task.metrics.b: tests.helpers.BrokenMetric refused"):
        build(node(_target_="trainer.tasks.Classification", metrics=metrics), "task")


@pytest.mark.parametrize("given,line", [
    (dict(width="abc"), "model.width=abc: tests.helpers.PickyNet failed with it (TypeError: "),
    (dict(width=64.5), "model.width=64.5: tests.helpers.PickyNet failed with it (TypeError: "),
    # beside a given argument whose default is an array (whose == is no truth): the check
    # raised numpy's "truth value of an array is ambiguous" in place of the line
    (dict(width="abc", scale=[1.0, 2.0]), "model.width=abc: tests.helpers.PickyNet failed "),
    (dict(width=12), None),  # its own ValueError, the width of its default's kind
    (dict(width=12, norm=None), None),  # a null is no kind of its own
    (dict(width=12, hidden=[64, 32]), None),  # an annotation that admits lists
    (dict(width=12, bias="yes"), None),  # the error names another key it was given
    (dict(width=32, norm=3), "model.norm=3: tests.helpers.PickyNet failed with it (ValueError: "
                             "unknown norm 3); its default is bn, a string, where 3 is an "
                             "integer"),
    (dict(width=32, norm=3, bias="yes"), None),  # two of another kind: which is not known
    (dict(width="abc", bias="yes"), None),  # two of another kind: which is not known
])
def test_a_model_argument_unlike_its_default_is_named_where_the_constructor_fails(given, line):
    """`+model.width=abc` failed inside the model's own code, and the line named only the
    model's class and torch's words about a size; a failure with no one argument of another
    kind than its default is not pinned on a key."""
    from trainer.components import build_model

    cfg = OmegaConf.create({"model": {"_target_": "tests.helpers.PickyNet", **given},
                            "data": {"input_shape": [4], "num_classes": 2}})
    with pytest.raises(Exception) as info:
        build_model(cfg)
    if line is None:
        assert not isinstance(info.value, ConfigError), info.value
    else:
        assert isinstance(info.value, ConfigError) and str(info.value).startswith(line)
    if given == dict(width="abc"):
        assert str(info.value).endswith("; its default is 64, an integer, where abc is a "
                                        "string")


def test_a_model_too_big_for_the_machine_names_the_sizes_it_was_built_with():
    """More classes than any address space holds (a typo's extra zeros): one line with the
    sizes, not the allocator's enforce text."""
    from trainer.components import build_model

    cfg = OmegaConf.create({"model": {"_target_": "trainer.models.MLP", "hidden": [128]},
                            "data": {"input_shape": [1, 8, 8], "num_classes": 10**13}})
    with pytest.raises(ConfigError) as e:
        build_model(cfg)
    said = str(e.value)
    assert said.startswith("model._target_=trainer.models.MLP: building the model ran out of "
                           "memory (it asked for "), said
    assert said.endswith("at once); are its sizes right? data.input_shape=[1, 8, 8], "
                         "data.num_classes=10000000000000, model.hidden=[128]"), said


def test_a_model_that_fails_otherwise_is_not_called_too_big():
    from hydra.errors import InstantiationException

    from trainer.components import build_model

    cfg = OmegaConf.create({"model": {"_target_": "trainer.models.MLP", "hidden": [-5]},
                            "data": {"input_shape": [1, 8, 8], "num_classes": 10}})
    with pytest.raises((ConfigError, InstantiationException)) as e:
        build_model(cfg)
    assert "ran out of memory" not in str(e.value)


def test_a_components_lists_and_dicts_reach_it_as_plain_ones():
    """Hydra handed OmegaConf's ListConfig on: a Hugging Face config, which checks its fields'
    types, refused `hidden_sizes: [16, 32]` ("expected a list, got ListConfig"), in a line cut
    before that reason. A node's own `_convert_` still decides."""
    pytest.importorskip("transformers")
    config = build(node(_target_="transformers.ResNetConfig", hidden_sizes=[16, 32],
                        depths=[1, 1], embedding_size=8), "model.config")
    assert config.hidden_sizes == [16, 32] and type(config.hidden_sizes) is list
    made = build(node(_target_="builtins.dict", sizes=[1, 2], inner={"a": [3]}), "x")
    assert type(made["sizes"]) is list and type(made["inner"]) is dict
    made = build(node(_target_="builtins.dict", sizes=[1, 2], _convert_="none"), "x")
    assert type(made["sizes"]) is not list


def test_an_errors_first_line_takes_the_reason_a_colon_leads_to():
    from trainer.components import first_line

    assert first_line(ValueError("Validation error for field 'x':\n  expected a list\nmore")) \
        == "Validation error for field 'x': expected a list"
    assert first_line(ValueError("one\ntwo")) == "one"
    assert first_line(ValueError("")) == "ValueError"


def test_a_model_on_the_meta_device_is_one_line_naming_a_tensor_without_data():
    """Its move to the training device raised "Cannot copy out of meta tensor" in a traceback."""
    from omegaconf import OmegaConf

    from trainer.components import build_model

    cfg = OmegaConf.create({"model": {"_target_": "torch.nn.Linear", "in_features": 2,
                                      "out_features": 3, "device": "meta"}})
    with pytest.raises(ConfigError, match=r"^model._target_=torch.nn.Linear: its weight is on "
                                          r"the meta device, a shape with no data; build"):
        build_model(cfg)

"""An error reads as one line: the key, what would be valid, the spelling it was close to, the
override that named an OS error's path."""
from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException

from tests.helpers import run_cli
from trainer.oneline import describe


def test_describe_lists_valid_keys_for_a_typo(make_cfg):
    with pytest.raises(ConfigCompositionException) as info:
        make_cfg("data.batchsize=3")
    line = describe(info.value)
    assert "\n" not in line
    assert "data.batchsize" in line and "valid keys:" in line and "batch_size" in line
    assert "To append" not in line


@pytest.mark.parametrize("override,said", [
    # a misspelt argument: what the target takes (Hydra's "not in struct" with a hint to add it
    # with +, which led to the message below only then)
    ("optim.lrr=1e-3", "optim.lrr: torch.optim.AdamW takes no argument 'lrr' (did you mean "
                       "optim.lr? it takes: params, lr, betas, eps, weight_decay, amsgrad, "
                       "maximize, foreach, "),
    ("model.hiden=[64]", "model.hiden: trainer.models.MLP takes no argument 'hiden' (did you "
                         "mean model.hidden? it takes: input_shape, num_classes, hidden, "
                         "dropout, activation_checkpointing)"),
    ("sched.warmup=5", "sched.warmup: trainer.schedules.warmup_cosine takes no argument "
                       "'warmup' (it takes: optimizer, total_steps, warmup_steps, min_lr_ratio)"),
    # an argument the target takes and the config does not list: how to add it
    ("optim.maximize=true", "optim.maximize: not in the config of optim yet; "
                            "torch.optim.AdamW takes it: add it with +optim.maximize=..."),
])
def test_an_override_of_a_key_a_target_node_lacks_says_what_its_target_takes(make_cfg,
                                                                             override, said):
    with pytest.raises(ConfigCompositionException) as info:
        make_cfg(override)
    assert describe(info.value).startswith(said)


@pytest.mark.parametrize("argv, said", [
    (["a.dir=out", "b.dir=out/in"], "b.dir=out/in: out/in/x/y: Permission denied"),  # nearest
    (["+a.dir=out"], "a.dir=out: out/in/x/y: Permission denied"),
    (["a.dir=elsewhere", "b=1,2", "c=."], "out/in/x/y: Permission denied"),  # names no key
])
def test_an_os_error_names_the_override_holding_its_path(monkeypatch, tmp_path, argv, said):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["train.py", *argv])
    assert describe(PermissionError(13, "Permission denied", "out/in/x/y")) == said
    monkeypatch.setattr("sys.argv", ["train.py", "a.dir=out/in/x/y"])
    assert describe(PermissionError(13, "Permission denied", "out/in/x/y")) == \
        "a.dir=out/in/x/y: Permission denied"


def test_a_loader_workers_error_is_its_last_line_and_where_it_came_from():
    e = FileNotFoundError("Caught FileNotFoundError in DataLoader worker process 0.\n"
                          "Original Traceback (most recent call last):\n"
                          '  File "x.py", line 3, in read\n    open(path)\n'
                          "FileNotFoundError: [Errno 2] No such file or directory: 'a.tar'\n")
    assert describe(e) == ("FileNotFoundError: [Errno 2] No such file or directory: 'a.tar' "
                           "(FileNotFoundError in DataLoader worker process 0)")


def test_a_key_a_node_lacks_names_the_keys_it_has_and_the_one_it_is_close_to():
    """`model.config.num_hiden_layers=1` said only to add it with +, which then trained a model
    of the default size: a key close to one the node has is a misspelling, named so."""
    from omegaconf import OmegaConf

    from trainer.config import TrainConfig

    cfg = OmegaConf.create({"model": {"config": {"_target_": "transformers.BertConfig",
                                                 "num_hidden_layers": 2, "hidden_size": 8}}})
    OmegaConf.set_struct(cfg, True)
    said = []
    for name in ("num_hiden_layers", "dropout"):
        with pytest.raises(Exception) as e:
            cfg.model.config[name] = 1
        said.append(describe(e.value))
    has, add = ("(model.config has: num_hidden_layers, hidden_size)",
                " (a key the config does not have yet is added with +key=value)")
    # (a node of no schema may be given a key of one's own: how to add one is said too)
    assert said[0].endswith(f"{has}; did you mean model.config.num_hidden_layers?{add}"), said[0]
    assert said[1].endswith(f"{has}{add}"), said[1]
    typed = OmegaConf.structured(TrainConfig)
    with pytest.raises(Exception) as e:
        typed.data.num_worker = 8
    assert describe(e.value).endswith(", augment); did you mean data.num_workers?")


def test_a_group_or_choice_misspelt_in_an_experiment_of_ones_own_names_that_file(tmp_path):
    """Hydra blamed `train` for a choice misspelt in one's own experiment, and named no group
    for an override of a group misspelt there."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    choice = tmp_path / "conf" / "experiment" / "choice.yaml"
    choice.write_text("# @package _global_\ndefaults:\n  - override /data: synthtic\n")
    (tmp_path / "conf" / "experiment" / "group.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /dat: synthetic\n")
    search = f"hydra.searchpath=[file://{tmp_path / 'conf'}]"
    proc = run_cli([search, "experiment=choice", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"stoker: error: In 'experiment/choice' ({choice}): Could not find 'data/synthtic' "
        "Available options in 'data': custom digits heavy image_folder memmap shards synthetic "
        "tokens; did you mean data: synthetic there?")
    proc = run_cli([search, "experiment=group", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "stoker: error: In 'experiment/group': Could not override 'dat'. No match in the "
        "defaults list (the groups: data, debug, experiment, hydra, model, optim, sched, task, "
        "trainer); did you mean data?")
    # the command's own misspelt choice stays the command's
    proc = run_cli(["data=synthtic", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.stderr.strip().startswith("stoker: error: In 'train': Could not find "
                                          "'data/synthtic'")
    assert proc.stderr.strip().endswith("; did you mean data=synthetic?")
    assert not (tmp_path / "run").exists()

"""The task seam (trainer/task.py) with the user's own work (a Hugging Face GPT-2,
scikit-learn regression, dict batches with a custom collate, a custom task with an F1 metric,
unused parameters under DDP) trained through train.py with no glue beyond a config folder;
the first batch's checks and one-line errors."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import (ROOT, Diabetes, PaddedTokens, pad_collate, run_cli, summary_of,
                           tiny_gpt2, torchrun)
from trainer.config import ConfigError
from trainer.runner import train
from trainer.tasks import Classification


# --- the user's own work through train.py -------------------------------------------------------

def write_conf(root: Path, files: dict) -> str:
    """A config folder of one's own; returns the override that adds it to Hydra's search path."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return f"hydra.searchpath=[file://{root}]"


GPT2_FILES = {
    "model/tiny_gpt2.yaml": "_target_: tests.helpers.tiny_gpt2\nvocab_size: 48\n",
    "data/padded_tokens.yaml": (
        "train_dataset:\n  _target_: tests.helpers.PaddedTokens\n  split: train\n"
        "  num_samples: 64\nval_dataset:\n  _target_: tests.helpers.PaddedTokens\n"
        "  split: val\n  num_samples: 27\ncollate_fn:\n  _target_: tests.helpers.pad_collate\n"
        "batch_size: 8\nnum_workers: 0\n"),
}


def own_val_loss(weights: dict) -> float:
    """GPT-2's own loss over the whole validation set, token-weighted, computed directly."""
    model = tiny_gpt2()
    model.load_state_dict(weights)
    model.eval()
    val = PaddedTokens("val", num_samples=27)
    total = count = 0.0
    with torch.no_grad():
        for start in range(0, len(val), 5):
            batch = pad_collate([val[i] for i in range(start, min(start + 5, len(val)))])
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(model(**batch).loss) * n
            count += n
    return total / count


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_hugging_face_gpt2_trains_with_its_own_loss(tmp_path, ranks):
    search = write_conf(tmp_path / "conf", GPT2_FILES)
    run = tmp_path / "run"
    args = [search, "model=tiny_gpt2", "data=padded_tokens", "task=model_loss",
            "task.count=tokens", "trainer.max_epochs=3", "optim.lr=0.01",
            f"hydra.run.dir={run}", "trainer.progress_bar=false"]
    proc = (run_cli(args, cwd=ROOT) if ranks == 1 else
            torchrun(2, args + ["data.batch_size=4"], cwd=ROOT, timeout=240))
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary_of(run)
    weights = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert s["val_loss"] == pytest.approx(own_val_loss(weights), rel=1e-5)
    assert s["val_ppl"] == pytest.approx(math.exp(s["val_loss"]), rel=1e-6)
    assert s["val_loss"] < math.log(48) - 0.5  # it learned something of the successor table


@pytest.mark.slow
def test_token_loss_accumulated_over_two_ranks_equals_one_big_batch(tmp_path):
    """Padded sequences (a different number of -100 labels in every micro-batch): 2 ranks x
    accumulation 2 x batch 2 makes the update of one process with batches of 8."""
    search = write_conf(tmp_path / "conf", {
        "data/padded_tokens.yaml": GPT2_FILES["data/padded_tokens.yaml"]
        + "input_shape: [24]\nnum_classes: 48\n"})
    common = [search, "data=padded_tokens", "model=transformer", "task=language_model",
              "task.shift_labels=true", "task.input_key=input_ids", "trainer.max_steps=6",
              # SGD: Adam would turn float noise in the exactly-zero gradient of the
              # attention's key bias into full-size updates of either sign
              "optim=sgd", "optim.lr=0.1", "trainer.progress_bar=false"]
    proc = torchrun(2, [*common, "data.batch_size=2", "trainer.accumulate_grad_batches=2",
                        f"hydra.run.dir={tmp_path / 'ddp'}"], cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = run_cli([*common, "data.batch_size=8", f"hydra.run.dir={tmp_path / 'one'}"])
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = (torch.load(tmp_path / r / "checkpoints" / "last.pt", weights_only=True)["model"]
            for r in ("ddp", "one"))
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    assert summary_of(tmp_path / "ddp")["val_loss"] == pytest.approx(
        summary_of(tmp_path / "one")["val_loss"], rel=1e-5)


def test_regression_on_diabetes_logs_exact_mse(make_cfg, tmp_path):
    cfg = make_cfg("data=custom", "+data.dataset._target_=tests.helpers.Diabetes",
                   "data.input_shape=[10]", "+model.num_classes=1", "task=regression",
                   "trainer.max_epochs=5", "optim.lr=0.01")
    s = train(cfg)
    assert "val_acc" not in s and {"val_mse", "val_mae"} <= s.keys()
    model = __import__("trainer.models", fromlist=["MLP"]).MLP([10], 1)
    model.load_state_dict(torch.load(s["checkpoint"], weights_only=True)["model"])
    val = Diabetes("val")
    with torch.no_grad():
        pred = model(val.x).squeeze(1)
    assert s["val_mse"] == pytest.approx(float(F.mse_loss(pred, val.y)), rel=1e-5)
    assert s["val_mae"] == pytest.approx(float((pred - val.y).abs().mean()), rel=1e-5)
    assert s["val_loss"] == pytest.approx(s["val_mse"], rel=1e-5)
    assert s["val_mse"] < 0.8  # below the variance of the standardised targets


TWO_HEAD_FILES = {
    "task/digit_parity.yaml": (
        "_target_: tests.helpers.DigitAndParity\nparity_weight: 0.5\nmetrics:\n  f1:\n"
        "    _target_: torchmetrics.classification.MulticlassF1Score\n"
        "    num_classes: 10\n    average: macro\n  acc:\n"
        "    _target_: trainer.metrics.Accuracy\n"),
    "data/dict_digits.yaml": (
        "dataset:\n  _target_: tests.helpers.DictDigits\ncollate_fn:\n"
        "  _target_: tests.helpers.stack_images\ninput_shape: [1, 8, 8]\nnum_classes: 10\n"),
    "model/two_heads.yaml": "_target_: tests.helpers.TwoHeads\nwidth: 64\n",
}


@pytest.mark.slow
def test_custom_task_with_f1_is_exact_on_three_ranks(tmp_path):
    """Dict samples through a custom collate, a two-output model, a task of one's own with a
    torchmetrics F1; validation on 3 ranks (359 samples: 120/120/119) equals one process."""
    search = write_conf(tmp_path / "conf", TWO_HEAD_FILES)
    common = [search, "data=dict_digits", "model=two_heads", "task=digit_parity",
              "trainer.checkpoint.monitor=val_f1", "trainer.progress_bar=false",
              # (and per class, as a dict: torchmetrics' wrapper, synced alike)
              "+task.metrics.pc._target_=torchmetrics.wrappers.ClasswiseWrapper",
              "+task.metrics.pc.metric._target_=torchmetrics.classification."
              "MulticlassF1Score", "+task.metrics.pc.metric.num_classes=10",
              "+task.metrics.pc.metric.average=null"]
    one = run_cli([*common, "trainer.max_epochs=4", f"hydra.run.dir={tmp_path / 'one'}"])
    assert one.returncode == 0, one.stderr[-3000:]
    s1 = summary_of(tmp_path / "one")
    assert s1["val_f1"] > 0.85 and s1["val_acc"] > 0.85
    assert (tmp_path / "one" / "checkpoints" / "best.pt").is_file()
    # resumed at its end: 3 ranks only validate the same weights
    proc = torchrun(3, [*common, "trainer.max_epochs=4", f"hydra.run.dir={tmp_path / 'three'}",
                        f"trainer.resume={tmp_path / 'one' / 'checkpoints' / 'last.pt'}"],
                    cwd=ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s3 = summary_of(tmp_path / "three")
    assert s3["world_size"] == 3
    assert s3["val_f1"] == pytest.approx(s1["val_f1"], abs=1e-6)
    per_class = [f"val_pc_multiclassf1score_{c}" for c in range(10)]
    assert all(s3[k] == pytest.approx(s1[k], abs=1e-6) for k in per_class)
    assert sum(s1[k] for k in per_class) / 10 == pytest.approx(s1["val_f1"], abs=1e-6)
    assert s3["val_acc"] == pytest.approx(s1["val_acc"], abs=1e-6)
    assert s3["val_loss"] == pytest.approx(s1["val_loss"], rel=1e-6)


@pytest.mark.slow
def test_unused_parameters_under_ddp_need_the_key(tmp_path):
    args = ["model._target_=tests.helpers.WithUnusedBranch", "trainer.max_steps=3",
            "trainer.progress_bar=false"]
    proc = torchrun(2, [*args, f"hydra.run.dir={tmp_path / 'a'}"], cwd=ROOT, timeout=120)
    assert proc.returncode != 0  # torchrun reports a failed rank as 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert len(lines) == 1 and "set trainer.ddp.find_unused_parameters=true" in lines[0]
    proc = torchrun(2, [*args, "trainer.ddp.find_unused_parameters=true",
                        f"hydra.run.dir={tmp_path / 'b'}"], cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("args,fragment", [
    (["model=custom", "model._target_=tests.helpers.TwoHeads", "+model.widht=3"],
     "model.widht: tests.helpers.TwoHeads takes no argument 'widht' (did you mean "
     "model.width? it takes: input_shape, num_classes, width)"),
    (["model._target_=tests.helpers.TwoHeads"],
     "model.hidden: tests.helpers.TwoHeads takes no argument 'hidden' (it takes: input_shape, "
     "num_classes, width); model=custom starts from no keys but _target_"),
    (["+optim.lrr=1"], "optim.lrr: torch.optim.AdamW takes no argument 'lrr'"),
    (["data=custom", "+data.dataset._target_=tests.helpers.Stream"],
     "data.dataset: Stream is an iterable dataset; Stoker needs a map-style dataset"),
    (["data=custom", "+data.dataset._target_=tests.helpers.DictDigits"],
     "model: trainer.models.MLP needs 'input_shape': set data.input_shape or "
     "+model.input_shape=..."),
    (["+model.num_classes=3"], "logits with 3 classes but data.num_classes=10"),
    (["data=custom", "+data.dataset._target_=torch.utils.data.TensorDataset"],
     "data.dataset: torch.utils.data.TensorDataset takes no split argument; give "
     "data.train_dataset and data.val_dataset instead"),
    (["+data.dataset.split=train"],
     "data.dataset.split=train: data.dataset is built twice, with split=train and split=val; "
     "leave the key out, or give data.train_dataset and data.val_dataset"),
    (["trainer.checkpoint.monitor=val_f1"],
     "trainer.checkpoint.monitor=val_f1: must be null or a logged validation key: val_loss, "
     "val_acc"),
    (["task=regression"], "task regression: targets that are not real numbers"),
    (["task=model_loss"], "task model_loss: a model whose forward(x) cannot take the batch "
                          "(too many positional arguments)"),
    (["data=custom", "+data.dataset._target_=tests.helpers.DictDigits",
      "data.input_shape=[1,8,8]", "data.num_classes=10", "+data.collate_fn._target_="
      "tests.helpers.stack_images", "task.target_key=label"],
     "task classification: a model whose forward(x) cannot take the batch (missing a required "
     "argument: 'x'): got dict{image: tensor(64, 1, 8, 8) float32, names: list(64 x str)}; set "
     "task.input_key to the batch entry the model takes"),
    (["data=custom", "+data.train_dataset._target_=tests.helpers.PaddedTokens",
      "data.input_shape=[24]", "data.num_classes=48"],
     "data: the dataset yields samples the default collate cannot batch (stack expects each "
     "tensor to be equal size"),
    (["data=custom", "+data.train_dataset._target_=tests.helpers.PaddedTokens",
      "data.input_shape=[24]", "data.num_classes=48", "data.num_workers=1"],  # (the run-on
     "data: the dataset yields samples the default collate cannot batch (stack expects each "
     "tensor to be equal size"),  # loader's workers, whose collate stacks into the pool)
    (["data=custom", "+data.dataset._target_=tests.helpers.Float64Digits",
      "data.input_shape=[1,8,8]", "data.num_classes=10", "data.placement=host"],
     "the batch holds float64 inputs and the model's parameters are float32: make the dataset "
     "return tensors of the model's dtype"),
    (["data=custom", "+data.dataset._target_=tests.helpers.Sentences",
      "data.input_shape=[1,8,8]", "data.num_classes=10", "data.placement=host"],
     "task classification: a batch it cannot unpack: got list(64 x str)"),
    *[(["data=custom", "+data.dataset._target_=tests.helpers.UnevenKeysDigits",
        "data.input_shape=[1,8,8]", "data.num_classes=10", "data.placement=host",
        f"data.num_workers={workers}"],
       "data: the dataset yields dict samples with different keys, which the default collate "
       "cannot batch (a sample without 'labels', which the batch's first sample has)")
      for workers in (0, 1)],
    (["data.cache=memory", "data=custom", "+data.dataset._target_=tests.helpers.DictDigits",
      "data.input_shape=[1,8,8]"], "data.cache and scripts/prepare_data.py need a dataset of "
                                   "(input, target) tensor pairs"),

    (["data=tokens"], "model: MLP cannot take the first batch (list(tensor(32, 128) int64, "
                      "tensor(32, 128) int64)): mat1 and mat2 must have the same dtype"),
    (["data.normalize_mean=[0.5,0.5,0.5]", "data.normalize_std=[1,1,1]"],
     "data.normalize_mean=[0.5, 0.5, 0.5]: needs one value per channel (or one for all): "
     "data.input_shape=[1, 8, 8] has 1"),
    (["data.augment.crop_padding=100"], "data.augment.crop_padding=100: must be under the "
                                        "image's side (8 px, data.input_shape=[1, 8, 8])"),
    (["data.dataset._target_=tests.helpers.NotADataset", "~data.dataset.val_fraction",
      "~data.dataset.split_seed"],
     "data.dataset: NotADataset is not a dataset: it needs __len__ and __getitem__"),
    (["data.dataset._target_=tests.helpers.NegativeLength"],
     "data.dataset: NegativeLength.__len__() failed (__len__() should return >= 0); it must "
     "return the number of samples"),
    (["+optim.amsgrad=maybe"], "optim.amsgrad=maybe: must be true or false (torch.optim.AdamW's "
                               "default is False)"),
    (["task.label_smoothing=2"], "task.label_smoothing=2: must be a number from 0.0 to 1.0"),
    (["task.label_smoothing=-0.1"], "task.label_smoothing=-0.1: must be a number from 0.0"),
    (["task.ignore_index=abc"], "task.ignore_index='abc': must be an integer target value"),
    (["task.output_key=null"], "task.output_key=null: must be the name of a batch entry or "
                               "output attribute"),
    (["sched=step", "sched.step_size=0"], "sched.step_size=0: StepLR needs at least 1 "
                                          "optimizer step between decays"),
    (["sched=step", "sched.step_size=-3"], "sched.step_size=-3: StepLR needs at least 1"),
    # a negative factor trained at a negative lr every other decay, diverged and exited 0
    (["sched=step", "sched.gamma=-1"], "sched.gamma=-1: StepLR multiplies the lr by it; it must "
                                       "be a number > 0"),
    (["sched=step", "sched.gamma=0"], "sched.gamma=0: StepLR multiplies the lr by it"),
    (["sched=constant", "sched._target_=torch.optim.lr_scheduler.ReduceLROnPlateau",
      "~sched.warmup_steps"],
     "sched: ReduceLROnPlateau.step() needs metrics (a validation metric, say), but the loop "
     "steps the schedule once per optimizer step with no argument"),
    (["sched=constant", "sched._target_=torch.optim.lr_scheduler.OneCycleLR",
      "~sched.warmup_steps", "+sched.max_lr=0.01", "+sched.total_steps=1"],
     "sched.total_steps=1: this run takes 2 optimizer steps, and a schedule stepped past its "
     "total fails"),
    (["task._target_=tests.helpers.PerSampleLoss"],
     "task classification: PerSampleLoss.loss(output, batch) returned no loss backward can "
     "start from: got tensor(64,) float32; expected a 0-d floating tensor (the mean over the "
     "batch); reduce it, e.g. reduction='mean'"),
    (["task._target_=tests.helpers.ItemLoss"],  # (it said to reduce the number)
     "task classification: ItemLoss.loss(output, batch) returned no loss backward can start "
     "from: got float; expected a 0-d floating tensor (the mean over the batch); return the "
     "tensor itself: .item() or float() of it is a number backward cannot start from"),
    (["task._target_=tests.helpers.DetachedLoss"],
     "task classification: DetachedLoss.loss(output, batch) returned a loss that does not "
     "depend on the model's parameters: got tensor() float32"),
    # the task's other methods, each in one line (a TypeError deep in the loop, a run on no
    # units, a NotImplementedError before)
    (["task._target_=tests.helpers.ZeroCount"],
     "task classification: ZeroCount.count(batch) returned 0; expected the units its loss "
     "averages over: an int >= 1 (the batch's samples) or a one-element tensor"),
    (["task._target_=tests.helpers.WordCount"],
     "task classification: WordCount.count(batch) returned 'many'; expected"),
    (["task._target_=tests.helpers.ListDerived"],
     "task classification: ListDerived.derived(values) returned no mapping of names to "
     "numbers: got list(int, int); expected a dict such as {'val_ppl': 12.3}"),
    (["task._target_=tests.helpers.NoMetricPair"],
     "task classification: NoMetricPair.metric_inputs(output, batch) returned no (preds, "
     "target) pair: got NoneType"),
    (["task=model_loss", "task._target_=tests.helpers.NoLoss", "~task.count", "~task.ignore_index",
      "~task.shift_labels"],
     "task._target_=tests.helpers.NoLoss: NoLoss defines no loss(output, batch)"),
])
def test_user_mistakes_fail_before_training_with_one_line(make_cfg, args, fragment):
    with pytest.raises(ConfigError) as info:
        train(make_cfg(*args, "trainer.max_steps=2"))
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("how, fragment", [
    ("unreduced", "returned no loss backward can start from: got tensor(64,) float32"),
    ("detached", "returned a loss that does not depend on the model's parameters")])
def test_a_later_loss_backward_cannot_start_from_is_the_tasks_line(make_cfg, how, fragment):
    """Past the first batch's checks, a loss that is no longer 0-d or no longer depends on
    the parameters met autograd's traceback ("grad can be implicitly created only for scalar
    outputs"), which named no task."""
    with pytest.raises(ConfigError) as info:
        train(make_cfg("task._target_=tests.helpers.LossGoesWrong", f"+task.how={how}",
                       "trainer.max_steps=6"))
    assert str(info.value).startswith(f"task classification: LossGoesWrong.loss(output, "
                                      f"batch) {fragment}"), str(info.value)


@pytest.mark.parametrize("args,fragment", [
    (["data=custom", "+data.dataset._target_=tests.helpers.DictDigits",
      "data.input_shape=[1,8,8]", "data.num_classes=10"],
     "task classification: a batch it cannot unpack: got dict{image: tensor(64, 1, 8, 8) "
     "float32, label: tensor(64,) int64, name: list("),
    (["optim.lr=-1"], "optim.lr=-1: torch.optim.AdamW refused it: Invalid learning rate"),
    (["data.dataset._target_=tests.helpers.StringDigits", "data.num_workers=1"],
     "data: the dataset yields samples the default collate cannot batch (default_collate: "
     "batch must contain tensors"),
])
def test_user_mistakes_are_one_line_on_the_command_line(tmp_path, args, fragment):
    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress_bar=false",
                    "trainer.max_steps=2", "data.num_workers=0", *args])
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_separate_train_and_val_dataset_nodes(make_cfg, tmp_path):
    common = ["data=custom", "data.input_shape=[10]", "+model.num_classes=1", "task=regression",
              "trainer.max_epochs=2"]
    one_node = train(make_cfg(*common, "+data.dataset._target_=tests.helpers.Diabetes",
                              run_dir=tmp_path / "one"))
    pair = train(make_cfg(*common, "+data.train_dataset._target_=tests.helpers.Diabetes",
                          "+data.train_dataset.split=train",
                          "+data.val_dataset._target_=tests.helpers.Diabetes",
                          "+data.val_dataset.split=val", run_dir=tmp_path / "pair"))
    assert pair["val_mse"] == one_node["val_mse"]  # the same data, built either way
    no_val = train(make_cfg(*common, "+data.train_dataset._target_=tests.helpers.Diabetes",
                            run_dir=tmp_path / "no_val"))
    assert not [k for k in no_val if k.startswith("val_")] and no_val["steps"] == 2 * 6


def test_modules_in_the_directory_the_command_runs_from_are_found(tmp_path):
    (tmp_path / "mynet.py").write_text(
        "import torch\n\nclass Net(torch.nn.Module):\n"
        "    def __init__(self, input_shape, num_classes, width=16):\n"
        "        super().__init__()\n"
        "        self.layers = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, width),"
        " torch.nn.ReLU(), torch.nn.Linear(width, num_classes))\n\n"
        "    def forward(self, x):\n        return self.layers(x)\n")
    args = ["model=custom", "trainer.max_steps=2", "trainer.progress_bar=false",
            "data.num_workers=0"]
    proc = run_cli([*args, "model._target_=mynet.Net", "+model.width=8",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_cli([*args, "model._target_=mynet.Nett", f"hydra.run.dir={tmp_path / 'typo'}"],
                   cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "stoker: error: model._target_=mynet.Nett: mynet has no attribute 'Nett' (did you "
        "mean mynet.Net?)")


class Embedder(torch.nn.Module):
    """Takes token ids: fed the float digits, it fails inside its forward."""

    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(20, 4)

    def forward(self, x):
        return self.e(x).flatten(1)


@pytest.mark.skipif(not hasattr(Exception, "add_note"), reason="notes need Python 3.11")
def test_a_first_forward_that_fails_inside_the_model_says_what_it_was_given():
    task, batch = Classification(), (torch.rand(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match="'indices'") as e:
        task.forward(Embedder(), batch)
    assert e.value.__notes__ == [
        "stoker: task classification: the model's first forward failed, given tuple(tensor(4, "
        "1, 8, 8) float32): do the data (data=...) and the model (model=...) fit together?"]
    with pytest.raises(RuntimeError) as again:  # later steps: the plain call, no note
        task.forward(Embedder(), batch)
    assert not getattr(again.value, "__notes__", None)


def test_a_sequence_output_gives_its_first_tensor_of_a_dimension_or_more():
    """A model returning (loss, logits) was read as predicting its scalar loss, and the
    message then blamed the targets."""
    from trainer.task import Task

    logits = torch.randn(4, 3)
    assert Task().predictions((torch.tensor(0.5), logits)) is logits
    assert Task().predictions([logits, torch.randn(4)]) is logits


def test_a_metric_failing_after_it_took_validation_inputs_keeps_its_traceback():
    """Refused at first: the task and the metric do not fit (one line); failing later, on
    inputs of the same kind: a bug in the metric's own code, whose traceback is the help."""
    from trainer.task import Task, TaskError

    class Later:
        def __init__(self):
            self.calls = 0

        def update(self, preds, target):
            self.calls += 1
            if self.calls > 2:  # (the trial's and the first validation batch's are taken)
                raise RuntimeError("boom in the metric")

        def compute(self):
            return 1.0

        def reset(self):
            pass

    class Never(Later):
        def update(self, preds, target):
            raise ValueError("wrong shapes")

    task = Task(metrics={"later": Later(), "never": Never()})
    x = torch.randn(4, 3)
    with pytest.raises(TaskError, match=r"^task\.metrics\.never: Never refused the task's") \
            as refused:
        task._update("never", task.metrics["never"], x, x)
    # where it is code of one's own, the line that raised is named (a bug reads as a refusal)
    line = Never.update.__code__.co_firstlineno + 1
    assert str(refused.value).endswith(f": wrong shapes (raised at {__file__}:{line})")
    # sequence scores, classes last, refused by a metric reading them in dimension 1
    tags, labels = torch.randn(2, 5, 3), torch.zeros(2, 5, dtype=torch.int64)
    with pytest.raises(TaskError, match=r": wrong shapes \(raised at .*\); the task gives "
                       r"sequence scores with the classes last, where torchmetrics' multiclass "
                       r"metrics read them in dimension 1: trainer.metrics.Accuracy reads "
                       r"them last, or a task of your own whose metric_inputs returns "
                       r"\(preds.flatten\(0, -2\), target.flatten\(\)\)"):
        task._update("never", task.metrics["never"], tags, labels)

    class Broken(Later):  # (a TypeError of its own: not a refusal of the layout)
        def update(self, preds, target):
            raise TypeError("unsupported operand")

    task = Task(metrics={"broken": Broken()})
    with pytest.raises(TaskError) as refused:
        task._update("broken", task.metrics["broken"], tags, labels)
    assert "classes last" not in str(refused.value)
    import torchmetrics  # an installed package's own check names no line of its code

    task = Task(metrics={"acc": torchmetrics.classification.BinaryAccuracy()})
    with pytest.raises(TaskError) as refused:
        task._update("acc", task.metrics["acc"], torch.rand(4, 3), torch.ones(5))
    assert "(raised at" not in str(refused.value)
    task = Task(metrics={"later": Later(), "never": Never()})
    task._update("later", task.metrics["later"], x, x, trial=True)  # the first training batch's
    task._update("later", task.metrics["later"], x, x)
    with pytest.raises(RuntimeError, match="boom in the metric") as info:
        task._update("later", task.metrics["later"], x, x)
    assert not isinstance(info.value, TaskError)


def test_a_first_forward_failing_on_swapped_inputs_and_target_asks_about_their_order():
    """A dataset returning (label, features): the model's error and a note naming the integer
    inputs only; the float target of more dimensions is named too, with the question."""
    model = torch.nn.Linear(20, 3)
    swapped = (torch.zeros(4, dtype=torch.long), torch.randn(4, 20))
    with pytest.raises(RuntimeError) as info:
        Classification().forward(model, swapped)
    assert info.value.__notes__[-1] == (
        "stoker: task classification: the model's first forward failed, given "
        "tuple(tensor(4,) int64) (and the target tensor(4, 20) float32: are the dataset's "
        "(inputs, target) in that order?): do the data (data=...) and the model (model=...) "
        "fit together?")
    with pytest.raises(RuntimeError) as info:  # inputs of another size: no such question
        Classification().forward(model, (torch.randn(4, 7), torch.zeros(4, dtype=torch.long)))
    assert "in that order" not in info.value.__notes__[-1]


def test_which_tensor_of_a_tuple_output_is_the_predictions_is_said_once(caplog):
    """A model returning (features, logits) trained on its 16 features as 16 classes, exit 0
    and no word: the first tensor of one dimension or more is taken, and now said, once."""
    import logging

    task = Classification()
    features, logits, loss = torch.zeros(8, 16), torch.zeros(8, 3), torch.zeros(())
    with caplog.at_level(logging.WARNING, logger="stoker"):
        for _ in range(3):  # (every step: one line)
            assert task.predictions((features, logits)) is features
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "task classification: the model's output is tuple(tensor(8, 16) float32, tensor(8, 3) "
        "float32); its element 0, tensor(8, 16) float32, the first of one dimension or more, "
        "is taken as the predictions: a model whose predictions come later (features, logits) "
        "should return them alone, or first, or in a dict or an attribute named by "
        "task.output_key ('logits')"]
    caplog.clear()
    for quiet in ((loss, logits), [logits], (logits, None)):  # one candidate: nothing to say
        with caplog.at_level(logging.WARNING, logger="stoker"):
            assert Classification().predictions(quiet) is logits
    assert not caplog.records


def test_a_metric_is_refused_at_build_without_update_compute_or_reset():
    """A metric without reset() passed the build and crashed after an epoch of training, in
    the first validation (which starts with it)."""
    from trainer.task import Task

    class NoReset:
        def update(self, preds, target):
            pass

        def compute(self):
            return torch.tensor(0.0)

    class WithReset(NoReset):
        def reset(self):
            pass

    with pytest.raises(ConfigError, match=r"^task.metrics.x: NoReset is not a metric with "
                                          r"update/compute/reset \(e.g. a torchmetrics.Metric, or a class "
                                          r"of your own\)$"):
        Task(metrics={"x": NoReset()})
    # a metric named loss is refused for its name, not called "not a metric"
    with pytest.raises(ConfigError, match=r"^task.metrics.loss: the name is val_loss's, which "
                                          r"every task logs; give the metric another name$"):
        Task(metrics={"loss": WithReset()})
    assert list(Task(metrics={"x": WithReset()}).metrics) == ["x"]


def test_a_metric_computing_a_dict_logs_each_entry_of_one_number(caplog):
    """A dict-valued metric (torchmetrics' ClasswiseWrapper, MeanAveragePrecision) was refused
    as "not one number": each entry of one number (a 0-d tensor, a number; not a bool, nor
    a list of one, whose key would come and go) is logged as val_<name>_<entry> (nested
    dicts joined alike), the others left out in a warning said once; two entries of one
    key are one line."""
    from tests.helpers import CountsByName
    from trainer.task import TaskError

    task = Classification(metrics={"per": CountsByName(at=99)})
    task.update_metrics(torch.randn(6, 3), (None, torch.arange(6) % 3))
    with caplog.at_level("WARNING", logger="stoker"):
        values = task.compute_metric("per", task.metrics["per"])
        assert task.compute_metric("per", task.metrics["per"]) == values
    assert values == {"val_per_seen": 6.0, "val_per_one": 1.0, "val_per_nested_half": 3.0}
    assert task.metric_keys("per") == list(values)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["task.metrics.per: CountsByName computed entries that are not one number, "
                    "val_per_ids (tensor(2,) int64): left out of the logs (logged: "
                    "val_per_seen, val_per_one, val_per_nested_half)"]
    caplog.clear()

    class Odd(CountsByName):
        def compute(self):
            return self.gives

    task = Classification(metrics={"odd": Odd()})
    metric = task.metrics["odd"]
    metric.gives = {"one": torch.tensor([3]), "flag": True, "t": torch.tensor(False),
                    "n": np.float32(0.5), "i": 2}
    with caplog.at_level("WARNING", logger="stoker"):
        assert task.compute_metric("odd", metric) == {"val_odd_n": 0.5, "val_odd_i": 2.0}
        metric.gives = {}  # (said for the metric once: its first)
        assert task.compute_metric("odd", metric) == {}
    assert [r.getMessage() for r in caplog.records] == [
        "task.metrics.odd: Odd computed entries that are not one number, val_odd_one "
        "(tensor(1,) int64), val_odd_flag (bool), val_odd_t (tensor() bool): left out of the "
        "logs (logged: val_odd_n, val_odd_i)"]
    task = Classification(metrics={"none": Odd()})
    task.metrics["none"].gives = {}
    with caplog.at_level("WARNING", logger="stoker"):
        assert task.compute_metric("none", task.metrics["none"]) == {}
    assert caplog.records[-1].getMessage() == ("task.metrics.none: Odd computed an empty "
                                               "dict: left out of the logs")
    metric.gives = {"a_b": 1.0, "a": {"b": 2.0}}  # (the second overwrote the first, unsaid)
    with pytest.raises(TaskError, match=r"^task.metrics.odd: Odd computed two entries logged "
                                        r"as val_odd_a_b \(one nested in a dict\): rename "
                                        r"one$"):
        Classification(metrics={"odd": metric}).compute_metric("odd", metric)
    # per-class values in a collection: left out, with the wrapper that logs them
    from torchmetrics import MetricCollection
    from torchmetrics.classification import MulticlassPrecision

    caplog.clear()
    task = Classification(metrics={"pr": MetricCollection({"precision": MulticlassPrecision(
        num_classes=3, average=None)})})
    task.update_metrics(torch.eye(3)[[0, 1, 2, 0]], (None, torch.tensor([0, 1, 1, 0])))
    with caplog.at_level("WARNING", logger="stoker"):
        assert task.compute_metric("pr", task.metrics["pr"]) == {}
    assert caplog.records[-1].getMessage() == (
        "task.metrics.pr: MetricCollection computed entries that are not one number, "
        "val_pr_precision (tensor(3,) float32): left out of the logs; values per class are "
        "logged one by one through torchmetrics.wrappers.ClasswiseWrapper (in a "
        "MetricCollection too)")
    # per-class values of torchmetrics' own, through its wrapper
    from torchmetrics.classification import MulticlassAccuracy
    from torchmetrics.wrappers import ClasswiseWrapper

    task = Classification(metrics={"pc": ClasswiseWrapper(
        MulticlassAccuracy(num_classes=3, average=None), labels=["a", "b", "c"])})
    task.update_metrics(torch.eye(3)[[0, 1, 2, 0]], (None, torch.tensor([0, 1, 1, 0])))
    assert task.compute_metric("pc", task.metrics["pc"]) == {
        "val_pc_multiclassaccuracy_a": 1.0, "val_pc_multiclassaccuracy_b": 0.5,
        "val_pc_multiclassaccuracy_c": 0.0}


def test_a_run_logs_a_dict_metrics_entries_and_keeps_best_pt_by_one(make_cfg, tmp_path):
    """torchmetrics' per-class F1 through its ClasswiseWrapper, from the config: each class
    in metrics.jsonl and the summary, best.pt by one of them, early stopping watching it; an
    entry it does not compute stops the run before its first step, nothing saved."""
    import json

    per_class = ["+task.metrics.f1._target_=torchmetrics.wrappers.ClasswiseWrapper",
                 "+task.metrics.f1.metric._target_=torchmetrics.classification."
                 "MulticlassF1Score", "+task.metrics.f1.metric.num_classes=10",
                 "+task.metrics.f1.metric.average=null", "trainer.max_epochs=3"]
    s = train(make_cfg(*per_class, "trainer.checkpoint.monitor=val_f1_multiclassf1score_3",
                       "trainer.early_stopping.patience=5"))
    keys = [f"val_f1_multiclassf1score_{c}" for c in range(10)]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    val = [r for r in rows if r["split"] == "val"]
    assert len(val) == 3 and all(set(keys) <= r.keys() and "val_f1" not in r for r in val)
    assert set(keys) <= s.keys() and 0 < s["val_f1_multiclassf1score_3"] <= 1
    best = max(val, key=lambda r: r["val_f1_multiclassf1score_3"])
    assert s["best"] == {"monitor": "val_f1_multiclassf1score_3", "step": best["step"],
                         "value": best["val_f1_multiclassf1score_3"]}
    run_dir = tmp_path / "typo"
    with pytest.raises(ConfigError, match=r"^trainer.checkpoint.monitor=val_f1_multiclassf1"
                                          r"score_33: task.metrics.f1 \(ClasswiseWrapper\) "
                                          r"logs val_f1_multiclassf1score_0, "):
        train(make_cfg(*per_class, "trainer.checkpoint.monitor=val_f1_multiclassf1score_33",
                       run_dir=run_dir))
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()
    # a metric whose compute needs more than the first training batch: its keys are known
    # once the sanity check gave it the first validation batch too, before the first step
    needs = ["+task.metrics.c._target_=tests.helpers.CountsByName", "+task.metrics.c.at=99",
             "+task.metrics.c.least=100"]
    with pytest.raises(ConfigError, match=r"^trainer.checkpoint.monitor=val_c_sen: task."
                                          r"metrics.c \(CountsByName\) logs val_c_seen, "):
        train(make_cfg(*needs, "trainer.checkpoint.monitor=val_c_sen", run_dir=run_dir))
    # one key of two metrics: before the first step too, not after an epoch's training
    with pytest.raises(ConfigError, match=r"^task.metrics.c_one: its value val_c_one is "
                                          r"logged by task.metrics.c too; give the metric "
                                          r"another name"):
        train(make_cfg(*needs[:2], "+task.metrics.c_one._target_=trainer.metrics.Accuracy",
                       run_dir=run_dir))
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


def test_a_monitored_entry_that_the_metrics_do_not_compute_is_one_line():
    """trainer.checkpoint.monitor naming an entry of a dict-valued metric is taken at the
    start with the direction of the metrics it could belong to (the entries are known once
    they compute; of metrics `m` and `m_acc`, val_m_acc_top1 may be either's) and checked
    once they all computed: an entry none of them has, or a metric's own key where it
    computes a dict, would leave best.pt and early stopping without a value, so it is one
    line; so is a key that two metrics log, or a metric and the loss."""
    from tests.helpers import CountsByName
    from trainer.checks import monitor_mode
    from trainer.metrics import Accuracy
    from trainer.task import TaskError

    task = Classification(metrics={"per": CountsByName(at=99), "per_x": Accuracy()})
    assert task.entry_metrics("val_per_seen") == ["per"]
    assert task.entry_metrics("val_per_x_y") == ["per", "per_x"]
    assert task.entry_metrics("val_acc_x") == []
    task.update_metrics(torch.randn(6, 3), (None, torch.arange(6) % 3))
    task.monitored = "val_per_x_y"
    task.compute_metric("per", task.metrics["per"])
    task.check_keys()  # (per_x has not computed: it may log it)
    task.compute_metric("per_x", task.metrics["per_x"])
    with pytest.raises(TaskError, match=r"^trainer.checkpoint.monitor=val_per_x_y: task.metrics."
                                        r"per \(CountsByName\), task.metrics.per_x \(Accuracy\) "
                                        r"logs val_per_seen, val_per_one, val_per_nested_half, "
                                        r"val_per_x$"):
        task.check_keys()
    task.monitored = "val_per_seen"
    task.check_keys()
    for key, said in (("val_per_sen", "val_per_nested_half (did you mean val_per_seen?)"),
                      # (a nested entry named by its end: ClasswiseWrapper's val_f1_3)
                      ("val_per_half", "val_per_nested_half (did you mean "
                                       "val_per_nested_half?)"),
                      ("val_per", "val_per_nested_half; it computes a dict: monitor one of "
                                  "its entries")):
        task.monitored = key
        with pytest.raises(TaskError) as e:
            task.check_keys()
        assert str(e.value) == (f"trainer.checkpoint.monitor={key}: task.metrics.per "
                                "(CountsByName) logs val_per_seen, val_per_one, " + said)
    # one key of two metrics (metric a's entry b and a metric a_b), or a metric and the loss
    task = Classification(metrics={"a": CountsByName(at=99), "a_one": Accuracy()})
    task.update_metrics(torch.randn(6, 3), (None, torch.arange(6) % 3))
    task.compute_metric("a", task.metrics["a"])
    task.compute_metric("a_one", task.metrics["a_one"])
    with pytest.raises(TaskError, match=r"^task.metrics.a_one: its value val_a_one is logged "
                                        r"by task.metrics.a too; give the metric another name$"):
        task.check_keys()
    task = Classification(metrics={"val": CountsByName(at=99)})
    task.metrics["val"].compute = lambda: {"loss": 1.0}
    task.compute_metric("val", task.metrics["val"])  # (val_val_loss: no clash)
    task.check_keys()
    # at the start: the entry takes its metrics' direction; one of no metric is refused
    from omegaconf import OmegaConf

    def cfg(monitor, mode=None):
        return OmegaConf.create({"trainer": {"limit_val_batches": 1.0, "checkpoint": {
            "monitor": monitor, "mode": mode}}})

    task = Classification(metrics={"per": CountsByName(at=99), "per_x": Accuracy()})
    directions = task.higher_is_better()
    assert monitor_mode(cfg("val_per_seen"), directions, task.entry_metrics) == "max"
    with pytest.raises(ConfigError, match=r"^trainer.checkpoint.mode=min: val_per_x_y is "
                                          r"better when higher; use max or null$"):
        monitor_mode(cfg("val_per_x_y", "min"), directions, task.entry_metrics)
    with pytest.raises(ConfigError, match=r"^trainer.checkpoint.monitor=val_pr_seen: must be "
                                          r"null or a logged validation key: val_loss, val_per, "
                                          r"val_per_x \(or val_<metric>_<entry>"):
        monitor_mode(cfg("val_pr_seen"), directions, task.entry_metrics)
    lower = Classification(metrics={"per": CountsByName(at=99), "per_x": Accuracy()})
    lower.metrics["per"].higher_is_better = False  # (two directions: the mode is asked for)
    with pytest.raises(ConfigError, match=r"^trainer.checkpoint.mode=null: val_per_x_y does "
                                          r"not say which direction is better; set max or "
                                          r"min$"):
        monitor_mode(cfg("val_per_x_y"), lower.higher_is_better(), lower.entry_metrics)


def test_a_metric_named_as_a_derived_value_is_refused_where_it_was_replaced():
    """`task.metrics.ppl` under a token task logged the derived perplexity in its place, exit
    0."""
    from trainer.metrics import Accuracy
    from trainer.tasks import LanguageModel, ModelLoss

    for task in (LanguageModel(metrics={"ppl": Accuracy()}),
                 ModelLoss(count="tokens", metrics={"ppl": Accuracy()})):
        with pytest.raises(ConfigError, match=r"^task.metrics.ppl: the name is val_ppl's, which "
                                              r"task \S+ derives from the validation results; "
                                              r"give the metric another name$"):
            task.higher_is_better()
    assert ModelLoss(count="samples", metrics={"ppl": Accuracy()}).higher_is_better() == {
        "val_loss": False, "val_ppl": True}  # (no perplexity of samples: the name is free)
    assert LanguageModel(metrics={"acc": Accuracy()}).higher_is_better() == {
        "val_loss": False, "val_acc": True, "val_ppl": False}


    class Mine(LanguageModel):  # (a task of one's own over a built-in one: its keys and the
        def derived_keys(self):  # built-in one's, its own name checked like them)
            return {**super().derived_keys(), "val_bits": False}

        def higher_is_better(self):
            return {**super().higher_is_better(), "val_extra": True}

    assert Mine(metrics={"acc": Accuracy()}).higher_is_better() == {
        "val_loss": False, "val_acc": True, "val_ppl": False, "val_bits": False,
        "val_extra": True}
    with pytest.raises(ConfigError, match=r"^task.metrics.bits: the name is val_bits's"):
        Mine(metrics={"bits": Accuracy()}).higher_is_better()


def test_an_os_error_of_ones_own_code_names_its_type_and_where_it_was_raised(tmp_path):
    """A ConnectionError in a model's forward was said as its message alone ("metrics server
    went away"), nothing naming the model or the line: an OSError counts as one of the run's
    own (a full disk, an unreadable file), said in one line without a traceback."""
    from trainer.task import raised_in_users_code

    def raised(filename, error="ConnectionError('metrics server went away')"):
        space = {}
        exec(compile(f"def f():\n    raise {error}\n", filename, "exec"), space)
        try:
            space["f"]()
        except Exception as e:  # noqa: BLE001
            return e

    mine = tmp_path / "mypkg" / "models.py"
    assert raised_in_users_code(raised(str(mine))) == \
        f" (ConnectionError raised at {mine}:2)"
    assert raised_in_users_code(raised(str(ROOT / "trainer" / "x.py"))) == ""  # Stoker's own
    assert raised_in_users_code(raised(str(mine), "ValueError('x')")) == ""  # (a traceback)
    assert raised_in_users_code(raised("<string>")) == ""
    # one a package raised, called from one's own code: its type and the call (Pillow's
    # "cannot identify image file" named neither)
    PIL = pytest.importorskip("PIL.Image")
    garbage = tmp_path / "bogus.png"
    garbage.write_bytes(b"not an image")
    e = raised(str(mine), f"(__import__('PIL.Image').Image.open({str(garbage)!r}), 1)")
    assert isinstance(e, PIL.UnidentifiedImageError)
    assert raised_in_users_code(e) == f" (PIL.UnidentifiedImageError from a call at {mine}:2)"
    e = raised(str(mine), "open(__import__('os').devnull + '/x')")  # (a builtin's: no package)
    assert raised_in_users_code(e) == f" (NotADirectoryError raised at {mine}:2)"

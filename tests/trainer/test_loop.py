"""The loop learns, weights accumulated micro-batches exactly, trains in fp32 and bf16, and
hands callbacks their saved states on a resume."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, final_weights, run_cli
from trainer.loop import Callback
from trainer.runner import train


def test_default_job_learns_digits(make_cfg):
    summary = train(make_cfg("trainer.max_epochs=6"))
    assert summary["val_acc"] >= 0.95
    assert summary["epochs"] == 6 and summary["steps"] == 6 * 23  # ceil(1438 / 64) = 23


def test_accumulation_matches_a_larger_batch(make_cfg, tmp_path):
    """2 x 16 with accumulation equals one batch of 32: same data order, same updates."""
    common = ["trainer.max_steps=12", "trainer.grad_clip=1.0"]
    big = train(make_cfg("data.batch_size=32", *common, run_dir=tmp_path / "big"))
    acc = train(make_cfg("data.batch_size=16", "trainer.accumulate_grad_batches=2", *common,
                         run_dir=tmp_path / "acc"))
    small = train(make_cfg("data.batch_size=16", *common, run_dir=tmp_path / "small"))
    assert big["steps"] == acc["steps"] == 12
    a, b, c = final_weights(big), final_weights(acc), final_weights(small)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    # the comparison can fail: without accumulation the same step count sees other data
    assert any(not torch.allclose(a[k], c[k], atol=1e-4) for k in a)


def test_clipping_is_applied_by_the_loop(make_cfg, tmp_path):
    """trainer.grad_clip reaches the optimizer step: a bound far above the norm leaves the
    steps bitwise as unclipped, a tiny one changes them."""
    common = ["trainer.max_steps=6", "trainer.log_every_n_steps=100"]
    runs = {clip: final_weights(train(make_cfg(f"trainer.grad_clip={clip}", *common,
                                               run_dir=tmp_path / clip)))
            for clip in ("null", "1e9", "1e-4")}
    for k in runs["null"]:
        assert torch.equal(runs["null"][k], runs["1e9"][k])
    assert any(not torch.allclose(runs["null"][k], runs["1e-4"][k]) for k in runs["null"])


def test_accumulation_handles_a_short_last_window(make_cfg, tmp_path):
    """A whole epoch: 1438 samples = 44 x 32 + 30; batch 16 gives 89 + 1 short batch."""
    big = train(make_cfg("data.batch_size=32", "trainer.max_epochs=1", run_dir=tmp_path / "b"))
    acc = train(make_cfg("data.batch_size=16", "trainer.accumulate_grad_batches=2",
                         "trainer.max_epochs=1", run_dir=tmp_path / "a"))
    assert big["steps"] == acc["steps"] == 45
    a, b = final_weights(big), final_weights(acc)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("placement", ["host", "device"])
def test_steps_are_a_hand_written_loops_steps_bitwise(make_cfg, tmp_path, placement):
    """One process, no accumulation: the update is the plain one, the epoch's short last
    batch (1438 = 22 x 64 + 30) included: no weighting that rounds differently."""
    import torch.nn.functional as F

    from data.datasets import DigitsDataset
    from trainer.models import MLP

    summary = train(make_cfg("trainer.max_steps=26", "sched=constant", "seed=3",
                             f"data.placement={placement}", run_dir=tmp_path / placement))
    x, y = DigitsDataset("train").tensors
    torch.manual_seed(3)
    model = MLP([1, 8, 8], 10)
    opt = torch.optim.AdamW(model.parameters(), lr=0.003, weight_decay=0.01)
    step = 0
    for epoch in range(2):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(3 + epoch))
        for idx in order.split(64)[:26 - step]:
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
    assert step == 26
    weights = final_weights(summary)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_precisions_train(make_cfg, tmp_path, precision):
    summary = train(make_cfg(f"trainer.precision={precision}", "trainer.max_epochs=4",
                             run_dir=tmp_path / precision))
    assert summary["val_acc"] >= 0.9, summary


def test_scheduler_steps_per_optimizer_step(make_cfg, tmp_path):
    """StepLR halving every 5 optimizer steps: after 10 steps (20 micro-batches), lr / 4."""
    summary = train(make_cfg("sched=step", "sched.step_size=5", "trainer.max_steps=10",
                             "trainer.accumulate_grad_batches=2", "trainer.log_every_n_steps=10"))
    state = torch.load(summary["checkpoint"], weights_only=True)
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.003 / 4)
    assert state["scheduler"]["last_epoch"] == 10


def test_language_model_learns_synthetic_tokens_and_logs_tokens_per_second(make_cfg, tmp_path):
    summary = train(make_cfg("experiment=tokens_transformer", "data.dataset.num_samples=512",
                             "data.input_shape=[32]", "data.num_classes=32",
                             "trainer.max_epochs=4", "optim.lr=0.003", run_dir=tmp_path))
    # the successor table explains 90% of next tokens (+ 1/32 of the rest by chance)
    assert summary["val_acc"] > 0.8 and summary["val_loss"] < 1.5
    # every sample's 32 targets are counted: 32 tokens a sample, over the same seconds
    assert summary["run_tokens_per_s"] == pytest.approx(32 * summary["run_samples_per_s"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert train_rows and all(r["tokens_per_s"] == pytest.approx(32 * r["samples_per_s"])
                              for r in train_rows)


class CountSteps(Callback):
    """A user callback whose count must survive a resume."""

    def __init__(self):
        self.steps = 0

    def after_step(self, loop):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


@pytest.mark.parametrize("when", ["train", "eval"])
def test_a_crash_mid_pass_ends_its_workers_then_not_in_the_interpreters_shutdown(tmp_path,
                                                                                 when):
    """The pass's generator is closed as the error leaves it: left to the shutdown (the
    traceback's frames held it), its clean-up printed "Exception ignored ... sys.meta_path is
    None" as the run's last lines, below the error."""
    proc = run_cli(["model=custom", "model._target_=tests.helpers.FailsOnForward",
                    f"+model.when={when}", "+model.at=2", "data.placement=host",
                    "data.num_workers=2", "trainer.max_steps=30", "trainer.progress_bar=false",
                    "trainer.print_config=false", f"hydra.run.dir={tmp_path}"])
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1] == \
        "RuntimeError: a bug in the model's own forward", proc.stderr[-2000:]
    assert "Exception ignored" not in proc.stderr


def test_a_resume_past_a_lowered_epoch_limit_does_not_validate_its_step_again(make_cfg,
                                                                               tmp_path):
    """Stopped at step 15 (validated there), resumed with trainer.limit_train_batches=5: the
    epoch's plan is empty, and its end validated step 15 again, a second row for the step."""
    run_dir = tmp_path / "run"
    train(make_cfg("trainer.max_steps=15", "trainer.max_epochs=-1", run_dir=run_dir))
    train(make_cfg("trainer.max_epochs=2", "trainer.limit_train_batches=5",
                   f"trainer.resume={run_dir / 'checkpoints' / 'last.pt'}", run_dir=run_dir))
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("split") == "val"] == [15, 20]
    # where that epoch is the run's last, it validates: its summary holds the values
    other = tmp_path / "other"
    train(make_cfg("trainer.max_steps=15", "trainer.max_epochs=-1", run_dir=other))
    summary = train(make_cfg("trainer.max_epochs=1", "trainer.limit_train_batches=5",
                             f"trainer.resume={other / 'checkpoints' / 'last.pt'}",
                             run_dir=other))
    assert "val_loss" in summary and "val_loss" in json.loads(
        (other / "summary.json").read_text())


def test_callback_states_travel_in_checkpoints_by_class_name(make_cfg):
    first, second, stateless = CountSteps(), CountSteps(), Callback()
    train(make_cfg("trainer.max_epochs=1"), callbacks=[first, stateless, second])
    assert first.steps == second.steps == 23
    again = [CountSteps(), Callback(), CountSteps()]
    again[2].steps = -1  # a state left as it was would show
    summary = train(make_cfg("trainer.max_epochs=2", "trainer.resume=auto"), callbacks=again)
    assert summary["steps"] == again[0].steps == again[2].steps == 46
    saved = torch.load(Path(summary["checkpoint"]), weights_only=True)["callbacks"]
    assert saved == {"CountSteps": {"steps": 46}, "CountSteps.1": {"steps": 46}}


def test_callbacks_from_the_config_run_beside_pythons_and_their_state_travels(make_cfg,
                                                                            tmp_path):
    """trainer.callbacks: the way train.py, sweeps and torchrun jobs attach one's own
    (before: from Python only); built by _target_, before those given to train()."""
    python = CountSteps()
    args = ("+trainer.callbacks.count._target_=tests.trainer.test_loop.CountSteps",)
    summary = train(make_cfg("trainer.max_steps=5", *args, run_dir=tmp_path / "run"),
                    callbacks=[python])
    saved = torch.load(Path(summary["checkpoint"]), weights_only=True)["callbacks"]
    assert python.steps == 5 and saved == {"CountSteps": {"steps": 5},
                                           "CountSteps.1": {"steps": 5}}
    again = train(make_cfg("trainer.max_steps=8", *args, "trainer.resume=auto",
                           run_dir=tmp_path / "run"), callbacks=[CountSteps()])
    assert torch.load(Path(again["checkpoint"]), weights_only=True)["callbacks"] == {
        "CountSteps": {"steps": 8}, "CountSteps.1": {"steps": 8}}


@pytest.mark.parametrize("args,given,said", [
    (["+trainer.callbacks.x._target_=collections.OrderedDict"], [],
     "trainer.callbacks.x: collections.OrderedDict is not a trainer.loop.Callback (subclass "
     "it: after_step, after_epoch, should_stop, state_dict)"),
    ([], [CountSteps], "callbacks[0]: the class CountSteps, not an instance of it: give "
                       "CountSteps(...)"),
    ([], [CountSteps(), object()], "callbacks[1]: builtins.object is not a "
                                   "trainer.loop.Callback"),
])
def test_a_callback_that_is_none_is_one_line_naming_it(make_cfg, args, given, said):
    """A class for an instance, or any other object: a traceback from inside the loop's
    state_dict before."""
    from trainer.config import ConfigError

    with pytest.raises(ConfigError) as e:
        train(make_cfg("trainer.max_steps=2", *args), callbacks=given)
    assert str(e.value).startswith(said)


@pytest.mark.parametrize("hook", ["after_step", "after_epoch", "should_stop", "state_dict",
                                  "load_state_dict"])
def test_a_callback_that_raises_keeps_its_traceback_with_a_line_naming_its_hook(make_cfg,
                                                                                hook, tmp_path):
    """should_stop and state_dict had no line; a load_state_dict that raised on a resume was
    said as the checkpoint's optimizer or scheduler state not fitting the run, exit 2."""
    class Breaks(Callback):
        def after_step(self, loop):
            if hook == "after_step" and loop.state.step == 3:
                raise ValueError("a bug in my callback")

        def after_epoch(self, loop, val):
            if hook == "after_epoch":
                raise ValueError("a bug in my callback")

        def should_stop(self, loop):
            if hook == "should_stop" and loop.state.step == 23:  # (asked at epoch ends)
                raise ValueError("a bug in my callback")
            return None

        def state_dict(self):
            if hook == "state_dict":
                raise ValueError("a bug in my callback")
            return {"mine": 1}

        def load_state_dict(self, state):
            raise ValueError("a bug in my callback")

    run_dir = tmp_path / "run"
    if hook == "load_state_dict":
        train(make_cfg("trainer.max_epochs=1", run_dir=run_dir), callbacks=[Breaks()])
    with pytest.raises(ValueError, match="a bug in my callback") as e:
        train(make_cfg("trainer.max_epochs=2" if hook == "load_state_dict" else
                       "trainer.max_epochs=1", "trainer.resume=auto", run_dir=run_dir),
              callbacks=[Breaks()])
    step = {"after_step": 3, "state_dict": 0}.get(hook, 23)  # (a state is taken at start)
    assert e.value.__notes__ == [
        f"stoker: in the callback {__name__}.test_a_callback_that_raises_keeps_its_traceback_"
        f"with_a_line_naming_its_hook.<locals>.Breaks.{hook}, at step {step}"]


class StopAtTwoValidations(Callback):
    """Counts validations in its own state and stops after the second."""

    def __init__(self):
        self.validations = 0

    def after_epoch(self, loop, val):
        self.validations += val is not None

    def should_stop(self, loop):
        return "two validations are enough" if self.validations >= 2 else None

    def state_dict(self):
        return {"validations": self.validations}

    def load_state_dict(self, state):
        self.validations = state["validations"]


def test_a_callback_of_ones_own_ends_the_run_and_its_checkpoint_knows_it(make_cfg, caplog):
    """The checkpoint of an epoch holds the callback's state after that epoch (checkpointing
    comes last): a resume of the stopped run trains nothing, where it trained an epoch more."""
    stopper = StopAtTwoValidations()
    summary = train(make_cfg("trainer.max_epochs=5"), callbacks=[stopper])
    assert (summary["epochs"], summary["steps"]) == (2, 46)
    assert summary["stopped_early"] == "two validations are enough"
    assert summary["val_acc"] > 0  # validated where it stopped
    saved = torch.load(Path(summary["checkpoint"]), weights_only=True)["callbacks"]
    assert saved["StopAtTwoValidations"] == {"validations": 2}
    with caplog.at_level(logging.INFO, logger="stoker"):
        again = train(make_cfg("trainer.max_epochs=5", "trainer.resume=auto"),
                      callbacks=[StopAtTwoValidations()])
    assert again["complete"] and again["steps"] == 46
    assert ("(it stopped early: two validations are enough) and its files are left as they "
            "are; the callback that stopped it decides whether it trains on") in caplog.text


def test_a_callback_that_stops_at_once_trains_nothing_and_says_so(make_cfg, caplog):
    class Spent(Callback):
        def should_stop(self, loop):
            return "budget spent"

    with caplog.at_level(logging.INFO, logger="stoker"):
        summary = train(make_cfg("trainer.max_epochs=5", "trainer.save_checkpoint=false"),
                        callbacks=[Spent()])
    assert summary["steps"] == 0 and summary["stopped_early"] == "budget spent"
    assert "stopping early before the first epoch, at step 0: budget spent" in caplog.text


STOP_ON_RANK_1 = """
import json, os, sys
sys.path.insert(0, {root!r})
from tests.helpers import compose_cfg
from trainer.loop import Callback
from trainer.runner import train

class OnRankOne(Callback):  # sees what the other rank does not (a stop file, a budget)
    def should_stop(self, loop):
        return "rank 1's budget" if os.environ["RANK"] == "1" and loop.state.epoch >= 1 else None

summary = train(compose_cfg({run!r}, "trainer.max_epochs=4"), callbacks=[OnRankOne()])
# a file a rank: the lines two ranks print to one pipe can interleave
with open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump([summary["steps"], summary["stopped_early"]], f)
"""


def test_a_stop_one_rank_asks_for_stops_every_rank(tmp_path):
    from tests.helpers import TORCHRUN, launch

    script = tmp_path / "stop.py"
    script.write_text(STOP_ON_RANK_1.format(root=str(ROOT), run=str(tmp_path / "run"),
                                            out=str(tmp_path)))
    proc = launch(TORCHRUN + ["--standalone", "--nproc_per_node=2", str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert results == [[12, "a callback on another rank asked to stop"],
                       [12, "rank 1's budget"]]  # both after epoch 0 (12 steps)


@pytest.mark.parametrize("limits", [["trainer.max_epochs=2"],  # said at the first epoch's end
                                    ["trainer.max_steps=30", "trainer.log_every_n_steps=5"]])
def test_a_run_whose_batches_count_nothing_for_the_loss_stops_in_one_line(make_cfg, tmp_path,
                                                                          limits):
    """Every target ignored (labels all -100 under task.count=tokens): the run trained on
    zero gradients, logged NaN losses and exited 0 with its checkpoints. It stops at its
    first epoch's end, or its first logging boundary after that, naming the count."""
    from trainer.task import TaskError

    with pytest.raises(TaskError) as e:
        train(make_cfg("task._target_=tests.helpers.NothingCounted", *limits))
    # (a window of padding alone is fine: the run is judged once it trained an epoch)
    steps = 23 if limits[0].startswith("trainer.max_epochs") else 25
    assert str(e.value).startswith(
        f"task classification: the run's {steps} optimizer steps so far counted nothing for "
        "the loss to average over, in ")
    assert str(e.value).endswith("is every target ignored? (NothingCounted.count(batch) was 0 "
                                 "for every batch; with task.count=tokens, labels of -100 are "
                                 "left out)")
    if steps == 23:  # (stopped before the epoch's save)
        assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_first_window_of_padding_alone_does_not_stop_the_run(make_cfg):
    """A batch that counts nothing weighs 0 (tasks.py): a first logging window of such
    batches is no run on nothing."""
    summary = train(make_cfg("task._target_=tests.helpers.FirstBatchesUncounted",
                             "trainer.log_every_n_steps=1", "trainer.max_steps=30"))
    assert summary["steps"] == 30

"""trainer/metricchecks.py: each metric tried on a copy before the first step, so that one
that cannot take the task's inputs stops the run before its training."""
from __future__ import annotations

import pytest
import torch

from trainer.loop import Callback
from trainer.metricchecks import check_metrics
from trainer.runner import train
from trainer.tasks import Classification


def test_a_metric_whose_update_fails_stops_the_run_at_its_first_step_naming_it(make_cfg,
                                                                              tmp_path):
    """Metrics run at validation, after the first epoch's training: each is tried on the first
    training batch instead (a copy), so its error comes before any training is spent; an error
    inside the metric's own code keeps its traceback, with a line naming the metric."""
    seen = []

    class Steps(Callback):
        def after_step(self, loop):
            seen.append(loop.state.step)

    with pytest.raises(ZeroDivisionError) as info:
        train(make_cfg("+task.metrics.bad._target_=tests.helpers.BrokenMetric"),
              callbacks=[Steps()])
    assert seen == []
    assert info.value.__notes__[-1].startswith("stoker: task.metrics.bad: BrokenMetric.update() "
                                               "failed, given tuple(tensor(64, 10) float32")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_metric_whose_compute_fails_on_one_batch_only_warns_at_the_first_step(make_cfg,
                                                                                caplog):
    """Some metrics need more samples than one batch has: the trial's compute() warns, the
    sanity check's, given the first validation batch too, passes, and validation computes it
    over the whole set (the validation batch alone is too few: 256)."""
    summary = train(make_cfg("+task.metrics.many._target_=tests.helpers.NeedsSamples",
                             "+task.metrics.many.least=300", "trainer.max_epochs=1"))
    assert summary["steps"] == 23 and summary["val_many"] == 359  # (the whole validation set)
    warned = [r.getMessage() for r in caplog.records if "on the first training" in r.getMessage()]
    assert warned == ["task.metrics.many: NeedsSamples.compute() failed on the first training "
                      "batch (ValueError: needs 300 samples, has 64); validation computes it "
                      "over the whole set"]


def test_a_metric_whose_compute_fails_on_a_training_and_a_validation_batch_stops_at_once(
        make_cfg, tmp_path):
    """It failed for good at the first validation, after an epoch of training that no
    checkpoint kept; tried again in the sanity check, it stops the run before its first step,
    its traceback and a line naming it kept. trainer.sanity_check=false leaves it to the
    validation, where the inputs it was given are named."""
    seen = []

    class Steps(Callback):
        def after_step(self, loop):
            seen.append(loop.state.step)

    metric = ["+task.metrics.bad._target_=tests.helpers.BrokenMetric",
              "+task.metrics.bad.fails=compute"]
    with pytest.raises(ZeroDivisionError) as info:
        train(make_cfg(*metric), callbacks=[Steps()])
    assert seen == []
    assert info.value.__notes__[0] == (
        "stoker: task.metrics.bad: BrokenMetric.compute() failed on the first training batch "
        "and again given the first validation batch too, before the first step (this one "
        "tuple(tensor(256, 10) float32, tensor(256,) int64)): does the metric take these? (a "
        "binary metric takes one score per sample, a multiclass one a score per class); "
        "trainer.sanity_check=false leaves it to the validation after the first epoch")
    with pytest.raises(ZeroDivisionError) as info:
        train(make_cfg(*metric, "trainer.sanity_check=false", run_dir=tmp_path / "unchecked"),
              callbacks=[Steps()])
    assert seen == list(range(1, 24))  # a whole epoch trained
    assert info.value.__notes__[-1] == (  # (the same failure twice: the inputs are named)
        "stoker: task.metrics.bad: BrokenMetric.compute() failed over the validation set as on "
        "the first training batch, given tuple(tensor(64, 10) float32, tensor(64,) int64): does "
        "the metric take these? (a binary metric takes one score per sample, a multiclass one a "
        "score per class)")


def test_a_metric_trial_whose_sync_meets_a_lost_peer_raises_it_not_a_metric_warning(caplog):
    """Under torchrun a rank that crashed made rank 0's trial compute() fail in gloo: it was
    said as the metric's failure (and the run went on) before the lost peer's line."""
    class Syncing(torch.nn.Module):
        def update(self, preds, target):
            pass

        def compute(self):
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                               "Connection closed by peer [127.0.0.1]:5555")

        def reset(self):
            pass

    task = Classification(metrics={"acc": Syncing()})
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        check_metrics(task, torch.zeros(2, 3), (None, torch.tensor([0, 1])))
    assert not [r for r in caplog.records if "on the first training" in r.getMessage()]

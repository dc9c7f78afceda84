"""trainer/earlystop.py: a run ends once trainer.checkpoint.monitor stops improving; the count
travels in its checkpoints, a stopped run is complete, and every rank stops alike."""
from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from tests.helpers import read_metrics, summary_of, torchrun
from trainer.earlystop import EarlyStopping, improves
from trainer.runner import train


def validate(stopper: EarlyStopping, *values: float) -> list:
    """Each value as one validation's result; the reason to stop after each (None: go on)."""
    loop = SimpleNamespace(state=SimpleNamespace(step=0))
    said = []
    for value in values:
        loop.state.step += 10
        stopper.after_epoch(loop, {"val_loss": value})
        said.append(stopper.should_stop(loop))
    return said


def test_counts_validations_since_an_improvement_larger_than_min_delta():
    stopper = EarlyStopping("val_loss", "min", patience=2, min_delta=0.05)
    said = validate(stopper, 1.0, 0.9, 0.88, 0.8, 0.79, 0.78)
    assert said[:5] == [None] * 5  # 0.88: not 0.05 better than 0.9; 0.8 is
    assert said[5] == ("val_loss has not improved on 0.8 (step 40) by more than 0.05 in "
                       "trainer.early_stopping.patience=2 validations")
    rising = EarlyStopping("val_acc", "max", patience=1)
    rising.after_epoch(SimpleNamespace(state=SimpleNamespace(step=5)), {"val_acc": 0.5})
    rising.after_epoch(SimpleNamespace(state=SimpleNamespace(step=9)), {"val_acc": 0.5})
    assert rising.should_stop(None).startswith("val_acc has not improved on 0.5 (step 5) in")


def test_a_value_that_is_not_a_number_never_improves_and_an_epoch_without_one_counts_none():
    stopper = EarlyStopping("val_loss", "min", patience=2)
    assert validate(stopper, float("nan"), float("nan")) == [
        None, "val_loss has no finite value yet in trainer.early_stopping.patience=2 "
              "validations (NaN or inf in the validation data, or a metric that computes "
              "none?)"]
    stopper = EarlyStopping("val_loss", "min", patience=1)
    validate(stopper, 1.0)
    stopper.after_epoch(None, None)  # an epoch that did not validate
    assert stopper.should_stop(None) is None


def test_the_count_goes_on_after_a_resume_and_starts_afresh_for_another_monitor():
    stopper = EarlyStopping("val_loss", "min", patience=3)
    validate(stopper, 1.0, 1.1)
    state = json.loads(json.dumps(stopper.state_dict()))  # (plain types: a safe load takes them)
    resumed = EarlyStopping("val_loss", "min", patience=3)
    resumed.load_state_dict(state)
    assert validate(resumed, 1.2, 1.3)[-1] is not None  # 3 since the best, across the resume
    other = EarlyStopping("val_acc", "max", patience=3)
    other.load_state_dict(state)
    assert (other.best, other.waited) == (None, 0)


ARGS = ("+task.metrics.score._target_=tests.helpers.Scripted", "trainer.checkpoint.mode=min",
        "trainer.checkpoint.monitor=val_score", "trainer.early_stopping.patience=2",
        "trainer.max_epochs=10")


def test_a_run_stops_early_and_a_resume_of_it_trains_nothing_unless_patience_grows(
        make_cfg, tmp_path, monkeypatch, caplog):
    from tests.helpers import Scripted

    monkeypatch.setattr(Scripted, "values", [0.5, 0.4, 0.45, 0.41])
    with caplog.at_level(logging.INFO, logger="stoker"):
        summary = train(make_cfg(*ARGS))
    assert (summary["epochs"], summary["steps"]) == (4, 92)  # 23 steps an epoch, of 10
    assert summary["stopped_early"] == ("val_score has not improved on 0.4 (step 46) in "
                                        "trainer.early_stopping.patience=2 validations")
    assert summary_of(tmp_path / "run")["stopped_early"] == summary["stopped_early"]
    assert [r["val_score"] for r in read_metrics(tmp_path / "run") if r["split"] == "val"] == \
        pytest.approx([0.5, 0.4, 0.45, 0.41])
    assert "stopping early after epoch 3 step 92: val_score has not improved" in caplog.text
    assert "done: 4 epochs (stopped early), 92 steps" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stoker"):
        again = train(make_cfg(*ARGS, "trainer.resume=auto"))  # a requeued job
    assert again["complete"] and again["steps"] == 92 and Scripted.values == []
    assert ("nothing to train: the run is complete at epoch 4 step 92 (it stopped early: "
            "val_score has not improved on 0.4 (step 46) in trainer.early_stopping.patience=2 "
            "validations) and its files are left as they are; raise "
            "trainer.early_stopping.patience (or set it to 0) to train on") in caplog.text
    monkeypatch.setattr(Scripted, "values", [0.3, 0.35, 0.36, 0.37])
    longer = train(make_cfg(*ARGS[:-2], "trainer.early_stopping.patience=3",
                            "trainer.max_epochs=10", "trainer.resume=auto"))
    assert longer["steps"] == 23 * 8 and longer["stopped_early"].startswith(
        "val_score has not improved on 0.3 (step 115) in trainer.early_stopping.patience=3")


def test_every_rank_stops_at_the_same_epoch(tmp_path):
    """min_delta larger than any change: the second validation ends the run on both ranks,
    and the job exits 0 with no rank left waiting (the ranks see the same validation values;
    a stop one rank alone asks for is test_loop's)."""
    run_dir = tmp_path / "run"
    proc = torchrun(2, [f"hydra.run.dir={run_dir}", "trainer.checkpoint.monitor=val_loss",
                        "trainer.early_stopping.patience=1",
                        "trainer.early_stopping.min_delta=100", "trainer.max_epochs=5"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = summary_of(run_dir)
    assert (summary["epochs"], summary["steps"]) == (2, 24)  # 12 steps an epoch on 2 ranks
    assert summary["stopped_early"].endswith("by more than 100 in "
                                             "trainer.early_stopping.patience=1 validations")


def test_the_count_travels_in_the_checkpoint_of_a_run_that_goes_on(make_cfg, monkeypatch):
    from tests.helpers import Scripted

    args = (*ARGS[:-2], "trainer.early_stopping.patience=3")
    monkeypatch.setattr(Scripted, "values", [0.5, 0.6, 0.7])
    first = train(make_cfg(*args, "trainer.max_epochs=3"))  # 2 without improvement: goes on
    assert "stopped_early" not in first and first["epochs"] == 3
    monkeypatch.setattr(Scripted, "values", [0.8])
    resumed = train(make_cfg(*args, "trainer.max_epochs=10", "trainer.resume=auto"))
    assert (resumed["epochs"], resumed["steps"]) == (4, 92)  # the third one, after the resume
    assert resumed["stopped_early"].startswith("val_score has not improved on 0.5 (step 23)")


def test_a_stop_at_the_epoch_that_reaches_the_limit_is_said_as_one_and_resumes_as_one(
        make_cfg, monkeypatch, caplog):
    """Patience runs out at the last epoch: the summary says it stopped early, as a resume
    with a larger limit then finds it (it trained nothing more before, and said otherwise)."""
    from tests.helpers import Scripted

    monkeypatch.setattr(Scripted, "values", [0.5, 0.6, 0.7])
    first = train(make_cfg(*ARGS[:-1], "trainer.max_epochs=3"))
    assert first["epochs"] == 3 and first["stopped_early"].startswith(
        "val_score has not improved on 0.5 (step 23)")
    with caplog.at_level(logging.INFO, logger="stoker"):
        again = train(make_cfg(*ARGS, "trainer.resume=auto"))  # max_epochs=10
    assert again["complete"] and again["steps"] == 69
    assert "(it stopped early: val_score has not improved" in caplog.text


def test_improves_by_more_than_min_delta_in_the_direction_and_never_with_nan():
    assert improves(0.5, None, "min") and not improves(float("nan"), None, "min")
    assert improves(0.4, 0.5, "min") and not improves(0.6, 0.5, "min")
    assert improves(0.6, 0.5, "max") and not improves(0.55, 0.5, "max", min_delta=0.1)
    assert not improves(float("inf"), 0.5, "max")  # (not a value to rank)

"""End to end through run(): the run dir's contents and each debug mode."""
from __future__ import annotations

import json
import logging
import re
from unittest.mock import ANY

import pytest

import torch

from tests.helpers import read_metrics, run_cli
from trainer.config import ConfigError
from trainer.runner import train

TRAIN_KEYS = {"step", "epoch", "loss", "lr", "samples_per_s", "data_wait_frac"}


def test_run_dir_holds_config_metrics_tensorboard_and_checkpoint(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    summary = train(make_cfg("trainer.max_epochs=2", "trainer.log_every_n_steps=5",
                             "trainer.grad_clip=5.0"))
    assert (run_dir / "config.yaml").read_text().count("num_workers: 0") == 1
    rows = read_metrics(run_dir)
    train_rows = [r for r in rows if r["split"] == "train"]
    val_rows = [r for r in rows if r["split"] == "val"]
    assert train_rows and all(TRAIN_KEYS <= r.keys() for r in train_rows)
    assert any("grad_norm" in r for r in train_rows)
    assert all(0.0 <= r["data_wait_frac"] <= 1.0 for r in train_rows)
    assert [r["epoch"] for r in val_rows] == [0, 1]
    assert all({"val_loss", "val_acc"} <= r.keys() for r in val_rows)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/data_wait_frac", "val/val_acc"} <= tags

    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert summary["checkpoint"] == str(run_dir / "checkpoints" / "last.pt")
    assert {"model", "optimizer", "scheduler", "scaler", "step", "epoch", "config"} <= state.keys()
    assert not any(k.startswith("module.") for k in state["model"])
    assert state["step"] == summary["steps"] and state["epoch"] == 2
    assert state["config"]["trainer"]["precision"] == "fp32"


def test_debug_default_is_single_process_deterministic_and_logs_every_step(make_cfg, tmp_path):
    from trainer.loop import Callback

    during = []

    class Flags(Callback):
        def after_step(self, loop):
            during.append((torch.are_deterministic_algorithms_enabled(),
                           torch.is_anomaly_enabled()))

    summary = train(make_cfg("debug=default", "trainer.max_steps=4"), callbacks=[Flags()])
    rows = [r for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert during == [(True, True)] * 4  # for the run; put back after it (trainer.speed)
    assert not torch.are_deterministic_algorithms_enabled() and not torch.is_anomaly_enabled()
    assert summary["steps"] == 4


def test_debug_default_config_values(make_cfg):
    cfg = make_cfg("debug=default")
    assert cfg.trainer.strategy.value == "single" and cfg.data.num_workers == 0
    assert cfg.trainer.detect_anomaly and cfg.trainer.deterministic
    assert cfg.trainer.log_every_n_steps == 1


def test_fast_dev_run_takes_one_batch_each_and_saves_nothing(make_cfg, tmp_path):
    summary = train(make_cfg("debug=fdr"))
    assert summary["steps"] == 1 and summary["epochs"] == 1
    assert summary["checkpoint"] is None
    run_dir = tmp_path / "run"
    assert not (run_dir / "checkpoints").exists()
    assert not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "tensorboard").exists()
    torch.use_deterministic_algorithms(False)
    torch.autograd.set_detect_anomaly(False)


def test_a_fast_dev_run_into_another_runs_dir_is_refused(make_cfg, tmp_path):
    """It saves nothing, but its train.log lines went into the finished run's log."""
    run_dir = tmp_path / "run"
    train(make_cfg("trainer.max_steps=2", "trainer.progress_bar=false"))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match=rf"^trainer\.fast_dev_run=true \(debug=fdr\): run dir "
                                          rf"{run_dir} holds another run's last\.pt\.\.\., whose "
                                          r"train\.log it would add to; start it in a new dir "
                                          r"\(run_dir=\.\.\., or leave the key out\)$"):
        train(make_cfg("debug=fdr"))
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    torch.use_deterministic_algorithms(False)
    torch.autograd.set_detect_anomaly(False)


def test_overfit_drives_the_loss_towards_zero(make_cfg, tmp_path):
    summary = train(make_cfg("debug=overfit"))
    rows = [r for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert rows[0]["loss"] > 1.0
    assert summary["train_loss"] < 0.01, summary


def test_overfit_batches_beyond_the_epoch_are_said_once(make_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="stoker"):
        summary = train(make_cfg("trainer.overfit_batches=40", "trainer.max_epochs=2",
                                 "trainer.save_checkpoint=false"))
    assert summary["steps"] == 46  # the whole epoch of 23 batches, twice
    said = [r for r in caplog.records if "more than the" in r.getMessage()]
    assert [r.getMessage() for r in said] == [
        "trainer.overfit_batches=40 is more than the 23 batches of an epoch on this rank: each "
        "epoch repeats those 23"] and said[0].levelno == logging.WARNING


def test_no_epoch_limit_trains_across_epochs_to_max_steps(make_cfg, tmp_path):
    """trainer.max_epochs=-1, as Lightning users write it with max_steps: 23 batches an epoch,
    so 50 steps end in the third epoch; the schedule spans the 50 (its lr reaches 0 there)."""
    summary = train(make_cfg("trainer.max_epochs=-1", "trainer.max_steps=50",
                             "trainer.save_checkpoint=false", "trainer.log_every_n_steps=10"))
    assert (summary["steps"], summary["epochs"]) == (50, 2)
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert len(lrs) == 5 and lrs[-1] < lrs[-2] / 10  # (cosine's last steps: near 0)


def test_the_done_line_counts_in_words_a_user_reads(make_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="stoker"):
        train(make_cfg("trainer.max_epochs=1", "trainer.save_checkpoint=false"))
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done: ")]
    assert len(done) == 1 and done[0].startswith("done: 1 epoch, 23 steps in "), done


def test_profile_writes_one_trace_without_a_warning(make_cfg, tmp_path, recwarn):
    summary = train(make_cfg("debug=profile"))
    assert summary["steps"] == 10
    traces = list((tmp_path / "run" / "profiler").glob("*.pt.trace.json*"))
    assert len(traces) == 1, traces  # (one cycle: steps 3-5)
    assert not [w for w in recwarn if "Profiler clears events" in str(w.message)]


def test_resume_continues_from_last_checkpoint(make_cfg, tmp_path):
    """2 epochs, then resume to 3, equals 3 epochs straight (constant lr: same schedule)."""
    full = train(make_cfg("trainer.max_epochs=3", "sched=constant", run_dir=tmp_path / "full"))
    train(make_cfg("trainer.max_epochs=2", "sched=constant", run_dir=tmp_path / "part"))
    resumed = train(make_cfg("trainer.max_epochs=3", "sched=constant", "trainer.resume=auto",
                             run_dir=tmp_path / "part"))
    assert resumed["steps"] == full["steps"] == 69
    a = torch.load(full["checkpoint"], weights_only=True)["model"]
    b = torch.load(resumed["checkpoint"], weights_only=True)["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k])


def test_a_complete_run_resumed_again_leaves_its_files_and_trains_on_when_extended(
        make_cfg, tmp_path, caplog):
    """A requeued job that finished already: resume=auto finds the final checkpoint, says
    there is nothing to train and rewrites nothing (not its summary, metrics or checkpoints);
    a larger trainer.max_epochs trains on from there. The last step's periodic checkpoint is
    written before the final validation: the validated state is saved over it."""
    run = tmp_path / "run"
    args = ("sched=constant", "trainer.checkpoint.every_n_steps=23")
    with caplog.at_level(logging.INFO, logger="stoker"):
        first = train(make_cfg("trainer.max_epochs=1", "trainer.resume=auto", *args))
    assert f"trainer.resume=auto: no checkpoint in {run / 'checkpoints'}: a fresh start (the " \
        "run to continue is named by run_dir)" in caplog.text  # (from Python)
    files = {p: p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
             and p.suffix in (".json", ".jsonl", ".pt", ".yaml")}
    with caplog.at_level(logging.INFO, logger="stoker"):
        again = train(make_cfg("trainer.max_epochs=1", "trainer.resume=auto", *args))
    assert "nothing to train: the run is complete at epoch 1 step 23" in caplog.text
    assert again["complete"] and again["steps"] == first["steps"] == 23
    assert again["val_acc"] == first["val_acc"]  # the run's own summary
    assert {p: p.read_bytes() for p in files} == files
    # settings changed too: what they would change is not said, as nothing is trained
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stoker"):
        train(make_cfg("trainer.max_epochs=1", "trainer.resume=auto", "optim.lr=0.1",
                       "data.batch_size=32", *args))
    assert "nothing to train" in caplog.text and "changed settings" not in caplog.text
    assert "the lr schedule" not in caplog.text
    assert {p: p.read_bytes() for p in files} == files
    on = train(make_cfg("trainer.max_epochs=2", "trainer.resume=auto", *args))
    assert on["steps"] == 46 and "complete" not in on


def test_a_complete_checkpoint_resumed_into_a_new_run_dir_is_validated_there(make_cfg,
                                                                              tmp_path):
    """Another run's final checkpoint, resumed by path into a new run dir (to evaluate it
    on another world size, say): nothing to train, but it is validated and this run dir gets
    its own summary and checkpoint; the other run's files are left as they are."""
    first = train(make_cfg("trainer.max_epochs=1", run_dir=tmp_path / "first"))
    files = {p: p.read_bytes() for p in sorted((tmp_path / "first").rglob("*")) if p.is_file()}
    again = train(make_cfg("trainer.max_epochs=1", f"trainer.resume={first['checkpoint']}",
                           run_dir=tmp_path / "again"))
    assert "complete" not in again and again["steps"] == first["steps"]
    assert again["val_acc"] == first["val_acc"]
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["val_acc"] == \
        first["val_acc"]
    assert (tmp_path / "again" / "checkpoints" / "last.pt").is_file()
    assert {p: p.read_bytes() for p in files} == files


def test_cli_trains_the_default_job(tmp_path):
    """`python train.py` as the README says: real digits, >= 95% validation accuracy."""
    proc = run_cli([f"hydra.run.dir={tmp_path}", "trainer.progress_bar=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done:" in proc.stdout and "global batch 64" in proc.stdout
    val = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
           if '"val"' in line]
    assert val[-1]["val_acc"] >= 0.95
    assert (tmp_path / "train.log").read_text().count("done:") == 1


def test_periodic_async_and_best_checkpoints(make_cfg, tmp_path):
    summary = train(make_cfg("trainer.max_epochs=3", "trainer.checkpoint.every_n_steps=10",
                             "trainer.checkpoint.keep_last=2", "trainer.checkpoint.async_save=true",
                             "trainer.checkpoint.monitor=val_acc"))
    folder = tmp_path / "run" / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["best.pt", "last.pt", "step-00000060.pt", "step-00000069.pt"], names
    last = torch.load(folder / "last.pt", weights_only=True)
    assert last["step"] == summary["steps"] == 69 and last["position"] == 0
    assert {"python", "numpy", "torch", "loader"} <= last["rng"][0].keys()
    best = torch.load(folder / "best.pt", weights_only=True)
    assert best["step"] in (23, 46, 69)


def test_a_resumed_run_replaces_best_pt_only_with_a_better_value(make_cfg, tmp_path,
                                                                 monkeypatch):
    """best.pt's value travels in the checkpoint: a resumed run whose next validation is worse
    keeps the earlier best.pt; a run started from another run's checkpoint has no best.pt of
    its own, so its first validation makes one."""
    from tests.helpers import Scripted

    folder = tmp_path / "run" / "checkpoints"
    args = ("+task.metrics.score._target_=tests.helpers.Scripted", "trainer.checkpoint.mode=min",
            "trainer.checkpoint.monitor=val_score")
    monkeypatch.setattr(Scripted, "values", [0.5, 0.3])
    first = train(make_cfg("trainer.max_epochs=2", *args))
    assert first["best"] == {"monitor": "val_score", "value": pytest.approx(0.3), "step": 46}
    monkeypatch.setattr(Scripted, "values", [0.9])  # worse than 0.3, better than a fresh start
    resumed = train(make_cfg("trainer.max_epochs=3", "trainer.resume=auto", *args))
    assert resumed["steps"] == 69 and resumed["val_score"] == pytest.approx(0.9)
    assert resumed["best"] == first["best"]
    assert torch.load(folder / "best.pt", weights_only=True)["step"] == 46
    last = torch.load(folder / "last.pt", weights_only=True)
    assert last["callbacks"]["Checkpointing"] == {**first["best"], "mode": "min"}
    monkeypatch.setattr(Scripted, "values", [0.9])
    other = train(make_cfg("trainer.max_epochs=3", *args,
                           f"trainer.resume={folder / 'step-00000046.pt'}",
                           run_dir=tmp_path / "other"))
    assert other["best"] == {"monitor": "val_score", "value": pytest.approx(0.9), "step": 69}
    best = torch.load(tmp_path / "other" / "checkpoints" / "best.pt", weights_only=True)
    assert best["step"] == 69 and Scripted.values == []


def test_a_monitored_value_that_is_not_a_number_never_becomes_best(make_cfg, tmp_path,
                                                                    monkeypatch, caplog):
    """nan at the first validation (every comparison with it is false) would have stayed
    best.pt for the whole run; the run's files stay JSON (null, not NaN)."""
    from tests.helpers import Scripted

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON"))

    monkeypatch.setattr(Scripted, "values", [float("nan"), 0.5, float("nan")])
    summary = train(make_cfg("trainer.max_epochs=3", "trainer.checkpoint.mode=min",
                             "+task.metrics.score._target_=tests.helpers.Scripted",
                             "trainer.checkpoint.monitor=val_score"))
    assert summary["best"] == {"monitor": "val_score", "value": 0.5, "step": 46}
    run_dir = tmp_path / "run"
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["step"] == 46
    assert strict((run_dir / "summary.json").read_text())["val_score"] is None
    rows = [strict(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["val_score"] for r in rows if r["split"] == "val"] == [None, 0.5, None]
    warned = [r.getMessage() for r in caplog.records if "not a value to rank" in r.getMessage()]
    assert warned == ["trainer.checkpoint.monitor=val_score is nan at step 23: not a value to "
                      "rank, so it never becomes best.pt"]


def test_a_crash_keeps_its_exception_type_in_status_json(make_cfg, tmp_path):
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg("data.dataset._target_=tests.helpers.FailingOnRankDigits",
                       "+data.dataset.fail_rank=0", "+data.dataset.fail_index=100",
                       "data.num_workers=0"))
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["status"] == "failed" and status["exit_code"] == 1
    assert status["error"] == "RuntimeError: injected failure on rank None"


def test_sys_exit_in_the_users_code_is_recorded_as_what_it_was(make_cfg, tmp_path,
                                                                monkeypatch):
    from tests.helpers import ExitingMLP

    monkeypatch.setattr(ExitingMLP, "calls", 0)
    with pytest.raises(SystemExit):
        train(make_cfg("model._target_=tests.helpers.ExitingMLP"))
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["status"], status["exit_code"], status["error"]) == (
        "exited: SystemExit raised during the run", 0, "SystemExit(0)")


def test_sys_exit_in_the_users_code_is_said_and_stops_a_sweep_as_unfinished(tmp_path):
    """The process ended silent, and a sweep whose job called sys.exit(0) ended 0 with its
    next jobs never run, as if it had completed."""
    proc = run_cli(["-m", "model._target_=tests.helpers.ExitsAtMLP", "+model.at=0,5,0",
                    "trainer.max_steps=8", "trainer.progress_bar=false"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert re.fullmatch(r"stoker: the run ended on your code's sys.exit\(0\) \(raised at "
                        r".*tests/helpers.py:\d+\)", lines[-2]), lines[-2]
    assert lines[-1].startswith("stoker: the sweep stopped at job 1; the jobs after it were "
                                "not run"), lines[-1]
    [sweep] = (tmp_path / "multirun").glob("*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]  # 2 never ran
    proc = run_cli(["model._target_=tests.helpers.ExitsAtMLP", "+model.at=5", "+model.code=3",
                    "trainer.progress_bar=false", f"hydra.run.dir={tmp_path / 'one'}"],
                   cwd=tmp_path)  # one run: its own code, said
    assert proc.returncode == 3
    assert "stoker: the run ended on your code's sys.exit(3) (raised at " in proc.stderr


def test_a_run_stopped_on_non_finite_losses_before_any_save_says_none_was_saved(make_cfg,
                                                                                tmp_path):
    from trainer.windowlog import NonFiniteLoss

    with pytest.raises(NonFiniteLoss, match=r"in a row \(up to step 5, trainer.max_bad_steps=3\);"
                                            r" stopped \(the training data holds no NaN or inf: "
                                            r".*\); no checkpoint was saved$"):
        train(make_cfg("model._target_=tests.helpers.NaNAfterMLP", "+model.nan_after=2",
                       "trainer.max_bad_steps=3", "trainer.log_every_n_steps=1"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_checkpoint_save_past_max_bad_steps_stops_the_run_there(make_cfg, tmp_path):
    """A save reads the non-finite count anyway: past trainer.max_bad_steps it stops the run
    there, not at the next logging boundary (a run of max_bad_steps=4 went on for 19 such
    steps, a warning at each save)."""
    from trainer.windowlog import NonFiniteLoss

    with pytest.raises(NonFiniteLoss, match=r"for 4 optimizer steps in a row \(up to step 6, "
                                            r"trainer.max_bad_steps=3\); stopped \(the "
                                            r"training data holds no NaN or inf: .*\); the "
                                            r"last good checkpoint is .*/last.pt$"):
        train(make_cfg("model._target_=tests.helpers.NaNAfterMLP", "+model.nan_after=2",
                       "trainer.max_bad_steps=3", "trainer.checkpoint.every_n_steps=2",
                       "trainer.checkpoint.keep_last=5"))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*.pt")) == [
        "step-00000002.pt"]


@pytest.mark.parametrize("every,good", [(4, "last.pt"), (0, None)])
def test_a_run_ending_on_a_few_non_finite_steps_fails_and_names_no_missing_file(
        make_cfg, tmp_path, every, good):
    """Fewer NaN steps than trainer.max_bad_steps at the end: the final state is not saved,
    so the run did not succeed (it exited 0 naming a last.pt that did not exist)."""
    from trainer.windowlog import NonFiniteLoss

    with pytest.raises(NonFiniteLoss) as info:
        train(make_cfg("model._target_=tests.helpers.NaNAfterMLP", "+model.nan_after=10",
                       "trainer.max_steps=12", f"trainer.checkpoint.every_n_steps={every}"))
    folder = tmp_path / "run" / "checkpoints"
    assert str(info.value) == (
        "the run ended with a loss that was not finite for its last 2 optimizer steps (fewer "
        "than trainer.max_bad_steps=20); its final state was not saved; " +
        (f"the last good checkpoint is {folder / good}" if good else "no checkpoint was saved"))
    if good:
        assert torch.load(folder / good, weights_only=True)["step"] == 8
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert (status["status"], status["exit_code"]) == ("failed", 1)
    assert not (tmp_path / "run" / "summary.json").exists()


def images(tmp_path, unreadable: str = "", junk: bytes = b""):
    """A 2-class image folder of 40 files (32 train, 8 val) whose `unreadable` split's files
    all hold `junk`."""
    from scripts.make_images import write_images

    root = tmp_path / "images"
    write_images(root, count=40, size=16, classes=2)
    for path in (root / unreadable).rglob("*.jpg") if unreadable else ():
        path.write_bytes(junk)
    return root


def on_images(make_cfg, root, *overrides):
    """A CNN on the image folder at `root`, read in this process, 2 steps an epoch."""
    return make_cfg("data=image_folder", f"data.dataset.root={root}", "data.dataset.size=8",
                    "model=cnn", "data.num_workers=0", "data.batch_size=16", *overrides)


def test_a_run_whose_every_training_file_is_unreadable_fails_in_one_line(make_cfg, tmp_path):
    root = images(tmp_path, "train", b"not a jpeg")
    with pytest.raises(ConfigError, match=r"^data: no training sample was read in 2 optimizer "
                                          r"steps: every one of them was skipped as unreadable "
                                          r"\(32 files, data.dataset.on_error=skip\)"):
        train(on_images(make_cfg, root))


def test_a_run_whose_every_validation_file_is_unreadable_fails_in_one_line(make_cfg, tmp_path):
    """It "completed" with val_loss nan and val_acc nan."""
    root = images(tmp_path, "val")
    with pytest.raises(ConfigError, match=r"^data: no validation sample was read: every one was "
                                          r"skipped as unreadable \(8 files, data.dataset."
                                          r"on_error=skip\); check the validation files"):
        train(on_images(make_cfg, root, "trainer.max_epochs=1"))


def test_a_later_validation_that_reads_nothing_warns_and_the_run_goes_on(make_cfg, tmp_path,
                                                                        caplog, monkeypatch):
    """A passing outage of the validation storage after validations that read: a warning,
    not the end of a long run (nan values for that validation)."""
    from data.images import ImageFolder

    root = images(tmp_path)
    real, calls = ImageFolder._read, []

    def flaky(self, i, out):  # the second validation's reads all fail (the first 8 reads are
        if self.samples[i][0].split("/")[-3] == "val":  # the sanity check's)
            calls.append(i)
            if 16 < len(calls) <= 24:
                self.unreadable.handle(OSError("storage away"), i, self.samples[i][0])
                return False
        return real(self, i, out)

    monkeypatch.setattr(ImageFolder, "_read", flaky)
    with caplog.at_level(logging.WARNING, logger="stoker"):
        s = train(on_images(make_cfg, root, "trainer.max_epochs=3"))
    assert s["epochs"] == 3 and len(calls) == 32
    said = [r.getMessage() for r in caplog.records if "validation at step" in r.getMessage()]
    assert said == ["data: validation at step 4: no validation sample was read: every one was "
                    "skipped as unreadable (8 files, data.dataset.on_error=skip)"]


def test_a_file_where_the_checkpoints_go_stops_the_run_before_it_trains(make_cfg, tmp_path):
    from trainer.checkpoint import CheckpointWriteError

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("a file of the user's")
    with pytest.raises(CheckpointWriteError, match="a file is in the way of the folder; move "
                                                   "it, or set trainer.save_checkpoint=false"):
        train(make_cfg())
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints"]


def test_a_folder_named_as_a_step_checkpoint_stops_the_run_before_it_trains(make_cfg,
                                                                           tmp_path):
    """A folder checkpoints/step-00000004.pt failed the resumed run at that step's save,
    after the training ("Is a directory", blamed on hydra.run.dir)."""
    from tests.helpers import snapshot
    from trainer.checkpoint import CheckpointWriteError

    assert train(make_cfg("trainer.max_steps=2"))["steps"] == 2
    (tmp_path / "run" / "checkpoints" / "step-00000004.pt").mkdir()
    before = snapshot(tmp_path / "run")
    with pytest.raises(CheckpointWriteError, match=r"checkpoints cannot be written in .*"
                                                   r"checkpoints: step-00000004.pt is a folder, "
                                                   r"named as the run names its checkpoints"):
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto"))
    assert snapshot(tmp_path / "run") == before
    (tmp_path / "run" / "checkpoints" / "step-00000004.pt").rmdir()
    (tmp_path / "run" / "checkpoints" / "best.pt").mkdir()  # (so with last.pt and best.pt)
    with pytest.raises(CheckpointWriteError, match=r"best.pt is a folder"):
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto"))


def test_a_checkpoint_positioned_past_the_epoch_is_refused(make_cfg, tmp_path):
    from trainer import checkpoint
    from trainer.checkpoint import CheckpointError

    train(make_cfg("trainer.max_steps=5", "trainer.checkpoint.every_n_steps=5"))
    path = tmp_path / "run" / "checkpoints" / "step-00000005.pt"
    state = checkpoint.load(path)
    checkpoint.save({**state, "position": 10**9}, tmp_path / "far.pt")
    with pytest.raises(CheckpointError) as e:
        train(make_cfg("trainer.max_steps=10", f"trainer.resume={tmp_path / 'far.pt'}",
                       run_dir=tmp_path / "other"))
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'far.pt'}: its position, 1000000000 samples into epoch 0, is "
        "past the end of this run's 1438 training samples (its run had 1438); resume over the "
        f"data it trained on, or start a new run from its weights alone: "
        f"trainer.init_from={tmp_path / 'far.pt'}")


def test_a_resume_over_a_training_set_of_another_length_says_so(make_cfg, tmp_path, caplog):
    """The position counts into the sampler's order, a function of the set's length: a
    grown set went on over another order with no word."""
    train(make_cfg("trainer.max_steps=5", "trainer.checkpoint.every_n_steps=5"))
    path = tmp_path / "run" / "checkpoints" / "step-00000005.pt"
    with caplog.at_level(logging.WARNING, logger="stoker"):
        train(make_cfg("trainer.max_steps=6", f"trainer.resume={path}",
                       "data.dataset.val_fraction=0.1", run_dir=tmp_path / "other"))
    lines = [r.getMessage() for r in caplog.records if "training samples" in r.getMessage()]
    assert lines == [f"checkpoint {path}: its run had 1438 training samples, this one has "
                     "1617: epoch 0 goes on 320 samples in, over another order of them (some "
                     "may come twice in it, or not at all); later epochs are whole"]
    # a smaller set whose epoch ends inside the position's last global batch: it is over
    # (it said the epoch went on 320 samples in, and trained nothing of it)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stoker"):
        summary = train(make_cfg("trainer.max_steps=6", f"trainer.resume={path}",
                                 "data.dataset.val_fraction=0.84", run_dir=tmp_path / "small"))
    lines = [r.getMessage() for r in caplog.records if "training samples" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint {path}: its run had 1438 "
                                                   "training samples, this one has 28")
    assert lines[0].endswith(": epoch 0 of them ends before its position, 320 samples in, so "
                             "it is over (validated first where it was not); later epochs are "
                             "whole")
    assert summary["steps"] == 6 and summary["epochs"] == 1  # (step 6 inside epoch 1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stoker"):  # the same set: no word
        train(make_cfg("trainer.max_steps=6", f"trainer.resume={path}",
                       run_dir=tmp_path / "third"))
    assert not [r for r in caplog.records if "training samples" in r.getMessage()]


def test_a_monitor_without_checkpoints_says_it_keeps_nothing(make_cfg, caplog):
    with caplog.at_level(logging.WARNING, logger="stoker"):
        summary = train(make_cfg("trainer.max_epochs=1", "trainer.save_checkpoint=false",
                                 "trainer.checkpoint.monitor=val_acc"))
    assert "trainer.checkpoint.monitor=val_acc keeps no best.pt: trainer.save_checkpoint=false " \
           "saves no checkpoint" in caplog.text
    assert "best" not in summary


def test_resumes_from_an_epochs_last_step_and_an_epoch_with_nothing_left(make_cfg, tmp_path):
    """A checkpoint saved at an epoch's last step holds a position past the dataset's end
    (23 batches of 64 = 1472 for 1438 samples), and one at the end of a limited epoch leaves
    nothing to train in it: both resume."""
    train(make_cfg("trainer.max_steps=25", "trainer.max_epochs=2",
                   "trainer.checkpoint.every_n_steps=23", "trainer.checkpoint.every_n_epochs=0"))
    path = tmp_path / "run" / "checkpoints" / "step-00000023.pt"
    assert torch.load(path, weights_only=True)["position"] == 1472
    resumed = train(make_cfg("trainer.max_steps=25", "trainer.max_epochs=2",
                              f"trainer.resume={path}", run_dir=tmp_path / "b"))
    assert resumed["steps"] == 25
    limited = ("trainer.max_epochs=2", "trainer.limit_train_batches=5")
    train(make_cfg("trainer.max_steps=7", *limited, "trainer.checkpoint.every_n_steps=5",
                   "trainer.checkpoint.every_n_epochs=0", run_dir=tmp_path / "c"))
    again = train(make_cfg("trainer.max_steps=10", *limited, "trainer.resume="
                           f"{tmp_path / 'c' / 'checkpoints' / 'step-00000005.pt'}",
                           run_dir=tmp_path / "d"))
    assert again["steps"] == 10


def test_a_limit_given_as_a_share_takes_that_share_of_the_batches(make_cfg, tmp_path):
    """`trainer.limit_train_batches=0.25` (a Lightning habit) was refused as not an int: a
    share of the epoch's 23 batches is 5 (rounded down), the same run as `=5`; a share of the
    2 validation batches likewise, and one that comes to no batch is one line."""
    share = train(make_cfg("trainer.max_epochs=2", "trainer.limit_train_batches=0.25",
                           "trainer.limit_val_batches=0.5", run_dir=tmp_path / "share"))
    count = train(make_cfg("trainer.max_epochs=2", "trainer.limit_train_batches=5",
                           "trainer.limit_val_batches=1", run_dir=tmp_path / "count"))
    assert share["steps"] == count["steps"] == 10
    assert share["val_loss"] == count["val_loss"]
    whole = train(make_cfg("trainer.max_epochs=1", "trainer.limit_train_batches=1.0",
                           run_dir=tmp_path / "whole"))
    assert whole["steps"] == 23  # (1.0: every batch, not one)
    with pytest.raises(ConfigError, match=r"^trainer\.limit_val_batches=0\.01: that share of "
                       r"the split's 2 batches on this rank is less than one; raise it, or "
                       r"give a number of batches \(trainer\.limit_val_batches=1\)$"):
        train(make_cfg("trainer.limit_val_batches=0.01", run_dir=tmp_path / "none"))


def test_a_dataclass_batch_of_ones_own_trains_and_counts_its_samples(make_cfg):
    summary = train(make_cfg("+data.collate_fn._target_=tests.helpers.pair_batch",
                             "task=model_loss", "task._target_=tests.helpers.PairBatchTask",
                             "~task.shift_labels", "~task.count", "~task.ignore_index",
                             "data.num_workers=0",
                             "data.placement=host", "trainer.max_epochs=1"))
    assert summary["steps"] == 23 and summary["run_samples_per_s"] > 0


def test_a_schedule_total_longer_than_the_run_is_the_users_choice(make_cfg):
    summary = train(make_cfg("sched._target_=torch.optim.lr_scheduler.OneCycleLR",
                             "~sched.warmup_steps", "~sched.min_lr_ratio", "+sched.max_lr=0.01",
                             "+sched.total_steps=100", "trainer.max_steps=3"))
    assert summary["steps"] == 3


def test_a_config_composed_without_a_run_dir_is_one_line(tmp_path):
    from hydra import compose, initialize_config_dir

    from tests.helpers import CONF
    from trainer.config import ConfigError

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["trainer.max_steps=1"])
    with pytest.raises(ConfigError, match=r"run_dir: cannot be resolved .* composed outside "
                                          r"train.py \(trainer.runner.compose, hydra.compose\) "
                                          r"needs a run_dir=PATH"):
        train(cfg)
    # a plain dict of it (an AttributeError from inside the runner before)
    from omegaconf import OmegaConf

    plain = OmegaConf.to_container(cfg)
    with pytest.raises(ConfigError, match=r"^train: takes the DictConfig that trainer.runner."
                                          r"compose\(overrides\) returns, got dict; "):
        train(plain)


@pytest.mark.slow
def test_an_image_folder_run_writes_its_classes_and_counts_skipped_files(make_cfg, tmp_path):
    from scripts.make_images import write_images

    root = tmp_path / "images"
    write_images(root, count=60, size=24, classes=3)
    (root / "train" / "class_02" / "zz_broken.jpg").write_bytes(b"\xff\xd8 not really")
    common = ["data=image_folder", f"data.dataset.root={root}", "data.dataset.size=16",
              "model=cnn", "trainer.max_epochs=2", "data.num_workers=2"]
    summary = train(make_cfg(*common, run_dir=tmp_path / "a"))
    assert json.loads((tmp_path / "a" / "classes.json").read_text()) == [
        "class_00", "class_01", "class_02"]
    assert summary["skipped_files"] == 1 and summary["steps"] == 2
    # the warning naming the file, said in a loader worker, counts as the same one said in
    # the training process does (the count was the training process's alone)
    inline = train(make_cfg(*common, "data.num_workers=0", run_dir=tmp_path / "inline"))
    assert summary["warnings"] == inline["warnings"] >= 2, (summary, inline)
    # the disk cache: written by the first run, read by the second (no decoding, same result)
    cached = [*common, "data.cache=disk", f"data.cache_dir={tmp_path / 'cache'}"]
    first = train(make_cfg(*cached, run_dir=tmp_path / "b"))
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("x.npy")}
    second = train(make_cfg(*cached, run_dir=tmp_path / "c"))
    assert len(stamp) == 2  # train and val
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").rglob("x.npy")} == stamp
    assert first["val_loss"] == second["val_loss"] and first["skipped_files"] == 1
    assert second["skipped_files"] == 0  # nothing was decoded
    done = [json.loads(p.read_text()) for p in (tmp_path / "cache").rglob("done.json")]
    assert sorted(len(d["skipped"]) for d in done) == [0, 1]  # said on every later run


def test_a_batch_larger_than_the_training_set_is_said_once(make_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="stoker"):
        summary = train(make_cfg("data.batch_size=5000", "trainer.max_epochs=2",
                                 "trainer.save_checkpoint=false"))
    assert summary["steps"] == 2  # one batch an epoch
    said = [r for r in caplog.records if "more than the" in r.getMessage()]
    assert [r.getMessage() for r in said] == [
        "data.batch_size=5000 is more than the 1438 training samples on this rank: every epoch "
        "is one batch of 1438"] and said[0].levelno == logging.WARNING


def test_a_sweep_job_refused_at_start_leaves_its_status_and_stops_the_sweep(tmp_path):
    proc = run_cli(["-m", "optim.lr=1e-3,-1,3e-3", "trainer.max_steps=2",
                    "trainer.progress_bar=false"], cwd=tmp_path)
    assert proc.returncode == 2
    error, last = proc.stderr.strip().splitlines()[-2:]  # the job's error, then the sweep's
    assert error.startswith("stoker: error: optim.lr=-1: torch.optim.AdamW refused it"), error
    assert last.startswith("stoker: the sweep stopped at job 1; the jobs after it were not run "
                           "(once fixed, the same command with trainer.resume=auto "
                           "hydra.sweep.dir=multirun/"), last
    [sweep] = (tmp_path / "multirun").glob("*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]  # 2 never ran
    assert json.loads((sweep / "0" / "status.json").read_text())["status"] == "completed"
    # what the sweep's table shows of the refused job: its overrides
    assert "optim.lr=-1" in (sweep / "1" / ".hydra" / "overrides.yaml").read_text()
    assert json.loads((sweep / "1" / "status.json").read_text()) == {
        "status": "failed: configuration, data or checkpoint", "exit_code": 2,
        "error": "optim.lr=-1: torch.optim.AdamW refused it: Invalid learning rate: -1",
        "when": ANY, "job": None, "from": None}


def test_a_sweep_job_resumed_with_nothing_to_resume_names_the_sweeps_dir_key(tmp_path):
    proc = run_cli(["-m", "trainer.resume=auto", "trainer.max_steps=1",
                    "trainer.progress_bar=false", "trainer.limit_val_batches=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # (left at its default, the sweep's dir is a new one: nothing to resume there, surely)
    assert "a new dir: hydra.sweep.dir was left at its default (a new dated dir for every " \
        "launch); name the sweep to continue with hydra.sweep.dir=..." in proc.stdout
    proc = run_cli(["-m", "trainer.resume=auto", "trainer.max_steps=1",
                    "trainer.progress_bar=false", "trainer.limit_val_batches=1",
                    f"hydra.sweep.dir={tmp_path / 'named'}"], cwd=tmp_path)
    assert "a fresh start (the run to continue is named by hydra.sweep.dir)" in proc.stdout


CRASHING = ["data.dataset._target_=tests.helpers.FailingOnRankDigits", "data.num_workers=0",
            "data.placement=host", "trainer.max_steps=2", "trainer.progress_bar=false"]


def test_a_sweep_job_that_crashes_stops_the_sweep_with_its_traceback(tmp_path):
    """Hydra's launcher kept a crash, ran the next jobs and raised it at the end; a refused
    job stopped the sweep: one rule now, the README's."""
    proc = run_cli(["-m", "+data.dataset.fail_rank=0,5", *CRASHING], cwd=tmp_path)
    assert proc.returncode == 1
    assert "RuntimeError: injected failure on rank None" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("stoker: the sweep stopped at job 0; the jobs after it were not run")
    assert last.endswith("runs them all)"), last  # (no finished job to keep)
    [sweep] = (tmp_path / "multirun").glob("*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]  # 1 never ran
    status = json.loads((sweep / "0" / "status.json").read_text())
    assert (status["status"], status["exit_code"]) == ("failed", 1)
    assert status["error"] == "RuntimeError: injected failure on rank None"
    last = (sweep / "0" / "train.log").read_text().splitlines()[-1]  # the log says why it ended
    assert last.endswith("[ERROR] failed at step 0: RuntimeError: injected failure on rank None")


def test_with_full_tracebacks_a_refused_sweep_job_still_stops_the_sweep(tmp_path):
    """HYDRA_FULL_ERROR=1 re-raised the refusal, which Hydra's launcher kept: the next job
    trained."""
    proc = run_cli(["-m", "data.batch_size=0,8", "trainer.max_steps=2",
                    "trainer.progress_bar=false"], cwd=tmp_path,
                   env_extra={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 2 and "Traceback (most recent call last)" in proc.stderr
    assert "data.batch_size=0: must be >= 1" in proc.stderr
    [sweep] = (tmp_path / "multirun").glob("*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]


@pytest.mark.slow
def test_a_torchrun_sweep_job_crashing_on_one_rank_ends_with_its_error(tmp_path):
    """Rank 1's crash went to the next job while rank 0 waited out trainer.ddp.timeout_s in
    the first one's collectives and named rank 1 lost; the error itself was never said."""
    from tests.helpers import torchrun

    proc = torchrun(2, ["+data.dataset.fail_rank=1,5", *CRASHING, "trainer.ddp.timeout_s=120"],
                    cwd=tmp_path, multirun=True, timeout=100)
    assert proc.returncode != 0
    assert "RuntimeError: injected failure on rank 1" in proc.stderr, proc.stderr[-3000:]
    assert "made no progress" not in proc.stderr
    [sweep] = (tmp_path / "multirun").glob("*/*")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0"]


@pytest.mark.gpu
def test_peak_memory_is_each_runs_own(make_cfg, tmp_path):
    """A sweep's jobs share one process: each reports the CUDA peak since its own start, not
    the largest of the jobs before it (a wide model first, a narrow one after); a fresh
    process, where CUDA starts after the reset's place, reports its own too."""
    proc = run_cli([f"hydra.run.dir={tmp_path / 'fresh'}", "trainer.accelerator=cuda",
                    "trainer.max_steps=5", "trainer.progress_bar=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "fresh" / "summary.json").read_text())["peak_mem_mb"] > 0
    wide = train(make_cfg("trainer.accelerator=cuda", "trainer.max_steps=5",
                          "model.hidden=[4096,4096]", run_dir=tmp_path / "wide"))
    narrow = train(make_cfg("trainer.accelerator=cuda", "trainer.max_steps=5",
                            "model.hidden=[32]", run_dir=tmp_path / "narrow"))
    assert 0 < narrow["peak_mem_mb"] < wide["peak_mem_mb"] / 4


def test_a_run_whose_workers_wait_at_each_epochs_end_exits(tmp_path):
    """data.prefetch_next_epoch=false: the training DataLoader keeps its workers (persistent)
    until the run closes it; the process did not end after its last line."""
    proc = run_cli(["trainer.max_epochs=1", "trainer.progress_bar=false", "data.placement=host",
                    "data.num_workers=2", "data.prefetch_next_epoch=false",
                    f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_slurm_launcher_without_a_sweep_is_refused_not_run_here(tmp_path):
    """Hydra uses a launcher for -m only: the run trained on this machine, with no word."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = run_cli(["hydra/launcher=slurm", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "stoker: error: hydra/launcher=slurm: submits sweeps (-m) only, and this command would "
        "train here; add -m to submit it as a job (one job for one setting), or leave the "
        "launcher out")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_loader_worker_killed_mid_step_is_one_line_wherever_the_step_was(tmp_path):
    """PyTorch's SIGCHLD handler raises a worker's death inside whatever the training thread
    runs (often the model's forward, which was then blamed on the data and the model): the
    run says the worker's one line, exit 1, its traceback gone."""
    from tests.helpers import run_cli

    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", "data=custom",
                    "+data.dataset._target_=tests.helpers.KilledInWorker",
                    "data.input_shape=[1,8,8]", "data.num_classes=10", "data.num_workers=1",
                    "data.placement=host", "trainer.max_epochs=2", "trainer.progress_bar=false"])
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "fit together" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "stoker: error: data: loader worker (pid "), proc.stderr[-1000:]
    # PyTorch names the signal, or (when the training thread met the broken pipe first)
    # only that the worker ended: either way the usual cause is said
    assert "the out-of-memory killer, usually" in proc.stderr


def test_accumulation_beyond_an_epochs_batches_says_the_global_batch_it_takes(make_cfg, caplog,
                                                                             tmp_path):
    """Each window is then a whole (short) epoch: the start-up line's global batch is not
    what a step averages over."""
    with caplog.at_level(logging.WARNING, logger="stoker"):
        train(make_cfg("trainer.accumulate_grad_batches=5", "trainer.limit_train_batches=3",
                       "trainer.max_steps=1"))
    said = [r.getMessage() for r in caplog.records if "accumulate_grad_batches=5" in
            r.getMessage()]
    assert said == ["trainer.accumulate_grad_batches=5 is more than the 3 batches of an epoch "
                    "on this rank: each optimizer step accumulates 3, a global batch of 3 x "
                    "the per-rank batch x the world size, not the one the start-up line gives"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stoker"):  # a short last window: no line
        train(make_cfg("trainer.accumulate_grad_batches=2", "trainer.limit_train_batches=3",
                       "trainer.max_steps=1", run_dir=tmp_path / "short"))
    assert not [r for r in caplog.records if "accumulate_grad_batches" in r.getMessage()]


def test_the_done_line_is_followed_by_how_many_warnings_the_run_said(make_cfg, tmp_path,
                                                                     caplog):
    from trainer.logging import WarningCount

    with caplog.at_level(logging.INFO):
        warned = train(make_cfg("trainer.max_steps=5", "trainer.save_checkpoint=false"))
    assert warned["warnings"] == 1  # the 20-step warmup outlasts the 5 steps
    messages = [r.getMessage() for r in caplog.records]
    done = next(i for i, m in enumerate(messages) if m.startswith("done: "))
    assert messages[done + 1] == "1 warning above"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        quiet = train(make_cfg("trainer.max_epochs=1", "trainer.save_checkpoint=false",
                               run_dir=tmp_path / "quiet"))
    assert quiet["warnings"] == 0 and "warning above" not in caplog.text
    assert not [h for h in logging.getLogger().handlers if isinstance(h, WarningCount)]


def test_an_error_while_a_checkpoint_is_written_in_the_background_lets_the_write_end(
        make_cfg, tmp_path, monkeypatch):
    """A step that fails while the previous checkpoint is still being written on its
    background thread: the run ends with its error once that checkpoint is complete (the
    process used to exit under the write, which aborted it and lost the file)."""
    import threading
    import time

    from trainer import checkpoint
    from trainer.loop import Callback

    real, failing = checkpoint.save, threading.Event()

    def slow(state, path):  # a large state on a slow disk: still writing when step 6 fails
        failing.wait(60)
        time.sleep(0.5)
        real(state, path)

    monkeypatch.setattr(checkpoint, "save", slow)

    class BreaksAtStep6(Callback):
        def after_step(self, loop):
            if loop.state.step == 6:
                failing.set()
                raise RuntimeError("broken at step 6")

    cfg = make_cfg("trainer.max_steps=20", "trainer.checkpoint.every_n_steps=5",
                   "trainer.checkpoint.async_save=true")
    with pytest.raises(RuntimeError, match="broken at step 6"):
        train(cfg, callbacks=[BreaksAtStep6()])
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["last.pt", "step-00000005.pt"]
    assert checkpoint.load(folder / "last.pt")["step"] == 5


def test_a_jobs_shm_copy_is_removed_when_the_job_ends_not_when_the_process_does(
        make_cfg, tmp_path, monkeypatch):
    """A sweep's jobs run one after another in one process: each kept its /dev/shm copy of
    the data until the whole sweep ended. A job that fails lets its copy go as well."""
    from data import cache
    from trainer.loop import Callback

    monkeypatch.setattr(cache, "SHM_ROOT", tmp_path / "shm")
    (tmp_path / "shm").mkdir()
    copies = []

    class Looks(Callback):
        def __init__(self, crash):
            self.crash = crash

        def after_step(self, loop):
            copies.append(sorted(p.name for p in (tmp_path / "shm").iterdir()))
            if self.crash and loop.state.step == 3:
                raise RuntimeError("a job's own error")

    for crash in (False, True):
        cfg = make_cfg("data.cache=shm", "trainer.max_steps=3", run_dir=tmp_path / str(crash))
        try:
            train(cfg, callbacks=[Looks(crash)])
        except RuntimeError:
            assert crash
        assert list((tmp_path / "shm").iterdir()) == []
    # (a copy per split, a job's own)
    assert len(copies) == 6 and copies[0] == copies[2] != copies[3] == copies[5]
    assert all(len(c) == 2 and c[0].startswith("stoker-") for c in copies)


@pytest.mark.parametrize("shown", [True, False])
def test_the_config_is_printed_at_start_unless_switched_off(make_cfg, tmp_path, caplog, shown):
    """The resolved config is some 120 lines at every start; config.yaml holds it either way."""
    with caplog.at_level(logging.INFO, logger="stoker"):
        train(make_cfg("trainer.max_steps=1", f"trainer.print_config={str(shown).lower()}"))
    printed = [r for r in caplog.records if r.getMessage().startswith("config:\n")]
    assert len(printed) == int(shown)
    assert "print_config" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_resume_whose_drawn_validation_files_changed_says_so(make_cfg, tmp_path, caplog):
    """With data.dataset.val_fraction a file added to a class draws another share of it for
    validation: files the model trained on were validated on, and a resume said only that
    the count of training samples changed."""
    import shutil

    from scripts.make_images import write_images

    write_images(tmp_path / "images", count=40, size=24, classes=2, val_fraction=0.0)
    root = tmp_path / "images" / "train"
    data = ["data=image_folder", f"data.dataset.root={root}", "data.dataset.size=16",
            "data.dataset.val_fraction=0.25", "model=cnn", "data.batch_size=8"]
    train(make_cfg(*data, "trainer.max_steps=2", "trainer.checkpoint.every_n_steps=2"))
    path = tmp_path / "run" / "checkpoints" / "step-00000002.pt"
    for run, change in (("same", False), ("changed", True)):
        if change:
            first = sorted((root / "class_00").iterdir())[0]
            shutil.copy(first, root / "class_00" / "added.jpg")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stoker"):
            train(make_cfg(*data, "trainer.max_steps=3", f"trainer.resume={path}",
                           run_dir=tmp_path / run))
        said = [r.getMessage() for r in caplog.records if "held out other" in r.getMessage()]
        assert said == ([f"checkpoint {path}: its run held out other validation files than "
                         "this one (data.dataset.val_fraction draws them from each class's "
                         "files, which changed): the model has trained on some of the files it "
                         "is now validated on, so its validation values are no longer of unseen "
                         "data; put the files back as they were, or start a new run"]
                        if change else [])


def test_compose_gives_train_pys_config_and_its_one_line_errors(tmp_path):
    """A program composing with Hydra's own compose needed the conf folder's path and met a
    misspelt override as Hydra's chained exceptions; `compose` takes the command line's
    arguments, a folder of one's own by hydra.searchpath included, and says a bad one in
    the command line's one line."""
    from hydra import initialize_config_dir

    from trainer.runner import CONF_DIR, compose

    for args, said in (
            (["trainer.max_epoch=2"], r"^Could not override 'trainer.max_epoch': Key "
                                      r"'max_epoch' not in 'TrainerConfig'.*; did you mean "
                                      r"trainer.max_epochs\?$"),
            (["optim=adamm"], r"^In 'train': Could not find 'optim/adamm' Available options "
                              r"in 'optim': adamw sgd; did you mean optim=adamw\?$")):
        with pytest.raises(ConfigError, match=said):
            compose(args)
        proc = run_cli(args)  # (the same line as train.py's)
        assert proc.returncode == 2 and re.search(said.replace("^", "^stoker: error: "),
                                                  proc.stderr.strip().splitlines()[-1])
    (tmp_path / "myconf" / "model").mkdir(parents=True)
    (tmp_path / "myconf" / "model" / "narrow.yaml").write_text(
        "_target_: trainer.models.MLP\nhidden: [16]\n")
    cfg = compose([f"hydra.searchpath=[file://{tmp_path / 'myconf'}]", "model=narrow",
                   f"run_dir={tmp_path / 'run'}", "trainer.max_epochs=1",
                   "trainer.progress_bar=false"])
    summary = train(cfg)
    assert summary["steps"] == 23 and cfg.model.hidden == [16]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):  # (a program's
        assert compose(["trainer.max_epochs=3"]).trainer.max_epochs == 3  # own context)
        with pytest.raises(ConfigError, match=r"did you mean trainer.max_epochs\?$"):
            compose(["trainer.max_epoch=2"])

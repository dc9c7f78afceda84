"""trainer/startup.py: what a run settles before its first step."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from trainer import rundir
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError
from trainer.startup import check_optimizer_step, resume_setting


def test_an_optimizer_that_needs_a_closure_is_refused_in_one_line():
    params = [torch.nn.Parameter(torch.zeros(2))]
    check_optimizer_step(torch.optim.SGD(params, lr=0.1))  # a closure it may take, not needs
    with pytest.raises(ConfigError, match=r"^optim: LBFGS.step\(\) needs a closure that "
                                          r"evaluates the loss again"):
        check_optimizer_step(torch.optim.LBFGS(params))


def test_a_torchrun_restart_continues_its_own_run_and_no_other(make_cfg, tmp_path,
                                                              monkeypatch):
    """A job launched with trainer.resume=PATH and restarted by torchrun after it saved goes on
    from its own newest checkpoint, not back to PATH; before its first save, from PATH again
    (its status.json names the job and PATH). A dir whose run is not this job's is refused
    to a restart as to the first attempt."""
    run_dir, path = tmp_path / "run", str(tmp_path / "other" / "step-00000004.pt")
    given = make_cfg(f"trainer.resume={path}", run_dir=run_dir)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    run_dir.mkdir()
    rundir.write_running(run_dir, path)  # the first attempt, killed before its first save
    assert resume_setting(given, run_dir) == path
    rundir.check_fresh_start(run_dir, path)  # its own earlier attempt: not refused
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step-00000002.pt").write_bytes(b"")
    assert resume_setting(given, run_dir) == "auto"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # another job's dir
    assert resume_setting(given, run_dir) == path
    with pytest.raises(CheckpointError, match="a new run from a checkpoint outside run dir"):
        rundir.check_fresh_start(run_dir, path)
    (run_dir / "checkpoints" / "step-00000002.pt").unlink()
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["job"], status["from"]) == ("TORCHELASTIC_RUN_ID=job-1", path)
    with pytest.raises(CheckpointError, match=rf"continue it with trainer.resume={path}, or "):
        rundir.check_fresh_start(run_dir, None)  # (auto would start from the seed)


def test_a_fast_dev_run_with_a_checkpoint_to_resume_is_refused_and_without_one_trains(
        make_cfg, tmp_path):
    """Its one step is the run's first: resumed, it trained nothing and exited 0. Without a
    checkpoint, trainer.resume=auto (which scripts/slurm/train.sbatch always adds) starts it."""
    from trainer.runner import train

    quick = ("trainer.max_steps=2", "trainer.progress_bar=false")
    train(make_cfg(*quick, run_dir=tmp_path / "run"))
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    # another run's checkpoint into a dir of its own (into the run's dir, the dir is refused
    # first: rundir.check_dev_run_dir)
    with pytest.raises(ConfigError, match=r"^trainer\.fast_dev_run=true \(debug=fdr\) trains a "
                                          r"run's first step alone .* would continue .*last\.pt "
                                          r"at step 2: nothing would be trained; drop"):
        train(make_cfg(*quick, "debug=fdr", f"trainer.resume={tmp_path}/run/checkpoints/last.pt",
                       run_dir=tmp_path / "other"))
    with pytest.raises(ConfigError, match=r"^trainer\.fast_dev_run=true \(debug=fdr\): run dir "):
        train(make_cfg(*quick, "debug=fdr", "trainer.resume=auto", run_dir=tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before
    fresh = train(make_cfg("debug=fdr", "trainer.resume=auto", run_dir=tmp_path / "new"))
    assert fresh["steps"] == 1


def test_another_runs_complete_checkpoint_is_validated_again_and_says_nothing_is_trained(
        make_cfg, tmp_path, caplog):
    from tests.helpers import read_metrics
    from trainer.runner import train

    first = train(make_cfg("trainer.max_epochs=1", run_dir=tmp_path / "first"))
    with caplog.at_level(logging.INFO, logger="stoker"):
        again = train(make_cfg("trainer.max_epochs=1", f"trainer.resume={first['checkpoint']}",
                               run_dir=tmp_path / "again"))
    assert again["steps"] == first["steps"] and again["val_acc"] == first["val_acc"]
    assert ("nothing to train: its run is complete (trainer.max_epochs=1, trainer.max_steps=-1)"
            "; it is validated again for this run dir's record; give trainer.max_epochs=2 or "
            "more to train on" in caplog.text)
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done:")]
    assert len(done) == 1 and "| no training step in this launch |" in done[0]
    assert "samples/s" not in done[0]
    assert [r["split"] for r in read_metrics(tmp_path / "again")] == ["val"]


def test_a_resume_with_another_batch_moves_the_schedule_to_its_position_in_the_new_plan(
        make_cfg, tmp_path, caplog):
    """Steps per epoch differ after a resume with another batch (or world size): the cosine
    goes on from the step the position has in the new plan, so the resumed steps get the lrs a
    run with the new batch from the start has there, and it ends with the run (counted in the
    old steps, it would sit at 0 from past the new plan's total)."""
    from tests.helpers import read_metrics
    from trainer.runner import train

    common = ("trainer.log_every_n_steps=1", "sched.warmup_steps=4")
    first = train(make_cfg(*common, "trainer.max_epochs=6", "trainer.checkpoint.every_n_steps=92",
                           "trainer.checkpoint.every_n_epochs=0", run_dir=tmp_path / "a"))
    assert first["steps"] == 138  # 23 steps an epoch at batch 64
    with caplog.at_level(logging.INFO, logger="stoker"):
        resumed = train(make_cfg(*common, "trainer.max_epochs=6", "data.batch_size=128",
                                 f"trainer.resume={tmp_path / 'a' / 'checkpoints'}"
                                 "/step-00000092.pt", run_dir=tmp_path / "b"))
    assert "the lr schedule moves from its step 92 to 48: this run's plan puts its position " \
        "at step 48 of the 72 its schedule spans (24 left)" in caplog.text
    # saved at epoch 3's last step (no epoch-end save): its position, whole global batches,
    # passes the 1438 samples
    assert "step-00000092.pt at epoch 3 step 92 (at the epoch's end)" in caplog.text
    fresh = train(make_cfg(*common, "trainer.max_epochs=6", "data.batch_size=128",
                           run_dir=tmp_path / "c"))
    assert resumed["steps"] == 92 + 24 and fresh["steps"] == 72
    lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "b") if r["split"] == "train"}
    want = {r["step"] + 44: r["lr"] for r in read_metrics(tmp_path / "c")
            if r["split"] == "train" and r["step"] > 48}
    assert lrs == pytest.approx(want) and min(list(lrs.values())[:-1]) > 0


def test_a_checkpoint_of_another_model_names_the_settings_its_run_was_launched_with(make_cfg,
                                                                                    tmp_path):
    """A short resume command that left out the run's own overrides (model=cnn): the misfit
    line names the model settings the run had, and where its whole resume command is."""
    from trainer.runner import train

    train(make_cfg("model=cnn", "trainer.max_steps=2"))
    with pytest.raises(CheckpointError) as e:
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto"))
    said = str(e.value)
    assert said.startswith(f"checkpoint {tmp_path / 'run' / 'checkpoints' / 'last.pt'} does "
                           "not fit this model; missing: ")
    assert said.endswith(  # (a finished run's status.json keeps no resume command)
        "(its run had other model settings: model._target_=trainer.models.SmallCNN, "
        "model.channels=[32, 64], model.batch_norm=True (+1 more); resume it with the "
        "overrides it was launched with)")
    hydra = tmp_path / "run" / ".hydra"
    hydra.mkdir()
    (hydra / "overrides.yaml").write_text("- model=cnn\n")  # as train.py's launch keeps them
    with pytest.raises(CheckpointError) as e:
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto"))
    assert str(e.value).endswith(f"launched with; {hydra / 'overrides.yaml'} lists them)")


def test_a_checkpoint_copied_from_another_run_names_that_runs_records(make_cfg, tmp_path):
    """Another run's last.pt put in this run's checkpoints/: the line pointed at this dir's
    overrides.yaml, another run's, which cannot give the file's settings."""
    import shutil

    from trainer.runner import train

    train(make_cfg("model=cnn", "trainer.max_steps=2", run_dir=tmp_path / "cnn"))
    train(make_cfg("trainer.max_steps=2", run_dir=tmp_path / "mlp"))
    for run, overrides in (("cnn", "- model=cnn\n"), ("mlp", "- trainer.max_steps=2\n")):
        (tmp_path / run / ".hydra").mkdir()
        (tmp_path / run / ".hydra" / "overrides.yaml").write_text(overrides)
    shutil.copy(tmp_path / "cnn" / "checkpoints" / "last.pt",
                tmp_path / "mlp" / "checkpoints" / "last.pt")
    with pytest.raises(CheckpointError) as e:
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto", run_dir=tmp_path / "mlp"))
    assert str(e.value).endswith(
        f"resume it with the overrides it was launched with; the file was saved by the run in "
        f"{tmp_path / 'cnn'}, not this dir's; {tmp_path / 'cnn' / '.hydra' / 'overrides.yaml'} "
        "lists them)")
    # a run dir moved since (its saved run_dir gone): its own records are the ones
    (tmp_path / "cnn").rename(tmp_path / "moved")
    with pytest.raises(CheckpointError) as e:
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto", run_dir=tmp_path / "moved"))
    moved = tmp_path / "moved" / ".hydra" / "overrides.yaml"
    assert str(e.value).endswith(f"launched with; {moved} lists them)")


def test_a_model_setting_the_command_changes_is_named_as_the_commands(tmp_path):
    """The misfit line told a user to give the run's own overrides, which its overrides.yaml
    did not hold (the model's width came from a config file), where the command's own
    `model.hidden=128` was what to leave out."""
    from tests.helpers import run_cli

    run = tmp_path / "run"
    first = run_cli(["model.hidden=[16]", "trainer.max_steps=2", "trainer.progress_bar=false",
                     f"hydra.run.dir={run}"])
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(["trainer.resume=auto", f"hydra.run.dir={run}", "model.hidden=[32]",
                     "trainer.max_steps=4"])
    assert again.returncode == 2
    assert "(its run had other model settings: model.hidden=[16]; this command sets " \
        "model.hidden=[32]: leave it out to resume the run as it was)" in again.stderr, \
        again.stderr[-2000:]


def test_a_checkpoint_of_a_model_sized_for_other_data_names_the_data_settings(make_cfg,
                                                                              tmp_path):
    """The same model for another dataset (data=... left out of a resume): its sizes come
    from the data config, so those are named."""
    from trainer.runner import train

    train(make_cfg("data=synthetic", "trainer.max_steps=2"))
    with pytest.raises(CheckpointError) as e:
        train(make_cfg("trainer.max_steps=4", "trainer.resume=auto"))
    said = str(e.value)
    assert "(its run had other model settings: data.input_shape=[3, 32, 32], " in said, said


def test_a_dataset_whose_classes_are_not_names_trains_and_writes_no_classes_json(make_cfg,
                                                                                 tmp_path,
                                                                                 caplog):
    from trainer.runner import train

    with caplog.at_level(logging.WARNING, logger="stoker"):
        summary = train(make_cfg("data.dataset._target_=tests.helpers.CountedClassesDigits",
                                 "trainer.max_steps=2"))
    assert summary["steps"] == 2 and not (tmp_path / "run" / "classes.json").exists()
    assert "data: the training dataset's classes attribute (int) is not a list of class " \
        "names (str or int): classes.json is not written" in caplog.text


def test_a_schedule_that_cannot_move_and_would_step_past_its_end_is_refused_at_start(
        make_cfg, tmp_path):
    """OneCycleLR keeps the checkpoint's total_steps in its state and has no formula to move
    by: resumed with a smaller batch (more steps to go), it would fail mid-run past its end;
    it is refused before training, naming both counts."""
    from trainer.runner import train

    onecycle = ("sched=constant", "~sched.warmup_steps",
                "sched._target_=torch.optim.lr_scheduler.OneCycleLR", "+sched.max_lr=0.01")
    train(make_cfg(*onecycle, "trainer.max_epochs=2", "trainer.checkpoint.every_n_steps=23",
                   "trainer.checkpoint.every_n_epochs=0", run_dir=tmp_path / "a"))
    with pytest.raises(ConfigError, match=r"^sched: OneCycleLR spans the checkpoint's 46 steps, "
                                          r"and from its step 23 this run takes 45 more"):
        train(make_cfg(*onecycle, "trainer.max_epochs=2", "data.batch_size=32",
                       f"trainer.resume={tmp_path / 'a' / 'checkpoints'}/step-00000023.pt",
                       run_dir=tmp_path / "b"))


def test_resume_auto_in_a_new_dated_dir_is_a_warning_naming_the_key(tmp_path):
    """Without hydra.run.dir a launch gets a new dated dir, where resume=auto can never find
    anything: it started afresh with one INFO line, uncounted among the warnings."""
    from tests.helpers import run_cli

    quick = ["trainer.max_steps=1", "trainer.progress_bar=false", "data.num_workers=0",
             "trainer.resume=auto"]
    proc = run_cli(quick, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = [ln for ln in proc.stdout.splitlines() if "trainer.resume=auto" in ln]
    assert len(said) == 1 and said[0].endswith(
        ", a new dir: hydra.run.dir was left at its default (a new dated dir for every launch); "
        "name the run to continue with hydra.run.dir=..."), said
    assert "nothing to resume in " + str(tmp_path / "outputs") in said[0]
    counted = proc.stdout.splitlines()[-1]
    proc = run_cli([*quick, f"hydra.run.dir={tmp_path / 'named'}"], cwd=tmp_path)
    said = [ln for ln in proc.stdout.splitlines() if "trainer.resume=auto" in ln]
    assert len(said) == 1 and "a fresh start (the run to continue is named by hydra.run.dir)" \
        in said[0], proc.stdout

    def warnings(last_line: str) -> int:  # "N warning(s) above", or none said
        words = last_line.split("] ")[-1].split()
        return int(words[0]) if words[1:2] in (["warning"], ["warnings"]) else 0

    assert warnings(counted) == warnings(proc.stdout.splitlines()[-1]) + 1  # (counted)


def test_the_dropped_rows_line_agrees_with_its_count():
    """It said '1 rows ... were dropped'."""
    from trainer.startup import dropped_rows_line

    assert dropped_rows_line(1, 8) == ("metrics.jsonl: 1 row an earlier attempt logged after "
                                       "step 8 (the resumed one) was dropped: those steps are "
                                       "trained again")
    assert dropped_rows_line(3, 8).startswith("metrics.jsonl: 3 rows an earlier attempt ")
    assert " were dropped: " in dropped_rows_line(3, 8)

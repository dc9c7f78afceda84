"""A run dir belongs to one run: the refusal of a fresh run over another run's files
(nothing written first), damaged and unusable checkpoints, what a resume changes, the status
file, reclaimed /dev/shm caches, OS errors in one line."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch

from data.cache import OWNER, reclaim_shm
from tests.helpers import dead_pid, run_cli, snapshot
from trainer import rundir, runlock
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError
from trainer.loop import Callback
from trainer.runner import train

QUICK = ["trainer.max_steps=4", "trainer.progress_bar=false", "data.num_workers=0"]


def test_a_fresh_run_into_another_runs_dir_is_refused_with_nothing_written(tmp_path):
    run_dir = tmp_path / "run"
    first = run_cli([*QUICK, f"hydra.run.dir={run_dir}"])
    assert first.returncode == 0, first.stderr[-2000:]
    before = snapshot(run_dir)
    assert {".hydra/config.yaml", "config.yaml", "summary.json", "status.json"} <= before.keys()
    again = run_cli([*QUICK, "optim.lr=0.1", f"hydra.run.dir={run_dir}"])
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == (
        f"stoker: error: run dir {run_dir} holds another run's checkpoints (last.pt...): "
        "continue it with trainer.resume=auto, or start in a new dir (hydra.run.dir=...); "
        "nothing was changed")
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("resume", [[], ["trainer.resume=auto"]])
def test_one_run_into_a_sweeps_dir_is_refused_with_nothing_written(tmp_path, resume):
    """It started beside the sweep's jobs (with trainer.resume=auto: as a fresh start)."""
    sweep = tmp_path / "sweep"
    (sweep / "multirun.yaml").parent.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    for job in ("0", "1", "10", "2", "3"):
        (sweep / job).mkdir()
        (sweep / job / "status.json").write_text('{"status": "completed", "exit_code": 0}')
    before = snapshot(sweep)
    proc = run_cli([*QUICK, *resume, f"hydra.run.dir={sweep}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stoker: error: run dir {sweep} is a sweep's dir (multirun.yaml, jobs 0, 1, 2...), "
        f"not one run's: continue the sweep with its own -m command and trainer.resume=auto "
        f"hydra.sweep.dir={sweep}, or one job with its overrides (<job>/.hydra/overrides.yaml)"
        f" and trainer.resume=auto hydra.run.dir={sweep}/<job>; nothing was changed")
    assert snapshot(sweep) == before
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "10", "2", "3", "multirun.yaml"]


def test_a_runs_checkpoints_folder_or_a_folder_of_runs_is_no_run_dir(make_cfg, tmp_path):
    """trainer.resume=auto hydra.run.dir=RUN/checkpoints, or the folder that holds the runs,
    started a fresh run in it (one INFO line, exit 0) where a path to the folder in
    trainer.resume is refused."""
    run_dir = tmp_path / "runs" / "a"
    assert train(make_cfg(*QUICK, run_dir=run_dir))["steps"] == 4
    before = snapshot(tmp_path)
    folder = run_dir / "checkpoints"
    proc = run_cli([*QUICK, "trainer.resume=auto", f"hydra.run.dir={folder}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stoker: error: run dir {folder} is a run's checkpoints folder (it holds last.pt), "
        f"not a run's dir: to continue that run, trainer.resume=auto hydra.run.dir={run_dir}; "
        f"to start a new one from it, trainer.resume={folder / 'last.pt'} in a new dir; "
        "nothing was changed")
    with pytest.raises(CheckpointError, match=r"is a run's checkpoints folder \(it holds "):
        train(make_cfg(*QUICK, run_dir=folder))  # (a fresh run there too)
    for parent, named in ((tmp_path / "runs", "a"), (tmp_path, "runs/a")):
        with pytest.raises(CheckpointError) as refused:
            train(make_cfg(*QUICK, "trainer.resume=auto", run_dir=parent))
        assert str(refused.value) == (
            f"trainer.resume=auto: run dir {parent} holds runs ({named}), not a run of its "
            f"own: to continue one, trainer.resume=auto run_dir={run_dir}; nothing was changed")
    assert snapshot(tmp_path) == before
    # a new run dir beside them: a fresh start
    assert train(make_cfg(*QUICK, "trainer.resume=auto", run_dir=tmp_path / "runs" / "b"))[
        "steps"] == 4
    # a folder of one's own that holds a last.pt (no run's folder: no status.json beside it)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "last.pt").write_bytes((folder / "last.pt").read_bytes())
    assert train(make_cfg(*QUICK, run_dir=mine))["steps"] == 4


@pytest.mark.parametrize("name", ["config.yaml", "status.json", "metrics.jsonl"])
def test_a_folder_with_such_a_file_is_refused_to_a_fresh_run_and_to_resume_auto(make_cfg,
                                                                                 tmp_path, name):
    """A folder of the user's own (`hydra.run.dir=.` in a project holding its config.yaml): a
    file a run would write is never overwritten, by a fresh run nor by `trainer.resume=auto`,
    which has no run there to continue (no checkpoint, no run's status.json); the refusal
    does not advise it."""
    run_dir = tmp_path / "project"
    run_dir.mkdir()
    (run_dir / name).write_text("mine: true\n")
    held = rf"holds {re.escape(name)}, files a run writes \(not a run's: no status.json of one\)"
    with pytest.raises(CheckpointError, match=rf"^run dir {run_dir} {held}: start in a new dir"):
        train(make_cfg(*QUICK, run_dir=run_dir))
    with pytest.raises(CheckpointError, match=rf"^trainer.resume=auto: run dir {run_dir} holds "
                                              rf"{re.escape(name)}, files a run writes, but no "
                                              r"checkpoint to continue from nor a run's "
                                              r"status.json; start in a new dir"):
        train(make_cfg(*QUICK, "trainer.resume=auto", run_dir=run_dir))
    assert snapshot(run_dir) == {name: b"mine: true\n"}


def test_another_launchs_hydra_record_is_refused_and_this_launchs_is_not(make_cfg, tmp_path):
    """A dir another Hydra app wrote (its .hydra/ record, its train.log): a fresh run would
    write its record over that one. Hydra's record of this very launch (hydra.output_subdir
    set, written before the checks) is no reason to refuse."""
    import os
    import time

    run_dir = tmp_path / "their-app"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("theirs: true\n")
    (run_dir / "train.log").write_text("their log\n")
    an_hour_ago = time.time() - 3600
    os.utime(run_dir / ".hydra" / "config.yaml", (an_hour_ago, an_hour_ago))
    with pytest.raises(CheckpointError, match=rf"^run dir {run_dir} holds \.hydra/, files a run "
                                              r"writes \(not a run's: no status.json of one\)"):
        train(make_cfg(*QUICK, run_dir=run_dir))
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "theirs: true\n"
    assert (run_dir / "train.log").read_text() == "their log\n"
    proc = run_cli([*QUICK, "hydra.output_subdir=.hydra", f"hydra.run.dir={tmp_path / 'own'}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    # a launch of ours refused with hydra.output_subdir set left its record alone: the
    # corrected command runs there
    refused = tmp_path / "refused"
    proc = run_cli([*QUICK, "hydra.output_subdir=.hydra", "optim.lr=inf",
                    f"hydra.run.dir={refused}"])
    assert proc.returncode == 2 and (refused / ".hydra" / "config.yaml").is_file()
    os.utime(refused / ".hydra" / "config.yaml", (an_hour_ago, an_hour_ago))
    proc = run_cli([*QUICK, f"hydra.run.dir={refused}"])
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_run_killed_before_its_first_checkpoint_is_started_over_by_resume_auto(tmp_path):
    """Its status.json says it was running (written with its first files): a run's record, so
    `trainer.resume=auto` starts it over, and a fresh run is told to continue it."""
    run_dir = tmp_path / "run"
    proc = run_cli(["trainer.max_steps=2", "trainer.save_checkpoint=false",
                    "trainer.progress_bar=false", "data.num_workers=0",
                    f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir / "summary.json").unlink()  # as if killed (SIGKILL) before the end
    status = json.loads((run_dir / "status.json").read_text())
    (run_dir / "status.json").write_text(json.dumps({**status, "status": "running",
                                                      "exit_code": None}))
    again = run_cli([*QUICK, f"hydra.run.dir={run_dir}"])
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1].endswith(
        "holds another run's metrics.jsonl, config.yaml, status.json: continue it with "
        "trainer.resume=auto, or start in a new dir (hydra.run.dir=...); nothing was changed")
    assert run_cli([*QUICK, "trainer.resume=auto", f"hydra.run.dir={run_dir}"]).returncode == 0
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_a_run_writes_running_into_status_json_with_its_first_files(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    seen = []

    class Look(Callback):
        def after_step(self, loop):
            seen.append(json.loads((run_dir / "status.json").read_text()))

    train(make_cfg(*QUICK, run_dir=run_dir), callbacks=[Look()])
    assert seen[0]["status"] == "running" and seen[0]["exit_code"] is None
    assert seen[0]["pid"] == os.getpid()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_a_new_run_from_another_runs_checkpoint_is_refused_a_dir_holding_a_run(tmp_path):
    """`trainer.resume=PATH` outside the run dir starts a new run from that state: it needs a
    dir of its own, and one holding another run is left as it was; a checkpoint of the dir's
    own run continues it (rolled back to that step)."""
    a, b = tmp_path / "a", tmp_path / "b"
    every = ["trainer.checkpoint.every_n_steps=2"]
    assert run_cli([*QUICK, *every, f"hydra.run.dir={a}"]).returncode == 0
    assert run_cli([*QUICK, *every, "seed=7", f"hydra.run.dir={b}"]).returncode == 0
    before = snapshot(a)
    theirs = b / "checkpoints" / "step-00000002.pt"
    proc = run_cli([*QUICK, f"trainer.resume={theirs}", f"hydra.run.dir={a}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stoker: error: trainer.resume={theirs}: a new run from a checkpoint outside run dir "
        f"{a}, which holds another run's checkpoints (last.pt...): continue it with "
        "trainer.resume=auto, or start in a new dir (hydra.run.dir=...); nothing was changed")
    assert snapshot(a) == before
    c = tmp_path / "c"
    assert run_cli([*QUICK, f"trainer.resume={theirs}", f"hydra.run.dir={c}"]).returncode == 0
    own = a / "checkpoints" / "step-00000002.pt"
    assert run_cli([*QUICK, f"trainer.resume={own}", f"hydra.run.dir={a}"]).returncode == 0


def test_a_resume_its_first_batch_refuses_leaves_the_run_dir_as_it_was(tmp_path):
    """The task's check of the first batch comes after every start-up check: the run's files
    (config.yaml, .hydra/, status.json, metrics.jsonl, TensorBoard) are opened only once the
    first optimizer step succeeded, so a resume refused there changes none of them (train.log
    gets the attempt's lines)."""
    run_dir = tmp_path / "run"
    assert run_cli([*QUICK, f"hydra.run.dir={run_dir}"]).returncode == 0
    before = snapshot(run_dir)
    proc = run_cli(["trainer.max_steps=8", "trainer.progress_bar=false", "data.num_workers=0",
                    "task=regression", "trainer.resume=auto", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "stoker: error: task regression: targets that are not real numbers")
    after = snapshot(run_dir)
    assert {k: v for k, v in after.items() if k != "train.log"} == \
        {k: v for k, v in before.items() if k != "train.log"}


def test_a_fresh_run_replaces_an_attempt_that_failed_before_it_left_a_result(make_cfg,
                                                                              tmp_path):
    """A crash before any checkpoint or metrics row leaves config.yaml and a failed
    status.json: running the fixed command again in that dir is not refused. A .hydra/ that
    Hydra wrote before the checks (hydra.output_subdir) does not count either."""
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg(*QUICK, "data.dataset._target_=tests.helpers.FailingOnRankDigits",
                       "+data.dataset.fail_rank=0", "+data.dataset.fail_index=100",
                       run_dir=run_dir))
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"
    (run_dir / ".hydra").mkdir(exist_ok=True)
    (run_dir / ".hydra" / "config.yaml").write_text("written by Hydra before the checks\n")
    assert train(make_cfg(*QUICK, run_dir=run_dir))["steps"] == 4
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_a_refused_resume_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli([*QUICK, f"hydra.run.dir={run_dir}"]).returncode == 0
    before = snapshot(run_dir)
    proc = run_cli([*QUICK, "optim=sgd", "trainer.resume=auto", f"hydra.run.dir={run_dir}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "stoker: error: optim._target_=torch.optim.SGD: the checkpoint holds the state of "
        "torch.optim.AdamW, which cannot apply to another optimizer")
    assert snapshot(run_dir) == before


def test_resume_names_what_changed_and_keeps_the_checkpoints_lr(make_cfg, tmp_path, caplog):
    run_dir = tmp_path / "run"
    common = ["sched=constant", "trainer.checkpoint.every_n_steps=2", "trainer.progress_bar=false"]
    train(make_cfg(*common, "trainer.max_steps=2", run_dir=run_dir))
    caplog.set_level("INFO", logger="stoker")
    train(make_cfg(*common, "trainer.max_steps=4", "trainer.resume=auto", "optim.lr=0.03",
                   "data.batch_size=32", "trainer.log_every_n_steps=1", run_dir=run_dir))
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("resuming with changed settings"))
    assert "data.batch_size 64 -> 32; " in line and "optim.lr 0.003 -> 0.03 (kept at 0.003" in line
    assert "continues from it" in line
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows if r["split"] == "train" and r["step"] > 2] == [0.003] * 2


def test_a_resume_applies_its_own_optimizer_implementation(make_cfg, tmp_path, caplog):
    """optim.fused is how the optimizer computes: the resumed run's setting applies (and the
    log says so), while the checkpoint's state continues."""
    run_dir = tmp_path / "run"
    common = ["sched=constant", "trainer.checkpoint.every_n_steps=2", "trainer.progress_bar=false"]
    train(make_cfg(*common, "trainer.max_steps=2", run_dir=run_dir))
    caplog.set_level("INFO", logger="stoker")
    seen = []

    class Look(Callback):
        def after_step(self, loop) -> None:
            group = loop.optimizer.param_groups[0]
            seen.append((group["fused"], loop.optimizer.state[group["params"][0]]["step"].item()))

    train(make_cfg(*common, "trainer.max_steps=4", "trainer.resume=auto", "optim.fused=true",
                   run_dir=run_dir), callbacks=[Look()])
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("resuming with changed settings"))
    assert "optim.fused None -> True (applied: how the optimizer computes, not its state)" in line
    assert seen == [(True, 3.0), (True, 4.0)]


def test_when_no_checkpoint_loads_resume_auto_refuses_and_keeps_the_files(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    train(make_cfg(*QUICK, "trainer.checkpoint.every_n_steps=2", run_dir=run_dir))
    for p in (run_dir / "checkpoints").glob("*.pt"):
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.unlink()  # last.pt is a hard link to the newest: damage each file once
        p.write_bytes(bytes(data))
    before = snapshot(run_dir)
    with pytest.raises(CheckpointError, match=r"trainer.resume=auto: none of the 3 checkpoints "
                                              r"in .* loads"):
        train(make_cfg(*QUICK, "trainer.resume=auto", run_dir=run_dir))
    after = snapshot(run_dir)
    assert after == before


def test_a_file_where_the_run_dir_should_be_is_one_line(tmp_path):
    (tmp_path / "blocker").write_text("a file")
    proc = run_cli([*QUICK, f"hydra.run.dir={tmp_path / 'blocker' / 'run'}"])
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"stoker: error: hydra.run.dir={tmp_path / 'blocker' / 'run'}: a file is in "
                    "the way where a folder must be (Not a directory)")
    assert "Traceback" not in proc.stderr


def test_shm_caches_of_dead_runs_are_reclaimed(tmp_path, monkeypatch):
    from data import cache

    mine, gone = tmp_path / "stoker-mine", tmp_path / "stoker-gone"
    for folder, who in ((mine, runlock.owner()), (gone, {**runlock.owner(), "pid": dead_pid()})):
        (folder / "train").mkdir(parents=True)
        (folder / OWNER).write_text(json.dumps(who))
    (tmp_path / "stoker-unknown" / "train").mkdir(parents=True)  # no owner: not ours to judge
    assert reclaim_shm(runlock.owner_alive, root=tmp_path) == [gone]
    # the data at once; the dead owner's record (a few bytes) for the ranks on their way to it
    assert [p.name for p in gone.iterdir()] == [OWNER]
    assert (mine / "train").is_dir() and (tmp_path / "stoker-unknown" / "train").is_dir()
    monkeypatch.setattr(cache, "FAILED_KEEP_S", 0.0)
    assert reclaim_shm(runlock.owner_alive, root=tmp_path) == [gone]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stoker-mine", "stoker-unknown"]


@pytest.mark.parametrize("args,fragment", [
    (["sched.warmup_steps=-5"], "sched.warmup_steps=-5: must be an integer >= 0"),
    (["data.batch_size=5000", "data.drop_last=true"],
     "data.batch_size=5000: no optimizer step per epoch with 1438 training samples"),
    (["data=custom", "+data.dataset._target_=tests.helpers.Empty", "data.input_shape=[4]",
      "data.num_classes=2"], "data.dataset: Empty split=train has no samples"),
    # of a dataset built once per split, the empty one is named (it was the whole dataset)
    (["data.dataset._target_=tests.helpers.EmptyVal"], "data.dataset: EmptyVal split=val has "
                                                       "no samples"),
    (["data=custom", "+data.dataset._target_=tests.helpers.Endless", "data.input_shape=[4]",
      "data.num_classes=2"], "data.dataset: Endless has 10,000,000,000,000 samples, whose "
                             "shuffled order alone takes 480,000 GB, more than half of this "
                             "machine's"),
    (["data.input_shape=[32]"], "model: MLP cannot take the first batch (list(tensor(64, 1, "
                                "8, 8) float32, tensor(64,) int64)): mat1 and mat2 shapes "
                                "cannot be multiplied"),
])
def test_mismatches_fail_before_the_first_step(make_cfg, args, fragment):
    with pytest.raises(ConfigError) as info:
        train(make_cfg(*QUICK, *args))
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("code,word", [(0, "completed"), (1, "failed"),
                                       (2, "failed: configuration, data or checkpoint"),
                                       (75, "preempted")])
def test_status_names_how_the_run_ended(tmp_path, code, word):
    rundir.write_status(tmp_path, code, "" if code in (0, 75) else "stoker: error: x")
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == word and status["exit_code"] == code
    assert status["error"] == (None if code in (0, 75) else "stoker: error: x")
    assert "resume" not in status  # no checkpoint to resume from
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"x")
    rundir.write_status(tmp_path, code, "")
    status = json.loads((tmp_path / "status.json").read_text())
    # (written outside Hydra, as a run started from Python: its config's run_dir override)
    assert status.get("resume") == (f"trainer.resume=auto run_dir={tmp_path}"
                                    if code == 75 else None)


@pytest.mark.parametrize("bad,said", [
    ("data.num_workers=-1", "data.num_workers=-1"),  # refused before the lock
    ("model._target_=nope.Model", "model._target_=nope.Model"),  # after it, building
    ("data.input_shape=[32]", "model: MLP cannot take the first batch")])  # after train.log
def test_a_refused_launch_leaves_no_empty_run_dir_and_keeps_the_users_own(tmp_path, bad, said):
    proc = run_cli([bad], cwd=tmp_path)  # the default dated dir under outputs/
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"stoker: error: {said}")
    assert list(tmp_path.iterdir()) == []  # (its train.log's first lines went with it)
    mine, runs = tmp_path / "mine", tmp_path / "runs"
    mine.mkdir()
    runs.mkdir()
    assert run_cli([bad, f"hydra.run.dir={mine}"], cwd=tmp_path).returncode == 2
    assert run_cli([bad, f"hydra.run.dir={runs / 'a'}"], cwd=tmp_path).returncode == 2
    assert mine.is_dir() and runs.is_dir()  # dirs the user made are theirs
    if (mine / "train.log").exists():  # a log that was begun says why it ends there
        last = (mine / "train.log").read_text().strip().splitlines()[-1]
        assert f"[ERROR] stopped before the first step: {said}" in last, last
    assert bad != "data.input_shape=[32]" or (mine / "train.log").exists()


def test_from_python_the_refusal_names_the_run_dir_key(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    assert train(make_cfg(*QUICK, run_dir=run_dir))["steps"] == 4
    with pytest.raises(CheckpointError, match=r"or start in a new dir \(run_dir=\.\.\.\); "):
        train(make_cfg(*QUICK, run_dir=run_dir))


def test_resume_auto_without_a_checkpoint_keeps_a_finished_runs_files(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    assert train(make_cfg(*QUICK, "trainer.save_checkpoint=false", run_dir=run_dir))[
        "steps"] == 4
    before = snapshot(run_dir)
    with pytest.raises(CheckpointError, match=r"^trainer.resume=auto: run dir .* holds a "
                                              r"finished run's summary.json and no checkpoint"):
        train(make_cfg(*QUICK, "trainer.resume=auto", run_dir=run_dir))
    assert snapshot(run_dir) == before


def test_a_run_rolled_back_to_its_own_earlier_checkpoint_sets_the_later_ones_aside(make_cfg,
                                                                                  tmp_path):
    """Resumed from step 23 of 69 with keep_last=1: keep_last had kept the old timeline's
    step-69 (the newest by name) and deleted the new step-46 it had just written, and
    `trainer.resume=auto` went back to step 69. Now the later files move to a folder of their
    own, nothing deleted, and best.pt comes from the new timeline."""
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints"
    best = ["trainer.checkpoint.monitor=val_loss", "trainer.progress_bar=false"]
    assert train(make_cfg("trainer.max_epochs=3", *best, run_dir=run_dir))["steps"] == 69
    old_best = torch.load(folder / "best.pt", weights_only=True)["step"]
    old_rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    summary = train(make_cfg("trainer.max_epochs=2", "trainer.checkpoint.keep_last=1", *best,
                             f"trainer.resume={folder / 'step-00000023.pt'}", run_dir=run_dir))
    # best.pt of the old timeline (a step past 23) went aside: the new one is the new
    # timeline's; one at step 23 stays, and is replaced only by a better value
    assert summary["steps"] == 46 and summary["best"]["step"] in ((23, 46) if old_best == 23
                                                                  else (46,))
    aside = folder / "abandoned-after-step-00000023"
    assert sorted(p.name for p in aside.iterdir()) == sorted(
        ["step-00000046.pt", "step-00000069.pt", "last.pt", "metrics.jsonl", "summary.json"]
        + (["best.pt"] if old_best > 23 else []))
    # the old timeline's summary went too: a new attempt that failed left it naming its
    # step 69 and a last.pt moved away
    assert json.loads((aside / "summary.json").read_text())["steps"] == 69
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 46
    # the old timeline's metrics rows past step 23 went with its checkpoints (they left
    # metrics.jsonl, where the new timeline logs those steps, and were lost before)
    past = (aside / "metrics.jsonl").read_text().splitlines()
    assert past and all(json.loads(row)["step"] > 23 for row in past)
    kept = [row for row in old_rows if row not in past]
    assert (run_dir / "metrics.jsonl").read_text().splitlines()[:len(kept)] == kept
    assert len(kept) + len(past) == len(old_rows)
    assert sorted(p.name for p in folder.glob("*.pt")) == ["best.pt", "last.pt",
                                                          "step-00000046.pt"]
    for name in ("best.pt", "last.pt", "step-00000046.pt"):
        assert torch.load(folder / name, weights_only=True)["step"] <= 46
    (folder / "last.pt").unlink()  # (a hard link of step-46: not written through)
    (folder / "last.pt").write_bytes(b"damaged")
    again = train(make_cfg("trainer.max_epochs=2", *best, "trainer.resume=auto",
                           run_dir=run_dir))
    assert again["complete"] and again["steps"] == 46  # the new timeline's, not step 69
    # the set-aside timeline is not this dir's to go back to: said as what it is (it was
    # "a checkpoint outside run dir ..., which holds another run's checkpoints")
    before = snapshot(run_dir)
    with pytest.raises(CheckpointError, match=r"a state of this run's that a resume set aside "
                                              r"\(the timeline after step 23 it rolled back\)"):
        train(make_cfg("trainer.max_epochs=4", *best,
                       f"trainer.resume={aside / 'step-00000069.pt'}", run_dir=run_dir))
    assert snapshot(run_dir) == before


def test_a_fresh_run_that_crashes_at_its_first_batch_says_so_in_status_json(make_cfg,
                                                                            tmp_path):
    """The README's status.json records how a run ended: one that crashed before its first
    step left train.log alone. Its dir (new: no run's record there) gets the status; a dir
    with a run's record keeps it (the resume test above)."""
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="injected failure"):
        train(make_cfg(*QUICK, "data.dataset._target_=tests.helpers.FailingOnRankDigits",
                       "+data.dataset.fail_rank=0", "data.placement=host",
                       "data.num_workers=0", run_dir=run_dir))
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["exit_code"]) == ("failed", 1)
    assert status["error"] == "RuntimeError: injected failure on rank None"
    assert not (run_dir / "config.yaml").exists()  # (the run's files come with its first step)
    assert train(make_cfg(*QUICK, run_dir=run_dir))["steps"] == 4  # the fixed run goes on


@pytest.mark.parametrize("name", ["train.log", "metrics.jsonl", "status.json", ".stoker.lock"])
def test_a_pipe_in_place_of_a_run_file_is_refused_not_a_hang(tmp_path, name):
    """Hydra's log handler opening train.log, the metrics file opened for appending, the
    status read at start-up: each blocked on a pipe for ever (one SIGTERM did not end it)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    os.mkfifo(run_dir / name)
    proc = run_cli([*QUICK, f"hydra.run.dir={run_dir}"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stoker: error: hydra.run.dir={run_dir}: its {name} is a pipe, not a regular file: "
        "the run would block on it or write into it; move it away, or start in a new dir "
        "(hydra.run.dir=...)")
    assert sorted(p.name for p in run_dir.iterdir()) == [name]  # nothing written


def test_a_device_or_folder_is_named_and_a_dangling_link_is_no_refusal(tmp_path):
    (tmp_path / "metrics.jsonl").symlink_to("/dev/null")
    with pytest.raises(rundir.ConfigError, match="its metrics.jsonl is a device, not a regular"):
        rundir.check_plain_files(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "summary.json").mkdir()  # (found only at the end of the run's training)
    with pytest.raises(rundir.ConfigError, match=r"its summary.json is a folder, not a regular "
                                                 r"file: the run could not write it; move it"):
        rundir.check_plain_files(tmp_path)
    (tmp_path / "summary.json").rmdir()
    (tmp_path / "train.log").symlink_to(tmp_path / "nowhere")
    rundir.check_plain_files(tmp_path)


def test_a_run_dir_set_apart_from_hydras_is_refused_not_split(tmp_path):
    """run_dir=B beside hydra.run.dir=A put the run's files in B and its train.log lines
    into A's (another run's) log."""
    proc = run_cli([*QUICK, f"hydra.run.dir={tmp_path / 'a'}", f"run_dir={tmp_path / 'b'}"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stoker: error: run_dir={tmp_path / 'b'}: differs from the dir Hydra writes this "
        f"launch's train.log in ({tmp_path / 'a'}); under train.py name the run's dir with "
        f"hydra.run.dir={tmp_path / 'b'} and leave run_dir out (it is for configs composed "
        "outside train.py)")
    assert not (tmp_path / "b").exists() and not any((tmp_path / "a").iterdir())


def test_hydras_chdir_is_refused_not_a_run_reading_other_files(tmp_path):
    """hydra.job.chdir=true ran the job in its run dir: a relative trainer.resume was 'no
    such checkpoint file' and a relative data root another folder."""
    proc = run_cli([*QUICK, f"hydra.run.dir={tmp_path / 'run'}", "hydra.job.chdir=true"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "stoker: error: hydra.job.chdir=true: not supported; it runs the job in its run dir")
    assert not any((tmp_path / "run").iterdir())


def test_the_dir_key_of_the_other_mode_is_a_warning_naming_the_one_used(tmp_path):
    """Hydra ignores hydra.run.dir in a sweep and hydra.sweep.dir without -m: a run of
    `hydra.sweep.dir=<sweep> trainer.resume=auto` started afresh in a new dated dir."""
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    one = run_cli([*QUICK, f"hydra.sweep.dir={sweep}", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]
    assert (f"hydra.sweep.dir={sweep}: not used without -m; this run's dir is hydra.run.dir "
            f"({run}); a sweep's job is continued with hydra.run.dir=<sweep dir>/<job>") \
        in one.stdout
    many = run_cli(["-m", *QUICK, f"hydra.sweep.dir={sweep}", f"hydra.run.dir={run}"],
                   cwd=tmp_path)
    assert many.returncode == 0, many.stderr[-2000:]
    assert (f"hydra.run.dir={run}: not used in a sweep (-m), whose jobs go under "
            f"hydra.sweep.dir ({sweep})") in many.stdout
    assert json.loads((sweep / "0" / "summary.json").read_text())["warnings"] == 2  # (+ warmup)

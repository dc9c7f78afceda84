"""trainer/sweep.py: a sweep's jobs side by side, from the files each job left."""
from __future__ import annotations

import json

import pytest

from tests.helpers import run_cli
from trainer.sweep import best_job, jobs_of, summarise, table, varying
from trainer.sweepdirs import other_sweeps_job


def job(sweep, num, overrides, status=None, summary=None):
    """A job dir as a run leaves it: its overrides, status.json and summary.json."""
    d = sweep / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if status:
        (d / "status.json").write_text(json.dumps({"status": status}))
    if summary is not None:
        (d / "summary.json").write_text(json.dumps(summary))


def test_rows_show_what_differs_how_each_job_ended_and_the_best(tmp_path):
    sweep = tmp_path / "sweep"
    common = ["trainer.max_steps=2", "seed=1"]
    job(sweep, 0, ["optim.lr=0.1", *common, "+model.hidden=[8]"], "completed",
        {"steps": 2, "val_loss": 0.9, "val_acc": 0.7, "run_samples_per_s": 1234.5})
    job(sweep, 1, ["optim.lr=0.01", *common], "completed",
        {"steps": 2, "val_loss": 0.4, "val_acc": 0.6, "run_samples_per_s": 99.0})
    job(sweep, 2, ["optim.lr=0.001", *common], "failed")  # refused: no summary
    job(sweep, 10, ["optim.lr=1.0", *common], "completed",  # (in job order, not by name)
        {"steps": 2, "val_loss": float("nan"), "val_acc": 0.1})
    (sweep / "multirun.yaml").write_text("{}")  # not a job
    assert [j["job"] for j in jobs_of(sweep)] == [0, 1, 2, 10]
    assert varying(jobs_of(sweep)) == ["optim.lr", "+model.hidden"]
    assert best_job(jobs_of(sweep)) == (1, "val_loss", "min")  # NaN and failed jobs left out
    record = summarise(sweep)
    assert record["jobs"][0]["overrides"] == {"optim.lr": "0.1", "+model.hidden": "[8]"}
    assert record["jobs"][2]["status"] == "failed" and record["jobs"][2]["val_loss"] is None
    lines = table(record).splitlines()
    assert lines[0] == f"sweep: 4 jobs in {sweep}; best by val_loss (min): job 1"
    assert lines[1].split() == ["job", "optim.lr", "+model.hidden", "status", "steps",
                                "train_loss", "val_acc", "val_loss", "samples/s"]
    assert lines[2].split() == ["0", "0.1", "[8]", "completed", "2", "-", "0.7", "0.9", "1234"]
    assert lines[4].split() == ["2", "0.001", "-", "failed", "-", "-", "-", "-", "-"]


def test_jobs_of_any_subdir_name_and_only_compared_overrides_vary(tmp_path):
    """hydra.sweep.subdir=lr_${optim.lr}: its dirs are the jobs; a job whose overrides are not
    known (a dir a job never wrote into) makes no column; how the sweep was resumed is none."""
    sweep = tmp_path / "sweep"
    job(sweep, "lr_0.1", ["optim.lr=0.1", "seed=1", "trainer.resume=auto",
                          "hydra.sweep.dir=x"], "completed", {"val_loss": 0.5})
    job(sweep, "lr_0.01", ["optim.lr=0.01", "seed=1"], "completed", {"val_loss": 0.4})
    (sweep / "lr_1").mkdir()  # nothing in it: not a job
    (sweep / ".submitit").mkdir()
    (sweep / "lr_0.5").mkdir()
    (sweep / "lr_0.5" / "status.json").write_text(json.dumps({"status": "failed"}))
    jobs = jobs_of(sweep)
    assert [j["job"] for j in jobs] == ["lr_0.01", "lr_0.1", "lr_0.5"]
    assert varying(jobs) == ["optim.lr"]
    assert best_job(jobs)[0] == "lr_0.01"



def test_a_sweep_dir_without_jobs_gets_no_table_and_no_record(tmp_path, capsys):
    from omegaconf import OmegaConf

    from trainer.sweep import SweepSummary

    (tmp_path / "empty" / ".submitit").mkdir(parents=True)
    assert jobs_of(tmp_path / "empty") == []
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {
        "dir": str(tmp_path / "empty")}}}))
    assert capsys.readouterr().out == "" and not (tmp_path / "empty" / "sweep.json").exists()


def test_a_sweep_json_that_cannot_be_written_leaves_no_temporary_file(tmp_path, capsys):
    """A folder where sweep.json goes: the error names sweep.json, no .tmp is left, and the
    sweep's end still prints its table, with a warning after it."""
    from omegaconf import OmegaConf

    from trainer.sweep import SweepSummary, write

    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optim.lr=0.1"], "completed", {"val_loss": 0.5})
    (sweep / "sweep.json").mkdir()
    with pytest.raises(IsADirectoryError) as e:
        write(sweep, summarise(sweep))
    assert e.value.filename == str(sweep / "sweep.json")
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}}))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("sweep: 1 job in ") and out[2].split()[:3] == ["0", "0.1", "completed"]
    assert out[3] == (f"stoker: warning: {sweep / 'sweep.json'} not written (Is a directory); "
                      "the table above is what it would hold")
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "sweep.json"]


def test_damaged_files_and_a_running_job_whose_process_is_gone_are_shown_as_such(tmp_path):
    """A status.json cut short is no "not started" job with results; a summary.json cut short
    is said; a job marked running whose process on this host is gone (SIGKILL) is stopped,
    one whose process lives, or runs on another host, is running."""
    import os
    import socket
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()  # (reaped: its pid names no process)
    here = socket.gethostname()
    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optim.lr=0.1"], summary={"steps": 2, "val_loss": 0.4})
    (sweep / "0" / "status.json").write_text('{"status": "compl')
    job(sweep, 1, ["optim.lr=0.2"], "completed")
    (sweep / "1" / "summary.json").write_text("")
    for num, host, pid in [(2, here, gone.pid), (3, here, os.getpid()), (4, "elsewhere", gone.pid)]:
        job(sweep, num, [f"optim.lr=0.{num + 1}"])
        (sweep / str(num) / "status.json").write_text(json.dumps(
            {"status": "running", "exit_code": None, "host": host, "pid": pid}))
    job(sweep, 5, ["optim.lr=0.6"])
    (sweep / "5" / "status.json").write_text("[]")
    record = summarise(sweep)
    assert [r["status"] for r in record["jobs"]] == [
        "unreadable status.json", "completed", "stopped (process gone)", "running", "running",
        "unreadable status.json"]
    assert record["jobs"][0]["val_loss"] == 0.4 and record["best_job"] is None
    assert record["warnings"] == [
        f"{sweep / '0' / 'status.json'}: not JSON; its job shows as \"unreadable status.json\"",
        f"{sweep / '1' / 'summary.json'}: not JSON; its job's results show as -",
        f"{sweep / '5' / 'status.json'}: not a JSON object; its job shows as \"unreadable "
        "status.json\""]
    assert table(record).splitlines()[4].split()[:5] == ["2", "0.3", "stopped", "(process",
                                                        "gone)"]


def test_a_jobs_best_checkpoint_ranks_it_where_it_kept_one(tmp_path):
    """Job 0 ends higher, job 1 peaked higher (its best.pt): the best checkpoint is job 1's."""
    sweep = tmp_path / "sweep"
    monitor = {"key": "val_acc", "mode": "max"}
    job(sweep, 0, ["optim.lr=0.1"], "completed",
        {"val_acc": 0.97, "monitor": monitor, "best": {"monitor": "val_acc", "value": 0.972}})
    job(sweep, 1, ["optim.lr=0.01"], "completed",
        {"val_acc": 0.96, "monitor": monitor, "best": {"monitor": "val_acc", "value": 0.978}})
    record = summarise(sweep)
    assert record["best_job"] == 1 and [r["best_val_acc"] for r in record["jobs"]] == [0.972,
                                                                                       0.978]
    lines = table(record).splitlines()
    assert lines[0].endswith("best by val_acc (max, best.pt's): job 1")
    assert "best_val_acc" in lines[1].split()


def test_nested_subdirs_are_jobs_in_launch_order(tmp_path):
    """hydra.sweep.subdir=runs/${...}: the job dirs are a level down; the order is Hydra's
    job number (`.hydra/hydra.yaml`), not the dirs' names."""
    sweep = tmp_path / "sweep"
    for num, name in [(0, "runs/lr0.001"), (1, "runs/lr-1")]:
        job(sweep, name, [f"optim.lr={name[7:]}"], "completed", {"val_loss": 1.0 - num})
        (sweep / name / ".hydra" / "hydra.yaml").write_text(f"hydra:\n  job:\n    num: {num}\n")
    assert [j["job"] for j in jobs_of(sweep)] == ["runs/lr0.001", "runs/lr-1"]
    deep = tmp_path / "deep"  # (three levels were searched: a/b/c/0 had no table)
    for num in (0, 1):
        job(deep, f"a/b/c/{num}", [f"optim.lr={num}"], "completed", {"val_loss": 1.0})
    (deep / "a" / "b" / "c" / "0" / "checkpoints" / "x" / "status.json").mkdir(parents=True)
    assert [j["job"] for j in jobs_of(deep)] == ["a/b/c/0", "a/b/c/1"]  # (not inside a job)


def test_the_best_follows_the_monitored_key_and_its_mode(tmp_path):
    sweep = tmp_path / "sweep"
    monitor = {"key": "val_acc", "mode": "max"}
    job(sweep, 0, ["optim.lr=0.1"], "completed", {"val_loss": 0.9, "val_acc": 0.7,
                                                  "monitor": monitor})
    job(sweep, 1, ["optim.lr=0.01"], "completed", {"val_loss": 0.4, "val_acc": 0.6,
                                                   "monitor": monitor})
    job(sweep, 2, ["optim.lr=0.5"], "running")
    assert best_job(jobs_of(sweep)) == (0, "val_acc", "max")
    job(tmp_path / "none", 0, ["optim.lr=0.1"], "failed")
    assert table(summarise(tmp_path / "none")).splitlines()[0].endswith(
        "best by val_loss (min): none (no completed job logged it)")


def test_a_sweep_that_ran_every_job_prints_its_table_and_writes_sweep_json(tmp_path):
    proc = run_cli(["-m", "optim.lr=1e-3,3e-3", "trainer.max_steps=2", "trainer.max_epochs=1",
                    "trainer.limit_val_batches=1", "trainer.progress_bar=false",
                    "trainer.checkpoint.monitor=val_acc"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [sweep] = (tmp_path / "multirun").glob("*/*")
    record = json.loads((sweep / "sweep.json").read_text())
    assert [(r["job"], r["overrides"], r["status"], r["steps"]) for r in record["jobs"]] == [
        (0, {"optim.lr": "0.001"}, "completed", 2), (1, {"optim.lr": "0.003"}, "completed", 2)]
    assert (record["monitor"], record["mode"]) == ("val_acc", "max")
    best = max(record["jobs"], key=lambda r: r["val_acc"])["job"]
    out = proc.stdout.splitlines()
    at = out.index(next(line for line in out if line.startswith("sweep: 2 jobs in ")))
    # (each job's one validation, at max_steps inside its first epoch, is its best.pt's)
    assert out[at].endswith(f"best by val_acc (max, best.pt's): job {best}")
    assert out[at + 1].split()[:3] == ["job", "optim.lr", "status"] and len(out) == at + 4


def test_a_job_dir_of_another_sweep_is_told_by_the_keys_its_sweep_varied(tmp_path):
    """A relaunch numbers its jobs as the sweep in the dir did: job 0 with another value of a
    key that sweep varied is another sweep's (1e-3 and 0.001 are one value); a longer run
    (max_epochs), or a key the sweep did not vary, is a resume's change; a sweep of one job
    varied none."""
    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optim.lr=1e-3", "trainer.max_epochs=1"], "completed")
    job(sweep, 1, ["optim.lr=3e-3", "trainer.max_epochs=1"], "completed")
    assert other_sweeps_job(sweep / "0", sweep, ["optim.lr=0.01", "trainer.max_epochs=1"]) \
        == "optim.lr=1e-3 there, 0.01 in this job"
    assert other_sweeps_job(sweep / "1", sweep, ["trainer.max_epochs=1"]) \
        == "optim.lr=3e-3 there, (not set) in this job"
    for same in (["optim.lr=0.001", "trainer.max_epochs=3", "data.num_workers=2",
                  "trainer.resume=auto"], ["optim.lr=1e-3"]):
        assert other_sweeps_job(sweep / "0", sweep, same) is None
    assert other_sweeps_job(sweep / "2", sweep, ["optim.lr=1.0"]) is None  # (no record yet)
    single = tmp_path / "single"
    job(single, 0, ["optim.lr=1e-3"], "completed")
    assert other_sweeps_job(single / "0", single, ["optim.lr=0.01"]) is None


def test_a_relaunch_refused_at_its_first_job_leaves_the_sweeps_record(tmp_path):
    """Another sweep into a sweep's dir, refused at job 0 (another run's checkpoints): Hydra
    wrote its multirun.yaml over the sweep's before the job said "nothing was changed"; the
    sweep's is put back. The same sweep with trainer.resume=auto runs, and its record stays."""
    sweep = tmp_path / "sweep"
    quick = ["trainer.max_steps=2", "trainer.max_epochs=1", "trainer.limit_val_batches=1",
             "trainer.progress_bar=false", f"hydra.sweep.dir={sweep}"]
    first = run_cli(["-m", "model=mlp,cnn", *quick], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    record = (sweep / "multirun.yaml").read_bytes()
    other = run_cli(["-m", "model=mlp", *quick], cwd=tmp_path)
    assert other.returncode == 2 and "nothing was changed" in other.stderr, other.stderr
    assert (sweep / "multirun.yaml").read_bytes() == record
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml", "sweep.json"]
    # the jobs in another order with trainer.resume=auto: job 0 would continue the other model
    swapped = run_cli(["-m", "model=cnn,mlp", *quick, "trainer.resume=auto"], cwd=tmp_path)
    assert swapped.returncode == 2 and swapped.stderr.strip().splitlines()[-2:] == [
        f"stoker: error: hydra.sweep.dir={sweep}: job dir {sweep / '0'} holds a run of another "
        "sweep's job (model=mlp there, cnn in this job): launch this sweep in a new "
        "hydra.sweep.dir, or continue that one with its own values; nothing was changed",
        "stoker: the sweep stopped at job 0; the jobs after it were not run"], swapped.stderr
    assert (sweep / "multirun.yaml").read_bytes() == record
    again = run_cli(["-m", "model=mlp,cnn", *quick, "trainer.resume=auto"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "- trainer.resume=auto" in (sweep / "multirun.yaml").read_text()
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "1", "multirun.yaml", "sweep.json"]


def test_the_record_kept_is_the_first_ranks_copy_and_goes_once_a_job_changed(tmp_path,
                                                                            monkeypatch):
    """Under torchrun each rank's Hydra writes multirun.yaml: rank 1 may write it before rank 0
    looks. The copy rank 1 made first is what rank 0 puts back; a launch that changed a job's
    status.json keeps its own record and leaves no copy."""
    import atexit

    from omegaconf import OmegaConf

    from trainer.sweep import SweepSummary

    sweep = tmp_path / "sweep"
    job(sweep, 0, ["model=mlp"], "completed")
    (sweep / "multirun.yaml").write_text("the sweep's\n")
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    # (two nodes: the launch is named by its rendezvous id, not by a clock)
    for key, value in [("TORCHELASTIC_RUN_ID", "launch"), ("GROUP_WORLD_SIZE", "2"),
                       ("WORLD_SIZE", "2"), ("RANK", "1")]:
        monkeypatch.setenv(key, value)

    def launch(changes_a_job):
        monkeypatch.setenv("RANK", "1")
        SweepSummary().on_multirun_start(config)
        (sweep / "multirun.yaml").write_text("this launch's\n")  # rank 1's Hydra
        monkeypatch.setenv("RANK", "0")
        rank0 = SweepSummary()
        rank0.on_multirun_start(config)
        atexit.unregister(rank0.settle)
        if changes_a_job:
            (sweep / "0" / "status.json").write_text('{"status": "running"}')
        rank0.settle()
        return (sweep / "multirun.yaml").read_text()

    assert launch(changes_a_job=False) == "the sweep's\n"
    assert launch(changes_a_job=True) == "this launch's\n"
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml"]


def test_a_job_that_stopped_early_says_so_in_its_row(tmp_path):
    sweep = tmp_path / "sweep"
    job(sweep, 0, ["trainer.early_stopping.patience=1"], "completed",
        {"steps": 46, "val_loss": 0.5, "stopped_early": "val_loss has not improved on 0.4"})
    job(sweep, 1, ["trainer.early_stopping.patience=3"], "completed",
        {"steps": 92, "val_loss": 0.3})
    record = summarise(sweep)
    assert record["jobs"][0]["stopped_early"] == "val_loss has not improved on 0.4"
    assert record["jobs"][1]["stopped_early"] is None
    lines = table(record).splitlines()
    assert lines[2].split()[:5] == ["0", "1", "completed", "(stopped", "early)"]
    assert lines[3].split()[:3] == ["1", "3", "completed"]
    assert best_job(jobs_of(sweep)) == (1, "val_loss", "min")  # a stopped job ranks as any


def test_a_relaunch_that_resumes_finds_its_jobs_dirs_named_by_their_overrides(tmp_path):
    """hydra.sweep.subdir=${hydra.job.override_dirname}: the relaunch with trainer.resume=auto
    that a stopped sweep names put every job in a new dir (its name held trainer.resume=auto),
    and trained the finished ones again beside their first dirs."""
    sweep = tmp_path / "sweep"
    args = ["-m", "optim.lr=0.1", "trainer.max_steps=2", "trainer.progress_bar=false",
            f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.override_dirname}"]
    first = run_cli(args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli([*args, "trainer.resume=auto"], cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [
        "optim.lr=0.1,trainer.max_steps=2,trainer.progress_bar=False"]
    assert "nothing to train" in again.stdout


def test_a_sweep_of_its_configs_params_is_told_by_them_and_else_by_its_jobs(tmp_path):
    """A sweep of `hydra.sweeper.params` (an experiment's sweep) has no sweep on its command
    line: its record named no key, job 0 was compared on nothing, and another sweep's
    relaunch continued job 0's run under its own lr (its checkpoint and summary overwritten).
    The params name the keys; a record that sweeps nothing leaves it to the jobs' records."""
    from trainer.sweep import kept_record

    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optim.lr=0.1", "experiment=a", "trainer.max_epochs=1"], "completed")
    job(sweep, 1, ["optim.lr=0.01", "experiment=a", "trainer.max_epochs=1"], "completed")
    kept_record(sweep).write_text("hydra:\n  sweeper:\n    params:\n      optim.lr: 0.1,0.01\n"
                                  "  overrides:\n    task:\n    - experiment=a\n"
                                  "    - trainer.max_epochs=1\n")
    assert other_sweeps_job(sweep / "0", sweep, ["optim.lr=0.5", "experiment=b",
                                                 "trainer.max_epochs=2"]) == \
        "optim.lr=0.1 there, 0.5 in this job"
    assert other_sweeps_job(sweep / "0", sweep, ["optim.lr=0.1", "experiment=a",
                                                 "trainer.max_epochs=2"]) is None
    kept_record(sweep).write_text("hydra:\n  overrides:\n    task:\n    - experiment=a\n")
    assert other_sweeps_job(sweep / "0", sweep, ["optim.lr=0.5", "experiment=a"]) == \
        "optim.lr=0.1 there, 0.5 in this job"  # (the jobs' records: lr is what varied)


def test_the_keys_a_sweep_varied_come_from_its_kept_record_when_it_has_one(tmp_path):
    """A sweep stopped in its first job left one job dir, which tells nothing of what it
    varied: the record of the sweep this launch kept (its multirun.yaml) does."""
    from trainer.sweep import kept_record

    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optim.lr=1e-3", "seed=1"], "interrupted")
    assert other_sweeps_job(sweep / "0", sweep, ["optim.lr=0.01", "seed=2"]) is None
    kept_record(sweep).write_text("hydra:\n  overrides:\n    task:\n"
                                  "    - optim.lr=1e-3,3e-3\n    - seed=1\n")
    assert other_sweeps_job(sweep / "0", sweep, ["optim.lr=0.01", "seed=2"]) == \
        "optim.lr=1e-3 there, 0.01 in this job"  # (seed: not a key the sweep varied)


def test_a_sweep_whose_jobs_run_elsewhere_puts_the_launchs_signal_handlers_back(tmp_path):
    """The process that submits a sweep's jobs (hydra/launcher=slurm, submitit's) and waits
    for them kept train.py's start-up hold: a SIGTERM to it said "stopped on a preemption
    signal before the first step ... the same command starts it again" while its jobs
    trained on, and that command launched the sweep a second time."""
    import subprocess
    import sys
    import textwrap

    from tests.helpers import ROOT

    code = textwrap.dedent(f"""
        import signal
        from omegaconf import OmegaConf
        from trainer import startsignals
        from trainer.sweep import SweepSummary
        for target, held in (("hydra._internal.core_plugins.basic_launcher.BasicLauncher",
                              True),
                             ("hydra_plugins.hydra_submitit_launcher.submitit_launcher."
                              "SlurmLauncher", False)):
            startsignals.hold()
            config = OmegaConf.create({{"hydra": {{"launcher": {{"_target_": target}},
                                                  "sweep": {{"dir": {str(tmp_path)!r}}}}}}})
            SweepSummary().on_multirun_start(config)
            assert (signal.getsignal(signal.SIGTERM) is startsignals._noted) == held, target
            startsignals.put_back()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "ok\n", out.stderr[-2000:]

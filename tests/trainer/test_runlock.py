"""trainer/runlock.py: the run dir's lock: a live run's refuses, a dead run's is taken over,
of runs that start together one takes it, and without hard links too."""
from __future__ import annotations

import json
import os
import re

import pytest

from tests.helpers import dead_pid
from trainer import runlock
from trainer.config import ConfigError
from trainer.runner import train

QUICK = ["trainer.max_steps=4", "trainer.progress_bar=false", "data.num_workers=0"]


def test_a_live_runs_lock_refuses_and_a_dead_runs_lock_is_taken_over(make_cfg, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    me = runlock.owner()
    (run_dir / runlock.LOCK).write_text(json.dumps({**me, "job": "someone-else"}))
    with pytest.raises(ConfigError, match=rf"^run dir {run_dir} is in use by another run \(pid "
                                          rf"{os.getpid()} on "):
        train(make_cfg(*QUICK, run_dir=run_dir))
    assert os.listdir(run_dir) == [runlock.LOCK]  # nothing else written
    (run_dir / runlock.LOCK).write_text(json.dumps({**me, "pid": dead_pid(), "job": None}))
    assert train(make_cfg(*QUICK, run_dir=run_dir))["steps"] == 4
    assert not (run_dir / runlock.LOCK).exists()  # released at the end


def test_a_live_lock_of_the_same_job_refuses_unless_an_earlier_attempt_or_another_host(
        tmp_path, monkeypatch):
    """A second launch with the same SLURM_JOB_ID (or --rdzv-id) took over a live run's lock:
    both trained into one dir, rewriting each other's metrics.jsonl."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    me = runlock.owner()  # (alive: this process)
    assert me["job"] == "SLURM_JOB_ID=4242" and me["attempt"] == 0
    stale = runlock.RunDirLock._stale
    assert not stale(me)  # the same job, this host, the same attempt: a live run
    assert stale({**me, "host": "another-node"})  # a requeue elsewhere: cannot be looked at
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert stale(me)  # an earlier attempt's (a restart)
    assert not stale({**me, "attempt": 1})
    assert stale({**me, "pid": dead_pid()})  # gone: whatever its job
    assert not stale({**me, "job": "SLURM_JOB_ID=7", "host": "another-node"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / runlock.LOCK).write_text(json.dumps({**me, "attempt": 1}))
    with pytest.raises(ConfigError, match=rf"^run dir {run_dir} is in use by another run"):
        runlock.RunDirLock(run_dir).acquire()


def _take_lock(run_dir, barrier, results):
    """One contender: takes the lock at the barrier and holds it until every one has tried."""
    lock = runlock.RunDirLock(run_dir)
    barrier.wait()
    try:
        lock.acquire()
        results.put("held")
    except ConfigError as e:
        results.put(str(e))
    barrier.wait()
    lock.release()


@pytest.mark.parametrize("stale", [False, True])
def test_of_runs_that_start_together_one_takes_the_lock(tmp_path, stale):
    """Four processes take one run dir's lock at the same moment, twenty times over, into an
    empty dir and into one holding a dead run's lock: each time exactly one holds it (a lock
    seen before its owner was written, or a stale one removed twice, let two runs write one
    dir), the others are refused in one line, and nothing is left beside the lock."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    dead = {**runlock.owner(), "pid": dead_pid(), "job": None}
    for attempt in range(20):
        run_dir = tmp_path / str(attempt)
        run_dir.mkdir()
        if stale:
            (run_dir / runlock.LOCK).write_text(json.dumps(dead))
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_take_lock, args=(run_dir, barrier, results))
                 for _ in range(4)]
        for p in procs:
            p.start()
        said = [results.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(timeout=60)
        assert said.count("held") == 1, (attempt, said)
        assert all(s == "held" or "is in use by another run" in s
                   or "another run took its lock first" in s for s in said), said
        assert os.listdir(run_dir) == []  # (released by its holder; no owner files left)


def test_without_hard_links_the_lock_is_still_taken_once(tmp_path, monkeypatch):
    """A file system that refuses hard links (some network and FUSE mounts): the lock is
    created with O_EXCL instead, and a second taker is refused."""
    import errno

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    first, second = runlock.RunDirLock(tmp_path), runlock.RunDirLock(tmp_path)
    first.acquire()
    assert json.loads((tmp_path / runlock.LOCK).read_text())["pid"] == os.getpid()
    second._stale = lambda holder: False  # (the same process: as another live run's)
    with pytest.raises(ConfigError, match="is in use by another run"):
        second.acquire()
    first.release()
    assert os.listdir(tmp_path) == []


def test_a_full_disk_leaves_no_file_of_the_lock_and_names_it(tmp_path, monkeypatch):
    """The owner's file half written on a full disk stayed in the run dir for good, and the
    error was `[Errno 28] No space left on device` with no file named."""
    import errno
    from pathlib import Path

    written = Path.write_text

    def full(self, text, *args, **kwargs):
        written(self, "", *args, **kwargs)  # (created, then the disk is full)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as e:
        runlock.RunDirLock(tmp_path).acquire()
    assert e.value.errno == errno.ENOSPC and str(e.value).startswith(
        "[Errno 28] No space left on device (writing the run dir's lock): "
        f"'{tmp_path / runlock.LOCK}.")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("pid", ["x", None, [1], 1.5, True, 0, -3, 10**20])
def test_an_owner_record_whose_pid_is_no_process_id_names_no_live_owner(make_cfg, tmp_path,
                                                                        pid):
    """A damaged lock raised (ValueError, TypeError, OverflowError from os.kill) in every run
    that met it: the run dir's, and a /dev/shm cache's, which every run on the node reads."""
    import socket

    from data import cache

    assert runlock.owner_alive({"host": socket.gethostname(), "pid": pid}) is False
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / runlock.LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    assert train(make_cfg("trainer.max_steps=2", run_dir=run_dir))["steps"] == 2
    shm = tmp_path / "shm"
    for name, record in (("stoker-bad", {"host": socket.gethostname(), "pid": pid}),
                         ("stoker-list", [pid])):  # (not a record of ours: left alone)
        (shm / name / "train").mkdir(parents=True)
        (shm / name / cache.OWNER).write_text(json.dumps(record))
    assert cache.reclaim_shm(runlock.owner_alive, root=shm) == [shm / "stoker-bad"]
    assert not (shm / "stoker-bad" / "train").exists()  # (its record stays a while)
    assert (shm / "stoker-list" / "train").is_dir()


def test_the_launch_of_a_process_is_its_srun_step_and_its_torchrun_agent():
    """Two launches of one job (two sruns in one allocation, two torchruns in one step, a
    torchrun started again with the same --rdzv-id or none) are told apart: a node cache's
    record of the first is not the second's writer. A torchrun's local ranks share theirs."""
    from trainer import stamp

    assert runlock.launch_id({}) is None
    assert runlock.launch_id({"SLURM_STEP_ID": "3"}) == "SLURM_STEP_ID=3"
    agent = f"agent={os.getppid()}@{stamp.process_ticks(os.getppid())}"  # (this one's parent)
    assert runlock.launch_id({"SLURM_STEP_ID": "3", "TORCHELASTIC_RUN_ID": "none"}) == \
        f"SLURM_STEP_ID=3 {agent}"
    assert runlock.launch_id({"TORCHELASTIC_RUN_ID": "ab"}) == f"TORCHELASTIC_RUN_ID=ab {agent}"
    assert runlock.owner()["launch"] == runlock.launch_id()


@pytest.mark.slow
def test_a_torchruns_local_ranks_share_their_launch(tmp_path):
    """What a node cache's waiting ranks compare with their writer's record: the same on
    every local rank of one torchrun (else they took their own writer for another launch's,
    and waited on for it when it died or failed)."""
    from tests.helpers import ROOT, TORCHRUN, launch

    script = tmp_path / "launch.py"
    script.write_text("import os, sys\nsys.path.insert(0, sys.argv[1])\nfrom trainer import "
                      "runlock\nprint('launch', runlock.launch_id(), flush=True)\n")
    proc = launch([*TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), str(ROOT)],
                  tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = {line for line in proc.stdout.splitlines() if line.startswith("launch ")}
    assert len(ids) == 1 and proc.stdout.count("launch ") == 2, proc.stdout
    assert re.fullmatch(r"launch TORCHELASTIC_RUN_ID=\S+ agent=\d+@\d+", ids.pop())

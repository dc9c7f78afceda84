"""data/cachewait.py: the ranks of a node waiting for their cache's writer, its records,
and the clean-up of writers killed mid-write."""
from __future__ import annotations

import json
import os

import pytest

from data import cachewait
from trainer.config import ConfigError


def test_waiting_ranks_poll_for_the_writer_and_hear_of_its_failure(tmp_path):
    import threading

    done, failed = tmp_path / "done.json", tmp_path / "failed.txt"
    threading.Timer(0.3, done.write_text, args=("{}",)).start()
    cachewait._await(done, failed, "the cache")  # returns once the writer is done
    with pytest.raises(ConfigError, match="the other: local rank 0 failed to write it: boom"):
        cachewait.mark_failed(failed, "boom", None)
        cachewait._await(tmp_path / "never", failed, "the other")


def test_a_failure_line_the_disk_cannot_take_leaves_nothing_and_hides_no_error(
        tmp_path, monkeypatch, caplog):
    """The full disk that failed a cache's write can refuse its one line too: the partial
    file goes, a warning says so, and the write's own error is the one raised (the line's
    OSError took its place, and a failed.txt.<pid>.tmp stayed behind)."""
    from pathlib import Path

    from data import cache

    real = Path.write_text

    def full(self, text, *args, **kwargs):
        real(self, text[:5], *args, **kwargs)
        raise OSError(28, "No space left on device")

    def write_fails(*args):
        raise ValueError("bad sample")

    monkeypatch.setattr(Path, "write_text", full)
    monkeypatch.setattr(cache, "write_arrays", write_fails)
    failed = tmp_path / "failed.txt"
    with pytest.raises(ValueError, match="bad sample"):
        cache._write_marked(None, tmp_path / "train", 0, failed, None)
    assert list(tmp_path.iterdir()) == []
    warned = [r.getMessage() for r in caplog.records if r.name == "stoker"]
    assert warned == [f"could not leave the failed write's line for the waiting ranks in "
                      f"{failed} (No space left on device); they learn of it as this rank "
                      "ends"]


def test_unfinished_folders_of_dead_writers_on_this_host_are_reclaimed(tmp_path):
    import socket
    import subprocess
    import sys

    host = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    dead = tmp_path / f"k.tmp-{host}-{gone}-abcd1234"
    alive = tmp_path / f"k.tmp-{host}-{os.getpid()}-abcd1234"
    elsewhere = tmp_path / "k.tmp-otherhost-1-abcd1234"
    for folder in (dead, alive, elsewhere):
        folder.mkdir()
    # and the writer records of processes gone (killed mid-write), one per process
    # (a host named as this one and more is another: its records are its own)
    records = [tmp_path / cachewait.WRITER.format(key="k", host=h, pid=p)
               for h, p in ((host, gone), (host, os.getpid()), ("otherhost", 1),
                            (f"{host}-{gone}", gone))]
    for record in records:
        record.write_text("{}")
    cachewait._reclaim_tmp(tmp_path, keep_s=60)
    assert not dead.exists() and alive.exists() and elsewhere.exists()
    # a dead writer's record stays `keep_s` after its write, for its ranks on their way to it
    assert [r.exists() for r in records] == [True, True, True, True]
    os.utime(records[0], (records[0].stat().st_mtime - 61,) * 2)
    cachewait._reclaim_tmp(tmp_path, keep_s=60)
    assert [r.exists() for r in records] == [False, True, True, True]
    # a writer's while runs from when its unfinished data was freed, however long it wrote
    dead.mkdir()
    records[0].write_text("{}")
    os.utime(records[0], (records[0].stat().st_mtime - 7200,) * 2)
    cachewait._reclaim_tmp(tmp_path, keep_s=60)
    assert not dead.exists() and records[0].exists()
    cachewait._reclaim_tmp(tmp_path, keep_s=60)  # (touched when its data was freed)
    assert records[0].exists()


def _record(tmp_path, pid, job="TORCHELASTIC_RUN_ID=r1", attempt=0, launch=None):
    path = tmp_path / "owner.json"
    path.write_text(json.dumps({"host": "h", "pid": pid, "job": job, "attempt": attempt,
                                "launch": launch}))
    return path


def test_a_waiting_rank_stops_when_the_writer_of_its_launch_is_gone(tmp_path):
    """Without torchrun's agent (a SLURM launch) nothing else would end a rank that waits for
    a writer that died: it stops in one line, at once for a writer it saw, after the
    collective timeout for one that never began. An earlier launch's record (a writer killed
    mid-write, not yet reclaimed) is not this launch's writer."""
    me = {"job": "TORCHELASTIC_RUN_ID=r1", "attempt": 0}
    done, failed = tmp_path / "done.json", tmp_path / "failed.txt"
    record = _record(tmp_path, 1234)
    assert cachewait._writer_state(record, me, lambda who: True) is True
    with pytest.raises(cachewait.WriterGone, match=r"^the cache: local rank 0, which was writing "
                                               r"it, ended before it finished; its own error"):
        cachewait._await(done, failed, "the cache",
                     lambda: cachewait._writer_state(record, me, lambda who: who["pid"] != 1234))
    for stale in (_record(tmp_path, 1234, attempt=1), _record(tmp_path, 1234, job="other"),
                  _record(tmp_path, 1234, launch="SLURM_STEP_ID=1")):  # (a second srun)
        assert cachewait._writer_state(stale, me, lambda who: False) is None
    with pytest.raises(cachewait.WriterGone, match=r"did not begin writing it within 0.3 s "
                                               r"\(trainer.ddp.timeout_s\)"):
        cachewait._await(done, failed, "the cache",
                     lambda: cachewait._writer_state(tmp_path / "none.json", me, lambda w: True),
                     start_s=0.3)
    import threading

    record = _record(tmp_path, 1234)  # a live writer is waited for, past start_s
    threading.Timer(0.5, done.write_text, args=("{}",)).start()
    cachewait._await(done, failed, "the cache",
                 lambda: cachewait._writer_state(record, me, lambda who: True), start_s=0.1)


def test_a_failed_line_of_another_launch_is_not_its_writers_failure(tmp_path):
    """A line left by another launch's writer (a rerun after a full disk, there before its own
    writer removed the line) does not stop this launch's ranks: they wait for their writer.
    A line is read whole or not at all."""
    me = {"job": "SLURM_JOB_ID=7", "attempt": 0, "launch": "SLURM_STEP_ID=2"}
    done, failed = tmp_path / "done", tmp_path / "failed"
    cachewait.mark_failed(failed, "boom", {**me, "launch": "SLURM_STEP_ID=1"})
    with pytest.raises(cachewait.WriterGone, match="did not begin writing it within 0.3 s"):
        cachewait._await(done, failed, "the cache", start_s=0.3, me=me)
    cachewait.mark_failed(failed, "boom", me)
    with pytest.raises(ConfigError, match="the cache: local rank 0 failed to write it: boom"):
        cachewait._await(done, failed, "the cache", start_s=0.3, me=me)
    assert [p.name for p in tmp_path.iterdir()] == ["failed"]  # (written beside, renamed)
    failed.write_text('{"error": "bo')  # (half a line: none yet)
    with pytest.raises(cachewait.WriterGone, match="did not begin"):
        cachewait._await(done, failed, "the cache", start_s=0.3, me=me)


def test_two_jobs_writing_one_disk_cache_at_once_keep_their_own_writer_records(tmp_path):
    """Each writing process has a record of its own: a second job's writer, starting while
    the first's writes the same cache, replaced the one record of the host, then removed it
    when done, and the first job's ranks stopped, their writer said "never began"."""
    import socket

    me = {"job": "TORCHELASTIC_RUN_ID=a", "attempt": 0}
    state = lambda alive: cachewait._disk_writer_state(tmp_path, "k", me, alive)  # noqa: E731
    assert state(lambda who: True) is None  # no writer yet

    def record(pid, job):
        path = tmp_path / cachewait.WRITER.format(key="k", host=socket.gethostname(), pid=pid)
        path.write_text(json.dumps({"pid": pid, "job": job, "attempt": 0}))
        return path

    ours, theirs = record(11, me["job"]), record(22, "TORCHELASTIC_RUN_ID=b")
    for other in (cachewait.WRITER.format(key="k2", host=socket.gethostname(), pid=33),
                  cachewait.WRITER.format(key="k", host=socket.gethostname() + "-2", pid=33)):
        (tmp_path / other).write_text(  # another cache's writer, another host's
            json.dumps({"pid": 33, "job": me["job"], "attempt": 0}))
    assert state(lambda who: True) is True
    assert state(lambda who: who["pid"] != 11) is False  # ours gone, theirs alive: not ours
    theirs.unlink()  # the other job finished first
    assert state(lambda who: True) is True
    ours.unlink()
    assert state(lambda who: True) is None

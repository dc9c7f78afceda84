"""The lock that keeps two runs out of one run dir, and who holds it (`owner`, also for a
node-shared cache).

The lock is `<run dir>/.stoker.lock`, created by rank 0 (a file of its own, holding the owner's
host, pid, process start time and job id, linked to that name: never seen empty). A lock
whose owner is gone (same host, no such process, or the pid reused by a process started
later) is stale and taken over; so is one left by an earlier attempt of the same job (a
torchrun restart: a lower restart count; a SLURM requeue on another node: same job id,
another host). A live owner of this host and attempt refuses, same job id or not. Every other lock refuses
the run in one line naming the owner.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Dict, Optional

from trainer import distributed, stamp
from trainer.config import ConfigError

LOCK = ".stoker.lock"


def job_id(environ=os.environ) -> Optional[str]:
    """The id every attempt of one job shares (torchrun's run id, SLURM's job id)."""
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        value = environ.get(key)
        if value and value != "none":
            return f"{key}={value}"
    return None


def _start_time(pid: int) -> Optional[float]:
    try:
        return stamp.process_start(pid)
    except (OSError, ValueError, IndexError):
        return None  # gone, or no /proc here


def launch_id(environ=os.environ) -> Optional[str]:
    """Which launch of its job this process belongs to, where the launcher says: the srun
    step (a second srun in one allocation is another), and under torchrun its run id and
    its agent (every local rank's parent, as for the run stamp; a torchrun started again
    with the same --rdzv-id, or none, is another agent)."""
    ids = [f"{key}={environ[key]}" for key in ("SLURM_STEP_ID", "TORCHELASTIC_RUN_ID")
           if environ.get(key) not in (None, "", "none")]
    if "TORCHELASTIC_RUN_ID" in environ:
        agent = os.getppid()
        try:
            ids.append(f"agent={agent}@{stamp.process_ticks(agent)}")
        except (OSError, ValueError, IndexError):  # (no /proc: the run id alone)
            pass
    return " ".join(ids) or None


def owner() -> Dict[str, Any]:
    """Who this process is, for a lock or a node-shared cache: host, pid, start, job id, the
    job's attempt (torchrun's or SLURM's restart count) and its launch."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
            "job": job_id(), "attempt": distributed.attempt(), "launch": launch_id(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def owner_alive(who: Dict[str, Any]) -> bool:
    """False when the process that wrote `who` (see `owner`) is certainly gone. A record of
    this host whose pid is no process id (damaged, or written by hand: "x", null, 1e20) names
    no live owner; it raised before, in every run that looked at it (a /dev/shm cache's)."""
    if who.get("host") != socket.gethostname():
        return True  # cannot look at another host's processes
    pid = who.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # (past the pid type's range: no process)
        return False
    except PermissionError:
        return True
    started = who.get("started")
    if started is None:
        return True
    now = _start_time(pid)
    return now is None and os.path.exists(f"/proc/{pid}") or now == started  # pid reused?


@contextlib.contextmanager
def _one_at_a_time(folder: Path):
    """An exclusive flock on `folder` while the block runs (the processes taking its lock, one
    after another); nothing where the file system has none."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass  # (no flock here: the lock's own steps still hold in most interleavings)
        yield
    finally:
        os.close(fd)  # (releases the flock)


def _json(data: Optional[bytes]) -> Optional[Dict[str, Any]]:
    """A lock's owner from its bytes; None where there are none or they are not an owner's
    (a lock an earlier version of this code left empty when it crashed: stale)."""
    try:
        value = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class RunDirLock:
    """Held by rank 0 for the run's lifetime; `acquire` refuses a dir another live run holds."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK
        self.held = False

    def acquire(self) -> None:
        """Takes the lock, whole: the owner is written to a file of this process's own that
        is then linked to the lock's name (no other process sees a lock without its owner,
        which it would take for a crash's and remove). Runs that take it at once do so one
        after another (an flock on the run dir, held for the few file operations: a stale
        lock judged and replaced by one of them alone). Where the file system has no flock,
        a stale lock is still moved aside before it goes, and put back where what was moved
        is not the lock judged stale (another run took it over in between)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = self.path.with_name(f"{LOCK}.{os.getpid()}.{time.monotonic_ns()}")
        try:
            mine.write_text(json.dumps(owner()))
        except OSError as e:  # a full disk: no file of ours left, and the line names it
            mine.unlink(missing_ok=True)
            raise OSError(e.errno, f"{e.strerror} (writing the run dir's lock)", str(mine)) \
                from None
        try:
            with _one_at_a_time(self.path.parent):
                self._take(mine)
        finally:
            mine.unlink(missing_ok=True)

    def _take(self, mine: Path) -> None:
        """The lock placed, or a live owner's refusal; a stale lock removed once."""
        for _ in range(2):  # a stale lock is removed once, then created anew
            try:
                self._place(mine)
            except FileExistsError:
                seen = self._read_bytes(self.path)
                holder = _json(seen)
                if holder is not None and not self._stale(holder):
                    raise ConfigError(
                        f"run dir {self.path.parent} is in use by another run (pid "
                        f"{holder.get('pid')} on {holder.get('host')} since "
                        f"{holder.get('since')}); choose another {_dir_key()}, or delete "
                        f"{self.path} if that run is gone") from None
                if not self._remove_stale(seen, mine):
                    break
                continue
            self.held = True
            return
        raise ConfigError(f"run dir {self.path.parent}: another run took its lock first")

    def _place(self, mine: Path) -> None:
        """`mine` linked to the lock's name (FileExistsError where a lock is there); on a file
        system without hard links (some network and FUSE mounts), the lock created with
        O_EXCL and written (the way an owner can briefly be missing from it)."""
        try:
            os.link(mine, self.path)
            return
        except FileExistsError:
            raise
        except OSError:
            pass
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(mine.read_bytes())

    def _remove_stale(self, seen: Optional[bytes], mine: Path) -> bool:
        """Removes the lock judged stale from its bytes `seen`; False where what was there by
        then is another run's new lock (put back)."""
        aside = mine.with_name(mine.name + ".stale")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True  # (another run removed it first: try again)
        if self._read_bytes(aside) == seen:
            aside.unlink(missing_ok=True)
            return True
        try:
            self._place(aside)  # another run's: back in place
        except FileExistsError:
            pass
        aside.unlink(missing_ok=True)
        return False

    @staticmethod
    def _read_bytes(path: Path) -> Optional[bytes]:
        try:
            return path.read_bytes()
        except OSError:
            return None

    @staticmethod
    def _stale(holder: Dict[str, Any]) -> bool:
        """Whether `holder`'s lock may be taken over: its owner is gone, or it is an earlier
        attempt of this job (a restart count below this one's), or this job's on another
        host, whose processes cannot be looked at (a requeue elsewhere). A live owner of this
        host and this attempt is another launch of the job (a second torchrun in one
        allocation, a relaunch with the same --rdzv-id): it took over a running run before."""
        if not owner_alive(holder):
            return True
        if holder.get("job") is None or holder.get("job") != job_id():
            return False
        earlier = holder.get("attempt")
        return holder.get("host") != socket.gethostname() or (
            isinstance(earlier, int) and earlier < distributed.attempt())

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                if json.loads(self.path.read_text()).get("pid") == os.getpid():
                    self.path.unlink()
            except (OSError, ValueError):
                pass


def _dir_key() -> str:
    from trainer.rundir import dir_key  # (the run dir's checks import this module)

    return dir_key()

"""A loader worker whose process ended: how (its exit status, whichever of PyTorch's races
reported it: its SIGCHLD handler's words, its own check's, a connection broken mid-batch),
said in one line with the usual cause of that."""
from __future__ import annotations

import errno
import os
import re
import signal
import time
from typing import Any, List, Optional, Sequence, Tuple

try:
    import resource
except ImportError:  # (not on Windows)
    pass


class LoaderWorkerDied(RuntimeError):
    """A loader worker's process ended mid-epoch: killed (the out-of-memory killer), crashed
    in native code, or exited from the dataset's own code."""


_WORKER_ENDED = re.compile(r"DataLoader worker \(pids?(?:\(s\))? ([\d, ]+)\) "
                           r"(is killed by signal: ([^.]*)|exited unexpectedly"
                           r"(?: with exit code (-?\d+))?)")


_LESS_MEMORY = ("fewer data.num_workers, a smaller data.prefetch_factor or data.batch_size "
                "take less memory")
_ENDED = (f"PyTorch does not tell how: the out-of-memory killer, usually ({_LESS_MEMORY}), a "
          "crash in native code the dataset calls, or an exit in its own code (sys.exit, "
          "os._exit); data.num_workers=0 runs it in the training process, where that shows")


def _worker_ended(text: str, holders: Sequence[Any] = ()) -> Optional[LoaderWorkerDied]:
    """PyTorch's words for a worker whose process ended, as one line that says what the
    usual cause is and where to look."""
    m = _WORKER_ENDED.search(text.splitlines()[0] if text else "")
    if m is None:
        return None
    pid, signal_name, code = m.group(1).strip(), m.group(3), m.group(4)
    if signal_name is None and code is None:
        # PyTorch does not always tell how (one race of its own says "exited unexpectedly"
        # for a worker it saw killed): the worker's own exit status says, as its Process
        # object kept it, or unreaped; of several ended at once, the first that tells
        for one in pid.replace(",", " ").split():
            signal_name, code = _exit_status(int(one), holders)
            if signal_name is not None or code is not None:
                pid = one
                break
    return ended(pid, signal_name, code)


def ended(pid: Any, signal_name: Optional[str], code: Optional[str]) -> LoaderWorkerDied:
    """The one line for worker `pid` that ended by `signal_name` (as PyTorch writes it:
    "Killed", "Segmentation fault") or with exit `code`; neither: not known how."""
    if code is not None:
        what = (f"exited with code {code} (sys.exit or os._exit in the dataset's code?); "
                "data.num_workers=0 runs it in the training process, where its traceback shows")
    elif signal_name and signal_name.lower().startswith("bus"):
        what = (f"was killed by signal {signal_name} (shared memory, /dev/shm, ran out, "
                "usually: a larger /dev/shm (docker --shm-size), fewer data.num_workers or a "
                "smaller data.prefetch_factor; or a memory-mapped data file was cut short "
                "while the run read it)")
    elif signal_name and signal_name.lower() != "killed":
        what = (f"was killed by signal {signal_name} (a crash in native code the dataset "
                "calls, a decoder's say); data.num_workers=0 runs it in the training process, "
                "where it shows")
    elif signal_name:
        what = f"was killed (SIGKILL: the out-of-memory killer, usually; {_LESS_MEMORY})"
    else:  # (PyTorch does not always tell how)
        what = f"ended unexpectedly: {_ENDED}"
    return LoaderWorkerDied(f"data: loader worker (pid {pid}) {what}")


def _exit_status(pid: int, holders: Sequence[Any] = ()) -> Tuple[Optional[str], Optional[str]]:
    """(the signal's name, as PyTorch writes it, or None; the exit code, or None) of the
    ended child `pid`: from its Process among the workers of `holders`, else read without
    reaping it (as PyTorch's SIGCHLD handler reads it); both None where it cannot be read."""
    for worker in _workers_of(holders):
        if worker.pid == pid and worker.exitcode not in (None, 0):
            return how(worker.exitcode)
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError, AttributeError):
        return None, None
    if info is None:
        return None, None
    if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
        return how(-info.si_status)
    return how(info.si_status) if info.si_status else (None, None)


def how(exitcode: int) -> Tuple[Optional[str], Optional[str]]:
    """(the signal's name, as PyTorch writes it; None) for a multiprocessing exit code below
    0, (None; the code) for one above it."""
    if exitcode < 0:
        return signal.strsignal(-exitcode) or f"signal {-exitcode}", None
    return None, str(exitcode)


def worker_died(e: BaseException, holders: Sequence[Any] = ()) -> Optional[LoaderWorkerDied]:
    """The one line for PyTorch's error for a loader worker whose process ended, or None
    (`holders`: the DataLoader iterators or loaders whose workers it may be). Its SIGCHLD
    handler raises that error wherever the training thread is (inside the model's forward,
    say), not only where batches are read. Also for the process out of file descriptors,
    which workers' shared batches use up (PyTorch's "Too many open files. Communication with
    the workers is no longer possible", a traceback, or an OSError naming no file)."""
    if out_of_files(e):
        return LoaderWorkerDied(files_line())
    return _worker_ended(str(e), holders) if isinstance(e, RuntimeError) else None


def out_of_files(e: BaseException) -> bool:
    """Whether `e` is the process out of file descriptors (EMFILE)."""
    return (isinstance(e, OSError) and e.errno == errno.EMFILE) or (
        isinstance(e, RuntimeError) and str(e).startswith("Too many open files"))


def files_line() -> str:
    """What to do when the process ran out of file descriptors (its `ulimit -n`)."""
    try:  # (imported with the module: an import needs a file descriptor)
        limit = f" (ulimit -n is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]})"
    except (NameError, OSError, ValueError):
        limit = ""
    return (f"the process ran out of file descriptors{limit}: raise the limit (ulimit -n "
            "65536 in the job's shell), or use fewer loader workers (data.num_workers), which "
            "hand batches over through them")


def iterators_of(holders: Sequence[Any]) -> List[Any]:
    """DataLoader iterators: `holders` themselves, and the ones loaders among them keep (a
    DataLoader's persistent iterator, the run-on loader's)."""
    return [it for holder in holders
            for it in (holder, getattr(holder, "_iterator", None),
                       getattr(holder, "_batches", None)) if it is not None]


def _workers_of(holders: Sequence[Any]) -> List[Any]:
    """The worker processes of DataLoader iterators, or of the ones loaders keep."""
    return [worker for it in iterators_of(holders)
            for worker in (getattr(it, "_workers", None) or ())]


def _ended_worker(*holders: Any, wait_s: float = 1.0) -> Optional[Any]:
    """A loader worker (its multiprocessing Process) of `holders` (DataLoader iterators, or
    loaders keeping one) whose process has ended with an error, waited for up to `wait_s`: a
    worker that dies while it hands a batch over breaks the connection before PyTorch's
    handler tells of it."""
    deadline = time.monotonic() + wait_s
    while True:
        for worker in _workers_of(holders):
            if worker.exitcode not in (None, 0):
                return worker
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)

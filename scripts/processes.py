"""Child processes that end with the script that started them: `run_child` runs one in a
session of its own, passes a Ctrl-C or SIGTERM on to it with a grace to stop, and kills what
is left of its tree (torchrun's ranks, their loader workers); `sigterm_raises` turns a
SIGTERM into Stopped, raised where the script is, as a Ctrl-C raises KeyboardInterrupt.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
# How long a signalled child may take to end before its session is killed: train.py stops at
# its next step. Under 10 s: run_on_gpu.sh's `timeout -k 10` kills a script 10 s after its
# SIGTERM, and a child in a session of its own would outlive a script killed first.
GRACE_S = 8.0


class Stopped(BaseException):
    """A SIGTERM, raised where the script is (as a Ctrl-C raises KeyboardInterrupt) so that
    temporary folders are removed and children ended on the way out. A BaseException: no
    `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.code = signum, 128 + signum


_STOPPED_AT: Optional[float] = None  # when the first SIGTERM came
AGAIN_AFTER_S = 1.0


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within it, a SIGTERM raises Stopped where the process is (the handler before is
    restored on the way out)."""
    global _STOPPED_AT
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    _STOPPED_AT = None
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_stopped(signum, frame) -> None:
    """Raises Stopped, once for one stop: GNU `timeout` (as run_on_gpu.sh uses it) sends
    SIGTERM to the script, then to its process group, microseconds apart; the second would
    cut short the grace the first gives the children. A SIGTERM a second or more later is a
    second request: it raises again (no more waiting)."""
    global _STOPPED_AT
    now = time.monotonic()
    if _STOPPED_AT is not None and now - _STOPPED_AT < AGAIN_AFTER_S:
        return
    _STOPPED_AT = _STOPPED_AT or now
    raise Stopped(signum)


_ERROR_LINE = re.compile(r"^\S+: error: ")  # stoker's own, or a script's argparse line
_TRACEBACK = "Traceback (most recent call last):"
_TORCHRUN = os.path.join("torch", "distributed", "run.py")


def _root_cause(account: List[str]) -> str:
    """torchrun's box for a failed job as one line: the first failure's rank and exit."""
    box = account[next((i for i, ln in enumerate(account) if ln.startswith("Root Cause")),
                       0):]
    said = {}
    for ln in box:
        key, sep, value = ln.strip().partition(":")
        if sep and key.strip() in ("rank", "exitcode") and key.strip() not in said:
            said[key.strip()] = " ".join(value.split())
    if not said:
        return "torchrun: the job failed"
    return ("torchrun: the job failed; first failure: "
            + ", ".join(f"{k} {v}" for k, v in said.items()))


class ChildFailed(RuntimeError):
    """A child process (a train.py run, a script's measurement in a fresh process) that
    failed: `code` its exit status (None: it timed out), `output` what it printed."""

    def __init__(self, what: str, code: Optional[int], output: str = ""):
        self.what, self.code, self.output = what, code, output
        super().__init__(self.line() or self.summary())

    def summary(self) -> str:
        return (f"{self.what} failed (exit {self.code})" if self.code is not None
                else f"{self.what} timed out")

    def line(self) -> Optional[str]:
        """The child's own one-line error (`stoker: error: ...`), if it said one."""
        return next((ln.strip() for ln in self.output.splitlines()
                     if _ERROR_LINE.match(ln.strip())), None)

    def exit_code(self) -> int:
        """The script's exit code: the child's, or 1 when it died of a signal or timed out."""
        return self.code if self.code and self.code > 0 else 1

    def last_lines(self, n: int = 25) -> List[str]:
        """The child's last `n` non-empty lines for a report, torchrun's own account of a
        failed rank (its launcher's traceback and its 25-line box) folded into one line: in
        the last lines as printed, that account left out what the failing rank said."""
        lines = [ln for ln in self.output.splitlines() if ln.strip()]
        start = next((i for i, ln in enumerate(lines) if ln.startswith(_TRACEBACK)
                      and any(_TORCHRUN in later for later in lines[i + 1:i + 6])), None)
        if start is not None:
            lines = lines[:start] + [_root_cause(lines[start:])]
        return lines[-n:]


def _processes() -> Dict[int, Tuple[str, int, int]]:
    """The processes /proc lists: pid -> (state, parent pid, session); {} where it cannot."""
    table = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:  # ended meanwhile
                continue
            state, ppid, _pgrp, session = stat[stat.rindex(")") + 2:].split()[:4]
            table[int(name)] = (state, int(ppid), int(session))
    return table


def _session(sid: int) -> List[int]:
    """The live processes of session `sid` (a child started in a session of its own and all
    it started that stayed in it), read from /proc; [] where there is none."""
    return [pid for pid, (state, _, session) in _processes().items()
            if session == sid and state != "Z"]


def descendants(pid: int) -> List[int]:
    """The processes below `pid` by parent id, from /proc: torchrun (torch >= 2.x) starts each
    rank in a session of its own, outside the child's. Read before killing `pid`, whose
    orphans would be handed to init."""
    parents = {p: ppid for p, (_, ppid, _) in _processes().items()}
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier}
        found += frontier
    return found


def kill_session(sid: int, seen: Sequence[int] = ()) -> None:
    """Kills what is left of the child's session, every process below the child (read first:
    once the child is gone, its orphans' parent is init) and those in `seen` (below it before
    it was signalled), and of its process group where /proc cannot say."""
    below = [*descendants(sid), *seen]
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signal.SIGKILL)
    for pid in below:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for _ in range(20):  # again, for a process forked while the others were being killed
        left = _session(sid)
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _end(proc: subprocess.Popen, sig: int) -> None:
    """Passes `sig` on to the child, lets it end for up to GRACE_S, then kills whatever is
    left of its session (torchrun, its ranks, their loader workers).

    The signal goes to the child alone first: train.py stops at the next step and closes
    its loader workers, torchrun passes it to its ranks. Sent to the whole group at once, a
    rank's loader workers died of the SIGTERM before the rank could stop them, and the rank
    failed on their deaths, leaving their temporary files behind."""
    below = descendants(proc.pid)  # (a child that dies at once orphans them to init)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)
    try:
        proc.wait(timeout=GRACE_S)
    except BaseException:  # the grace ran out, or a second Ctrl-C: no more waiting
        pass
    kill_session(proc.pid, below)
    with contextlib.suppress(BaseException):
        proc.wait(timeout=10)


def _drain(pipe, lines: List[str]) -> None:
    with pipe:
        lines.extend(pipe)


def run_child(cmd: List[str], what: str, timeout: Optional[float] = None,
              cwd: Path = ROOT, env: Optional[Dict[str, str]] = None) -> str:
    """Runs `cmd` to its end in a session (process group) of its own and returns its stdout.

    A Ctrl-C or SIGTERM reaching this process (or the timeout: SIGTERM) is passed to the
    child, whose session gets GRACE_S to end before what is left of it is killed; the
    interruption then goes on (KeyboardInterrupt, Stopped; ChildFailed for the timeout).
    Raises ChildFailed when the child exits non-zero. Nothing of its session outlives the
    call. (Its output is read by threads, so a process it left holding the pipes cannot
    hold the call.)
    """
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out: List[str] = []
    err: List[str] = []
    readers = [threading.Thread(target=_drain, args=(pipe, lines), daemon=True)
               for pipe, lines in ((proc.stdout, out), (proc.stderr, err))]
    try:  # (from the child's start: a signal while the readers start ends it too)
        for reader in readers:
            reader.start()
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _end(proc, signal.SIGTERM)
        raise ChildFailed(f"{what}, given {timeout:g} s,", None) from None
    except KeyboardInterrupt:
        _end(proc, signal.SIGINT)
        raise
    except Stopped as e:
        _end(proc, e.signum)
        raise
    except BaseException:
        _end(proc, signal.SIGTERM)
        raise
    finally:
        kill_session(proc.pid)  # a process the child left behind (none, usually)
        for reader in readers:
            if reader.ident is not None:  # (started)
                reader.join(timeout=10)
    if proc.returncode != 0:
        raise ChildFailed(what, proc.returncode, "".join(err) or "".join(out))
    return "".join(out)

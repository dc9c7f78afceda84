"""Preemption signals before a run's own handler (trainer.preemption) is in place: the imports,
Hydra's composition, the ranks' rendezvous (and, in a sweep that runs its jobs here, the
time between two jobs). A scheduler's SIGTERM (or SIGUSR1, SIGHUP) there ended a rank at -15
without a word; held here, it ends the process as a preemption before the first step: exit
75 and its line, said by the job's first rank.

The main thread may be waiting in C++ then (the rendezvous waits for every rank), where no
Python signal handler runs until the wait ends; so the handler here does nothing, and a thread
acts on the signal's wake-up byte (`signal.set_wakeup_fd`), which Python's C handler writes at
once. Imports only the standard library: train.py holds the signals before importing torch.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any, Dict, FrozenSet, Optional

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)
EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: stopped on request, resume later
BEFORE_FIRST_STEP = ("before the first step: nothing trained, nothing saved; the same command "
                     "starts it again")
LINE = f"stoker: stopped on a preemption signal {BEFORE_FIRST_STEP}\n".encode()

_held: Dict[int, Any] = {}  # each held signal's handler as the launch set it
_wake: Optional[int] = None  # the wake-up pipe's writing end while held
_wake_before = -1  # the wake-up fd that was set before (put back at the release)
_ever = False  # whether this process held them once (train.py's)


def hold() -> None:
    """From now until `release()`, a preemption signal ends the process with exit 75 and the
    line. One the launch ignores (nohup's SIGHUP) stays ignored. Main thread only."""
    global _wake, _wake_before, _ever
    if _wake is not None:
        return
    held = frozenset(sig for sig in SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN)
    read, _wake = os.pipe()
    os.set_blocking(_wake, False)  # (set_wakeup_fd's requirement)
    threading.Thread(target=_watch, args=(read, held), name="stoker-start-signals",
                     daemon=True).start()
    _wake_before = signal.set_wakeup_fd(_wake)  # (first: a signal once a handler below is
    for sig in held:                              # set has its byte)
        was = signal.getsignal(sig)
        _held[sig] = signal.SIG_DFL if was is None else was
        signal.signal(sig, _noted)
    _ever = True


def held_once() -> bool:
    """Whether this process held the signals at some time (a launch through train.py)."""
    return _ever


def _noted(signum: int, frame: Any) -> None:
    """The Python handler while held: the watching thread acts (it has, or will have, the
    signal's byte)."""


def _watch(read: int, held: FrozenSet[int]) -> None:
    """Ends the process on a held signal's wake-up byte; returns at release's 0 byte (a
    byte before it, of a signal that came while held, still ends it)."""
    try:
        while True:
            got = os.read(read, 64)
            for sig in got:
                if sig == 0:
                    return
                if sig in held:
                    first = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
                    if first:
                        os.write(2, LINE)
                    os._exit(EXIT_PREEMPTED)
            if not got:
                return
    finally:
        os.close(read)


def release() -> Dict[int, Any]:
    """Stops holding (the caller has its own handlers in place: a signal until now still ends
    the process as before the first step, which is true). Returns the held signals' handlers
    as the launch set them, for the caller to put back at its end; {} where none were held."""
    global _wake
    if _wake is None:
        return {}
    signal.set_wakeup_fd(_wake_before)
    os.write(_wake, b"\0")  # (the thread closes its end: a fd closed under a read is reused)
    os.close(_wake)
    _wake = None
    held = dict(_held)
    _held.clear()
    return held


def put_back() -> None:
    """Stops holding and sets the launch's handlers again (no run of this process will take
    over: a sweep whose jobs run elsewhere, or that has ended)."""
    for sig, handler in release().items():
        signal.signal(sig, handler)

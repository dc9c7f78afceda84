"""Preemption signals and Ctrl-C: a flag every rank agrees on at step boundaries and epoch
ends, so that all of them stop at the same step, with a checkpoint; a second signal stops at
once."""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from trainer import distributed, startsignals
from trainer.cli import EXIT_INTERRUPTED, SignalledAgain, complete
from trainer.distributed import DistEnv


EXIT_PREEMPTED = startsignals.EXIT_PREEMPTED
# SLURM sends SIGUSR1 before a time limit; a closed terminal or a dropped ssh session SIGHUP
# (torchrun's agent passes it to the ranks)
PREEMPT_SIGNALS = startsignals.SIGNALS
AGAIN_AFTER_S = 1.0  # a second Ctrl-C later than this stops at once (torchrun's forwarded
# copy of the first one follows it within milliseconds)


class Preempted(Exception):
    """Raised at an optimizer-step boundary after a preemption signal or a Ctrl-C; a
    checkpoint is saved. `code`: the exit code (75, or 130 for a Ctrl-C)."""

    def __init__(self, message: str, code: int = EXIT_PREEMPTED):
        super().__init__(message)
        self.code = code


class Preemption:
    """Turns SIGTERM/SIGUSR1/SIGHUP and a Ctrl-C (SIGINT) into a flag that all ranks agree on
    at step boundaries and epoch ends. A second Ctrl-C (after AGAIN_AFTER_S) raises
    KeyboardInterrupt at once.

    The ranks may see the signal at different steps, so they compare flags with one tiny
    all-reduce per optimizer step on a CPU (gloo) group, which never syncs the GPU stream.
    The all-reduce is asynchronous and read one step later: a blocking one made every step
    wait for the slowest rank's host thread and for a network round trip. Every rank reads the
    same result at the same step, within two steps of the signal (a signal in a run's last
    two steps finds the run ending anyway, with its final checkpoint).
    """

    def __init__(self, env: DistEnv, saving: bool = True):
        self.requested = False
        self._saving = saving  # checkpoints are on: what the first Ctrl-C's line promises
        self.kind = 0  # what was agreed: 1 a preemption signal, 2 a Ctrl-C (any rank's)
        self._mine = 0  # ... and what this rank received
        self._interrupted_at: Optional[float] = None
        self._signalled_at: Optional[float] = None  # the first SIGTERM/SIGUSR1
        self._stopping = False  # agreed at a step boundary: saving, then stopping
        self._training = False  # the run is built, its steps begin: a stop saves a checkpoint
        self.writing = False  # a checkpoint is being saved or waited for: its step ended
        self._main, self._pid = env.is_main, os.getpid()
        self._previous = {}
        self._group = None
        self._pending = None  # (flag tensor, async work) of the last step's all-reduce
        if env.world_size > 1 and distributed.is_active():
            self._group = distributed.cpu_group()

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is not threading.main_thread():
            return self  # Python delivers signals to the main thread only
        for sig in (*PREEMPT_SIGNALS, signal.SIGINT):
            if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
                continue  # started with nohup: a closed terminal is to change nothing
            self._previous[sig] = signal.signal(sig, self._handle)
        # (train.py's start-up handler held them until now: what the launch set goes back)
        self._previous.update(startsignals.release())
        return self

    def __exit__(self, exc_type, exc, *rest) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if isinstance(exc, Preempted):  # stopped with its checkpoint: a signal more in the
            complete(exc.code)  # process's last second is no kill (cli.complete)
        if self._pending is not None and (exc_type is None or issubclass(exc_type, Preempted)):
            # a coordinated end: every rank issued it, so it completes; leave nothing open
            # (after an error a peer may be gone: then it is dropped, not waited for)
            self._pending[1].wait()
        self._pending = None

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked loader worker inherited this handler: the
            return  # training process decides (and the worker stays to serve it until then)
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._interrupted_at is not None and now - self._interrupted_at > AGAIN_AFTER_S:
                raise KeyboardInterrupt
            if self._interrupted_at is None and self._main:  # (no logging in a handler)
                os.write(2, b"stoker: stopping once the run is built, before its first step, "
                            b"with nothing to save (Ctrl-C again to stop at once)\n"
                         if not self._training else
                         b"stoker: stopping at the end of this step with a checkpoint "
                         b"(Ctrl-C again to stop at once, without one)\n" if self._saving
                         else b"stoker: stopping at the end of this step (Ctrl-C again to "
                              b"stop at once)\n")
            self._interrupted_at = self._interrupted_at or now
        elif self._stopping:
            return  # the step ended: the checkpoint is being written, let it finish
        elif self._signalled_at is not None \
                and time.monotonic() - self._signalled_at > AGAIN_AFTER_S:
            if self.writing:  # (a periodic or the final save: the stop comes after it; a
                return  # stop at once lost the write, and said the step never ended)
            raise SignalledAgain(signum)  # the first is still waiting for its step to end
        else:
            self._signalled_at = self._signalled_at or time.monotonic()
        self._mine = max(self._mine, 2 if signum == signal.SIGINT else 1)
        self.requested = True

    def stop_before_training(self) -> None:
        """Raises Preempted on every rank where any rank was signalled while the run was
        built (a dataset, a model or a cache that took minutes): nothing is trained and
        nothing saved. It trained a step and saved it, past a scheduler's grace period.
        (One blocking all-reduce in multi-rank jobs, once.)"""
        kind = self._reduced_now()
        if kind:
            self.kind, self._stopping = kind, True
            raise Preempted(f"stopped on {'a Ctrl-C' if kind == 2 else 'a preemption signal'} "
                            f"{startsignals.BEFORE_FIRST_STEP}",
                            EXIT_INTERRUPTED if kind == 2 else EXIT_PREEMPTED)
        self._training = True

    def _reduced_now(self) -> int:
        """The kind of stop any rank received, agreed at once (a blocking all-reduce in
        multi-rank jobs; this rank's own in one process)."""
        if self._group is None:
            return self._mine
        flag = torch.tensor([self._mine], dtype=torch.int32)
        with distributed.waiting():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return int(flag.item())

    def agreed(self, now: bool = False) -> bool:
        """True on every rank once any rank was signalled (collective in multi-rank jobs: an
        all-reduce read a step later, or, `now`, at once: at an epoch's end, after a
        validation a signal may have come in)."""
        if self._group is None:
            self.kind = self._mine
            self._stopping = self.requested
            return self.requested
        if now:
            previous, self._pending = self._pending, None
            if previous is not None:  # (every rank issued it: it completes)
                with distributed.waiting():
                    previous[1].wait()
            self.kind = self._reduced_now()
            self._stopping = self.kind > 0
            return self.kind > 0
        previous = self._pending
        flag = torch.tensor([self._mine], dtype=torch.int32)
        self._pending = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group,
                                               async_op=True))
        if previous is None:
            return False
        distributed.WAITING[0] += 1  # (inline: once a step)
        try:
            previous[1].wait()  # issued a step ago: done by now unless a rank lags behind
        finally:
            distributed.WAITING[0] -= 1
        self.kind = int(previous[0].item())
        self._stopping = self.kind > 0
        return self.kind > 0

"""Liveness: a job whose rank stops making progress ends within minutes, naming the rank.

Every collective has the process group's timeout (`trainer.ddp.timeout_s`, 300 s by default;
on GPUs that is the host-side gloo group's, and NCCL's is 60 s longer), so the ranks left
waiting for a stopped, stuck or vanished peer fail instead of waiting for ever. To say *which* rank stopped, every rank runs a heartbeat thread that writes its progress
(step, phase, time) to the job's store every few seconds; the thread keeps beating while its
own main thread waits in a collective, and stops beating when the process is stopped or gone.
When a collective times out, the waiting rank reads the beats and names the rank whose
progress is oldest. Long phases are not mistaken for hangs: validation and checkpoint writes
are phases of their own, and the barrier that waits for a checkpoint write has its own,
longer timeout (`trainer.checkpoint.timeout_s`).
"""
from __future__ import annotations

import datetime
import json
import re
import threading
import time
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from data.loader import LoaderStalled
from trainer import distributed
from trainer.config import first_line
from trainer.distributed import DistEnv

BEAT_S = 5.0  # seconds between heartbeats
_TIMEOUT = re.compile(r"timed? ?out|timeout|deadline", re.IGNORECASE)
# ... and a backend's own words for it (not a timeout some code of one's own raised)
_BACKEND_TIMEOUT = re.compile(r"(gloo|nccl|c10d|ProcessGroup|Watchdog)[^\n]*(timed? ?out|"
                              r"timeout)|(timed? ?out|timeout)[^\n]*(gloo|nccl|c10d|"
                              r"ProcessGroup|Watchdog)", re.IGNORECASE)
# a peer whose process ended: gloo's and NCCL's words for it
_CLOSED = re.compile(r"connection (closed|reset)|broken pipe|remote process exited|"
                     r"communicator was aborted", re.IGNORECASE)


class PeerLost(RuntimeError):
    """A collective timed out waiting for a rank that stopped making progress."""


class Heartbeat:
    """Publishes this rank's progress (`progress()` -> (step, phase)) to the job's store."""

    def __init__(self, rank: int, world_size: int, progress):
        self.rank, self.world_size, self.progress = rank, world_size, progress
        self.store = _store() if world_size > 1 else None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        # when (step, phase) last changed: the thread beats on while its main thread is
        # stuck, so the beat's own time says the process lives, this says it progresses
        self._seen, self._since = None, time.time()

    def __enter__(self) -> "Heartbeat":
        if self.store is not None:
            self.beat()
            self._thread = threading.Thread(target=self._run, name="stoker-heartbeat",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * BEAT_S)

    def _run(self) -> None:
        while not self._stop.wait(BEAT_S):
            try:
                self.beat()
            except Exception:  # the store went away: the job is ending anyway
                return

    def beat(self) -> None:
        step, phase = self.progress()
        now = time.time()
        if (step, phase) != self._seen:
            self._seen, self._since = (step, phase), now
        self.store.set(f"stoker/beat/{self.rank}", json.dumps(
            {"step": step, "phase": phase, "time": now, "since": self._since,
             "waiting": distributed.WAITING[0] > 0}))

    def beats(self) -> Dict[int, dict]:
        """Every rank's last heartbeat that the store holds."""
        out = {}
        for r in range(self.world_size):
            try:
                if self.store.check([f"stoker/beat/{r}"]):
                    out[r] = json.loads(self.store.get(f"stoker/beat/{r}"))
            except Exception:
                continue
        return out

    def explain(self, error: BaseException, timeout_s: float) -> Optional[PeerLost]:
        """A one-line PeerLost for a collective that timed out, naming the rank whose
        progress is oldest, or for one whose peer closed its connection (its process ended),
        naming the rank whose heartbeat stopped; None for any other error."""
        if self.store is None or isinstance(error, LoaderStalled):
            return None
        step, phase = self.progress()  # this rank's own, now (its last beat may be older)
        where = f"in a collective at step {step} ({phase})"
        key = "trainer.ddp.timeout_s"
        if isinstance(error, WriteWaitTimedOut):  # (which of the two timeouts ran out)
            key, timeout_s = error.key, error.seconds
            where = (f"for its peers after writing a checkpoint at step {step}" if error.writer
                     else f"for rank 0's checkpoint write at step {step}")
        try:
            if _TIMEOUT.search(str(error)):
                return PeerLost(f"rank {self.rank} waited more than {key}={timeout_s:g} s "
                                f"{where}: {self._slowest()}; stopped, stuck or gone")
            if _CLOSED.search(str(error)) or isinstance(error, LeftTheBarrier):
                return PeerLost(f"rank {self.rank} lost a peer {where}: {self._gone()}")
        except Exception:  # noqa: BLE001  (the store went with the job: say what is known)
            return None
        return None

    def _slowest(self) -> str:
        """The peer whose progress is oldest (a stuck one still beats: its step and phase
        stay the same)."""
        now, beats = time.time(), self.beats()
        peers = {r: b for r, b in beats.items() if r != self.rank}
        missing = [r for r in range(self.world_size) if r != self.rank and r not in beats]
        if missing:
            return f"rank {missing[0]} never reported progress"
        if not peers:
            return "the other ranks stopped"
        silent = {r: b for r, b in peers.items() if now - b["time"] > 2 * BEAT_S}
        if silent:  # stopped (SIGSTOP) or cut off: its own thread beats no more either
            r, b = min(silent.items(), key=lambda kv: kv[1]["time"])
            return (f"rank {r} stopped beating {now - b['time']:.0f} s ago (its process is "
                    f"stopped, cut off, or stuck where its threads cannot run; its last "
                    f"heartbeat, up to {BEAT_S:g} s before that, said step {b['step']}, "
                    f"{b['phase']})")
        # the oldest step; at the same one, a rank in its own code (a dataset read that never
        # returns) before those waiting in a collective for it, whose (step, phase) is the
        # same: the time each beat saw it change told them apart by chance
        r, b = min(peers.items(), key=lambda kv: (kv[1]["step"], kv[1].get("waiting") is True,
                                                  kv[1]["since"]))
        # (a change is seen at the next beat: the time since is a lower bound)
        return (f"rank {r} made no progress for at least {now - b['since']:.0f} s (last "
                f"heartbeat: step {b['step']}, {b['phase']}"
                + (", not waiting in a collective" if b.get("waiting") is False else "") + ")")

    def _gone(self) -> str:
        """The peers whose heartbeat stopped: read, then read again a beat later."""
        first = self.beats()
        time.sleep(BEAT_S + 1.0)
        then = self.beats()
        gone = [r for r in range(self.world_size) if r != self.rank
                and (r not in then or then[r]["time"] == first.get(r, {}).get("time"))]
        # the first to end first (the oldest last beat): a rank that ended after it, on
        # its report of that loss, was named as the one lost
        gone.sort(key=lambda r: then.get(r, first.get(r, {})).get("time", 0.0))
        errors = peer_errors(self.rank, self.world_size)
        if not gone:
            return first_said(errors) or ("a peer's process ended (which one, its heartbeat does "
                                     "not tell); its own error, if it had one, is in its output")
        line = errors.get(gone[0])
        return (f"rank {gone[0]}'s process ended"
                + (f", and that of ranks {gone[1:]}" if len(gone) > 1 else "")
                + (f", on its error: {line}" if line else
                   "; its own error, if it had one, is in its output"))


ERROR_KEY = "stoker/error/{}"  # a rank's one-line error, in the job's store


OWN_WAIT_S = 5.0  # how long a rank's own error waits for rank 0's before it says it itself


def record_error(rank: int, line: str) -> None:
    """Leaves this rank's one-line error in the job's store, for the peer that reports losing
    it: of a job's ranks only rank 0 says its line on the console (they mostly meet the same
    one), so an error of another rank's own (its dataset, its data) would be said nowhere."""
    store = _store()
    if store is None:
        return
    try:
        store.set(ERROR_KEY.format(rank), line)
    except Exception:  # noqa: BLE001  (the store went with the job: the line is lost)
        pass


SAID_KEY = "said/{}"  # (under the attempt's prefix) set once that rank said its error line
_SAID_STORE: List[Any] = []  # the client of the agent's store, once made (None: unreachable)


def _said_store() -> Any:
    """A client of torchrun's agent store, under this attempt's prefix: it outlives the process
    group, and exists before it (an error met before the ranks join)."""
    if not _SAID_STORE:
        try:
            _SAID_STORE.append(distributed.attempt_store(datetime.timedelta(seconds=5)))
        except Exception:  # noqa: BLE001  (the agent is gone: nothing to tell or ask)
            _SAID_STORE.append(None)
    return _SAID_STORE[0]


def mark_said(env: DistEnv) -> None:
    """Tells the job's other ranks that this rank has said its one-line error (rank0_said)."""
    if env.world_size > 1 and distributed.agent_store(env):
        store = _said_store()
        try:
            if store is not None:
                store.set(SAID_KEY.format(env.rank), "1")
        except Exception:  # noqa: BLE001  (the agent is gone)
            pass


def rank0_said(env: DistEnv, wait_s: float) -> bool:
    """Whether rank 0 says its one-line error (mark_said) within `wait_s`: under torchrun,
    whose agent ends every rank as soon as one exits with an error, a rank whose error ended
    it first had rank 0 ended before its line (of the same error: only rank 0 says it), so the
    other ranks wait for it, and say their own where it never comes. True where no agent
    store ends rank 0 early (one process, SLURM: rank 0 says its line)."""
    if env.world_size <= 1 or not distributed.agent_store(env):
        return True
    store = _said_store()
    until = time.monotonic() + wait_s
    while store is not None:
        try:
            if store.check([SAID_KEY.format(0)]):
                return True
        except Exception:  # noqa: BLE001  (the store is gone)
            return False
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return False


def unmet_by_rank_0(rank: int) -> bool:
    """Whether this rank must say its recorded error itself: under torchrun, a rank other
    than 0 whose error rank 0 did not say (rank0_said, within OWN_WAIT_S). Rank 0, waiting
    in a collective for this rank, may learn of the error only when this process ends, and
    torchrun's agent ends every rank as soon as one exits with an error: rank 0 was at times
    ended before it said it (no line at all), also where it met the same error (rank 0 now
    says it before leaving the group: runner.train)."""
    return rank != 0 and not rank0_said(distributed.detect(), OWN_WAIT_S)


def peer_errors(rank: int, world_size: int) -> Dict[int, str]:
    """The one-line errors the other ranks left in the store (`record_error`). Where the store
    lives in rank 0's process (a SLURM launch: not torchrun's agent), the other ranks do not
    ask it: rank 0 may be the one gone, and a client of a store that is gone prints pages of
    C++ warnings before it fails."""
    store, found = _store(), {}
    if store is None or (rank != 0 and not distributed.agent_store(distributed.detect())):
        return found
    for r in range(world_size):
        key = ERROR_KEY.format(r)
        try:
            if r != rank and store.check([key]):
                found[r] = store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001
            continue
    return found


def first_said(errors: Dict[int, str]) -> str:
    """The first peer error as "rank N stopped on its error: ...", or ""."""
    if not errors:
        return ""
    r = min(errors)
    return f"rank {r} stopped on its error: {errors[r]}"


def lost_at(error: BaseException, rank: int, world_size: int, step: Optional[int],
            timeout_s: float) -> Optional[PeerLost]:
    """A one-line PeerLost for a collective outside the training loop (building the run,
    restoring it) whose peer closed its connection, naming the peer's own error where it left
    one, or that timed out (`timeout_s`: trainer.ddp.timeout_s; before, gloo's traceback),
    at optimizer step `step` (None: before the first step); None for any other error (and for
    one said already)."""
    if world_size <= 1 or isinstance(error, (PeerLost, LoaderStalled, WriteWaitTimedOut,
                                             LeftTheBarrier)) or \
            not isinstance(error, RuntimeError):
        return None  # (a checkpoint write's wait says its own key and time)
    where = "before the first step" if step is None else f"at step {step}"
    if _BACKEND_TIMEOUT.search(str(error)):  # (the heartbeat starts with the training loop)
        return PeerLost(
            f"rank {rank} waited more than trainer.ddp.timeout_s={timeout_s:g} s in a "
            f"collective {where}: another rank did not reach it " + (
                "(stuck, or slow to build its data, model or cache; raise "
                "trainer.ddp.timeout_s where that takes longer)" if step is None
                else "(stopped, stuck or gone)"))
    if not _CLOSED.search(str(error)):
        return None
    said = first_said(peer_errors(rank, world_size))
    return PeerLost(f"rank {rank} lost a peer {where}: " + (
        said or "a peer's process ended; its own error, if it had one, is in its output"))


def from_a_lost_peer(error: BaseException) -> bool:
    """Whether `error` is this rank's loss of a peer (said, or a backend's closed connection),
    not an error of its own."""
    return isinstance(error, (PeerLost, LeftTheBarrier)) or (
        isinstance(error, RuntimeError) and _CLOSED.search(str(error)) is not None)


def _store():
    """The default process group's store (shared by all ranks of the job)."""
    if not distributed.is_active():
        return None
    return dist.distributed_c10d._get_default_store()


class LeftTheBarrier(RuntimeError):
    """The checkpoint write's barrier failed before its time ran out: a peer's process ended
    (gloo words it as the ranks that "failed to pass" it, in the timeout's words)."""


class WriteWaitTimedOut(RuntimeError):
    """The checkpoint write's barrier timed out: `key` names the timeout that ran out."""

    def __init__(self, key: str, seconds: float, text: str, writer: bool):
        super().__init__(f"timed out after {key}={seconds:g} s: {text}")
        self.key, self.seconds, self.writer = key, seconds, writer


def writer_barrier(write_s: float, arrive_s: float) -> None:
    """Where the ranks wait for rank 0's checkpoint write (a barrier on a CPU group that names
    the ranks that did not arrive: it needs gloo). The others wait as long as a write may take
    (`write_s`, trainer.checkpoint.timeout_s); rank 0 arrives last, its write done, and waits
    only as long as a collective (`arrive_s`, trainer.ddp.timeout_s) for peers that are there
    already, so one stopped meanwhile is named then, not after a write's timeout."""
    if not distributed.is_active():
        return
    import datetime

    writer = dist.get_rank() == 0
    timeout = arrive_s if writer else write_s
    start = time.monotonic()
    try:
        with distributed.waiting():
            dist.monitored_barrier(group=distributed.write_group(),
                                   timeout=datetime.timedelta(seconds=timeout),
                                   wait_all_ranks=True)
    except RuntimeError as e:
        # gloo words every failure of it so, a peer's closed connection too: only one that
        # waited its time out is a timeout (the rest explain() names as a lost peer)
        if _CLOSED.search(str(e)):
            raise
        if time.monotonic() - start < 0.9 * timeout:  # its time did not run out: a peer left
            raise LeftTheBarrier(f"a peer left the checkpoint write's barrier (gloo: "
                                 f"{first_line(e)})") from None
        raise WriteWaitTimedOut("trainer.ddp.timeout_s" if writer
                                else "trainer.checkpoint.timeout_s", timeout, str(e),
                                writer) from None

"""data/handover.py: the watch on loader reads that ends a stalled handover and says a
worker's death whose word was lost."""
from __future__ import annotations

import os
import sys
import time

import torch

import pytest


def test_a_worker_stopped_with_its_batch_queued_is_a_stall_not_a_hang():
    """A worker stopped (SIGSTOP) after it queued its batches: the training thread took the
    batch's message and asked the worker's sharing thread for its memory, which waits for ever
    (data.timeout bounds only the wait for the message): the run hung, silent. The handover
    watch kills the workers past the timeout, and the read fails in the stall's one line."""
    import os
    import signal

    from data.loader import LoaderStalled, readable

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(64.0)),
                                         batch_size=2, num_workers=2, timeout=1,
                                         prefetch_factor=2)
    batches = iter(loader)
    workers = list(batches._workers)
    said = readable(batches, workers=True, owner=loader)
    next(said)
    queued = time.monotonic() + 30
    while batches._data_queue.qsize() < 1 and time.monotonic() < queued:  # a batch to take
        time.sleep(0.05)
    for worker in workers:
        os.kill(worker.pid, signal.SIGSTOP)

    def gave_up(signum, frame):
        raise TimeoutError("the read still waits on the stopped worker")

    previous = signal.signal(signal.SIGALRM, gave_up)
    signal.alarm(60)  # (without the watch: for ever)
    try:
        # (or, where the batches queued were all taken first, the wait for the next one)
        with pytest.raises(LoaderStalled, match=r"^data: (a loader worker did not hand over "
                                                r"its batch within 1 s|DataLoader timed out "
                                                r"after 1 seconds) \(data.timeout\)"):
            for _ in range(32):
                next(said)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        for worker in workers:
            if worker.is_alive():
                worker.kill()
    for worker in workers:
        worker.join(timeout=5)
    assert not any(w.is_alive() for w in workers)
    said.close()
    batches._shutdown_workers()


def _as_list(samples):
    return list(samples)


def _killed_with_its_sigchld_lost(pid: int, said: bool) -> None:
    """Kills loader worker `pid` (SIGKILL, as the out-of-memory killer does), its SIGCHLD lost:
    `said`, PyTorch's handler raises and its error is dropped (as in an at-fork hook, where it
    is printed as ignored; PyTorch forgets the loader's workers then, so a signal again finds
    none ended), else the handler does not run."""
    import signal

    lost = []
    pytorchs = signal.getsignal(signal.SIGCHLD)

    def dropped(signum, frame):
        if said:
            with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {pid}\) is killed"):
                pytorchs(signum, frame)
        lost.append(True)

    signal.signal(signal.SIGCHLD, dropped)
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost, "no SIGCHLD came in 60 s"
    finally:
        signal.signal(signal.SIGCHLD, pytorchs)


@pytest.mark.parametrize("said", [False, True], ids=["not run", "error dropped"])
@pytest.mark.parametrize("where", ["a read", "a persistent loader's next pass"])
def test_a_worker_death_whose_signal_was_lost_is_said_at_once_not_after_data_timeout(where,
                                                                                     said):
    """PyTorch says a worker died by raising from its SIGCHLD handler in the training thread;
    where the signal comes while that thread runs an at-fork hook (another loader starting its
    workers), Python prints the error as ignored, and the read waited data.timeout (300 s by
    default) before it looked at the workers: CI saw the run hang. The handover watch sees a
    worker of the loader being read (or started: persistent workers wait there) ended and
    delivers the signal again."""
    import signal

    from data.loader import LoaderWorkerDied, readable, started

    persistent = where != "a read"
    # (batches of plain numbers, sent whole: a batch in shared memory, queued before the death,
    # is handed over by the worker itself, and that fails at once)
    loader = torch.utils.data.DataLoader(list(range(16)), batch_size=1, num_workers=1,
                                         timeout=600, prefetch_factor=4, collate_fn=_as_list,
                                         persistent_workers=persistent)
    batches = iter(loader)  # (PyTorch's SIGCHLD handler is set up by the first one)
    if persistent:
        assert len(list(batches)) == 16
        batches = loader._iterator
    else:
        next(batches)
    pid = batches._workers[0].pid
    _killed_with_its_sigchld_lost(pid, said)  # (after its prefetched batches, or between passes)

    gave_up = []

    def give_up(signum, frame):  # (PyTorch takes any error in the wait for a look at the
        gave_up.append(True)     # workers, so the death is said then: the flag tells)
        raise TimeoutError("the read still waits for the dead worker's batch")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(30)  # (without the watch: data.timeout, 600 s)
    try:
        if persistent:
            with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {pid}\) "
                                                   "exited unexpectedly"):
                started(loader, workers=True)
        else:
            said = readable(batches, workers=True, owner=loader)
            with pytest.raises(LoaderWorkerDied, match=rf"^data: loader worker \(pid {pid}\) "
                                                       r"was killed \(SIGKILL"):
                for _ in range(16):
                    next(said)
            said.close()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        batches._shutdown_workers()
    assert not gave_up, f"{where} waited 30 s for the dead worker"


class _OneWorkerRunsOut(torch.utils.data.IterableDataset):
    """Worker 0 yields once and its process exits 0 (unreaped while the pass goes on); worker
    1 yields slowly."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info.id == 0:
            yield torch.tensor(0.0)
            return
        for i in range(4):
            time.sleep(1.0)
            yield torch.tensor(float(i))


def test_a_worker_that_ran_out_and_exited_is_not_taken_for_a_death_whose_signal_was_lost():
    """A worker of an IterableDataset that ran out exits 0 while the others go on (every pass
    of a shard loader): PyTorch's handler counts no failure there, and the watch sent no
    signal either (a SIGCHLD handler of the program's own, that PyTorch's calls on, was
    called once more)."""
    import signal

    from data.loader import readable

    from torch.utils.data._utils import signal_handling

    calls = []
    pytorchs = signal.getsignal(signal.SIGCHLD)
    # PyTorch's handler set up anew, over the program's own, which it calls on
    was_set, signal_handling._SIGCHLD_handler_set = signal_handling._SIGCHLD_handler_set, False
    signal.signal(signal.SIGCHLD, lambda *_: calls.append(time.monotonic()))
    try:
        loader = torch.utils.data.DataLoader(_OneWorkerRunsOut(), batch_size=None,
                                             num_workers=2, timeout=600)
        got = list(readable(iter(loader), workers=True, owner=loader))
    finally:
        signal_handling._SIGCHLD_handler_set = was_set
        signal.signal(signal.SIGCHLD, pytorchs)
    assert len(got) == 5
    # the worker that ran out ended (one call), the other at the pass's end (one more)
    assert len(calls) <= 2, calls


# a worker of the loader being read is killed as another loader forks its workers: PyTorch's
# SIGCHLD handler raises inside the at-fork hook (logging's lock, in a run), where Python can
# only print its error, and PyTorch forgets the loader's workers
DEATH_AT_FORK = """
import os, signal, sys, time
import torch
from torch.utils.data import DataLoader
if sys.argv[1] == "stoker":
    from data.loader import readable
else:
    def readable(batches, **_):
        return batches
def as_list(samples):
    return list(samples)
first = DataLoader(list(range(16)), batch_size=1, num_workers=1, prefetch_factor=2,
                   timeout=float(sys.argv[2]), collate_fn=as_list)
batches = iter(first)
pid = batches._workers[0].pid
said = readable(batches, workers=True, owner=first)
next(said)
def killed_as_one_forks():
    if not killed:
        killed.append(pid)
        os.kill(pid, signal.SIGKILL)
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            time.sleep(0.01)
        time.sleep(0.5)  # (PyTorch's handler raises in here)
killed = []
os.register_at_fork(before=killed_as_one_forks)
print(len(list(DataLoader(list(range(4)), batch_size=2, num_workers=1, collate_fn=as_list))))
try:
    for _ in range(16):
        next(said)
except RuntimeError as e:
    print(str(e).split(" (SIGKILL")[0].replace(str(pid), "N"))
"""


@pytest.mark.parametrize("imported", ["stoker", "torch alone"])
def test_a_worker_death_said_in_an_at_fork_hook_is_one_line_at_once(imported):
    """CI saw a run hang: its loader worker was killed as the training process forked, PyTorch's
    error for it was printed as ignored (a traceback), and the read waited data.timeout (300 s)
    for the dead worker's batch. The watch says the death in one line at once, with nothing
    printed before it; torch alone shows the case is real (5 s, its timeout, then its words)."""
    import subprocess

    from tests.helpers import ROOT

    timeout = "600" if imported == "stoker" else "5"  # (stoker: told long before 600 s)
    proc = subprocess.run([sys.executable, "-c", DEATH_AT_FORK, imported, timeout], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout == {"stoker": "2\ndata: loader worker (pid N) was killed\n",
                           "torch alone": "2\nDataLoader worker (pid(s) N) exited "
                                          "unexpectedly\n"}[imported], proc.stderr[-2000:]
    assert ("Exception ignored" in proc.stderr) == (imported != "stoker"), proc.stderr[-2000:]

from __future__ import annotations

import re
import os
import time

import torch
from torch.utils.data import TensorDataset

import pytest

from data.loader import EvalShardSampler, build_loader
from trainer.config import ConfigError, DataConfig


def cfg(**kw) -> DataConfig:
    base = dict(dataset=None, input_shape=[1], num_classes=2, batch_size=4, num_workers=0)
    return DataConfig(**{**base, **kw})


def test_eval_shards_cover_every_sample_once():
    n, world = 10, 3
    seen = sorted(i for r in range(world) for i in EvalShardSampler(n, r, world))
    assert seen == list(range(n))
    assert [len(EvalShardSampler(n, r, world)) for r in range(world)] == [4, 3, 3]


def test_train_shards_are_disjoint_and_reshuffle_per_epoch():
    ds = TensorDataset(torch.arange(16))
    loaders = [build_loader(ds, cfg(), train=True, rank=r, world_size=2, seed=1) for r in (0, 1)]
    epoch0 = [torch.cat([b[0] for b in ld]).tolist() for ld in loaders]
    assert sorted(epoch0[0] + epoch0[1]) == list(range(16))
    for ld in loaders:
        ld.sampler.set_epoch(1)
    epoch1 = [torch.cat([b[0] for b in ld]).tolist() for ld in loaders]
    assert epoch1 != epoch0


def test_worker_settings_only_with_workers_and_no_pinning_on_cpu():
    ds = TensorDataset(torch.arange(8))
    ld = build_loader(ds, cfg(num_workers=0, prefetch_factor=4, persistent_workers=True),
                      train=True)
    assert ld.prefetch_factor is None and not ld.persistent_workers and not ld.pin_memory
    assert len(list(ld)) == 2
    ld = build_loader(ds, cfg(num_workers=1, prefetch_factor=3), train=False)
    assert ld.prefetch_factor == 3 and ld.persistent_workers
    assert torch.cat([b[0] for b in ld]).tolist() == list(range(8))


class RandomSamples(torch.utils.data.Dataset):
    """Each sample draws from python's, numpy's and torch's global RNGs, as augmentations do."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        import random

        import numpy as np

        info = torch.utils.data.get_worker_info()
        return torch.tensor([random.random(), float(np.random.rand()), torch.rand(()).item(),
                             info.id if info else -1])


def draws(seed, epochs=2, persistent=False, rank=0):
    ld = build_loader(RandomSamples(), cfg(num_workers=2, batch_size=2, shuffle=False,
                                           persistent_workers=persistent),
                      train=True, seed=seed, rank=rank, world_size=1)
    out = []
    for epoch in range(epochs):
        ld.sampler.set_epoch(epoch)
        out.append(torch.cat(list(ld)))
    return out


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_seeding_is_reproducible_and_distinct(persistent):
    a, b = draws(1, persistent=persistent), draws(1, persistent=persistent)
    for ea, eb in zip(a, b):
        assert torch.equal(ea, eb)  # same seed: the same random stream
    e0, e1 = a
    w0, w1 = e0[e0[:, 3] == 0, :3], e0[e0[:, 3] == 1, :3]
    assert not torch.equal(w0, w1)  # workers differ (python, numpy and torch alike)
    assert (w0[:, 0] != w1[:, 0]).all() and (w0[:, 1] != w1[:, 1]).all()
    assert not torch.equal(e0[:, :3], e1[:, :3])  # epochs differ
    assert not torch.equal(draws(2, epochs=1)[0], a[0])  # another seed, other draws


def test_persistent_workers_survive_epochs():
    ds = TensorDataset(torch.arange(8))
    ld = build_loader(ds, cfg(num_workers=2, persistent_workers=True, prefetch_next_epoch=False),
                      train=True)  # (with it, one iterator runs on: tests/data/test_runon.py)
    list(ld)
    first = ld._iterator
    list(ld)
    assert ld._iterator is first  # the same worker processes served both epochs


def test_loader_passes_timeout_and_context():
    ds = TensorDataset(torch.arange(8))
    # (a spawned worker imports torch first: seconds on a loaded machine, within the timeout)
    ld = build_loader(ds, cfg(num_workers=1, timeout=600.0, multiprocessing_context="spawn"),
                      train=False)
    assert ld.timeout == 600.0 and ld.multiprocessing_context.get_start_method() == "spawn"
    assert torch.cat([b[0] for b in ld]).tolist() == list(range(8))


def test_a_worker_lets_its_first_sigterm_and_its_copies_pass_and_ends_on_a_later_one(
        monkeypatch):
    """A scheduler's SIGTERM to every process of a torchrun job reaches a worker twice (the
    sender's, and torchrun's to its rank's group): it ended on the copy, and the step failed.
    Copies within `SIGTERM_COPIES_S` of the first are that one; a later SIGTERM ends it."""
    import signal

    from torch.utils.data._utils import signal_handling

    import data.loader

    def loader():  # (each pass a new worker, which inherits the window as it stands)
        return build_loader(TensorDataset(torch.arange(64)), cfg(
            num_workers=1, batch_size=2, persistent_workers=False), train=False)

    batches = iter(loader())
    next(batches)
    worker = batches._workers[0]
    for _ in range(3):
        os.kill(worker.pid, signal.SIGTERM)
        time.sleep(0.1)
    for _ in range(8):  # (batches asked for after the signals)
        next(batches)
    assert worker.is_alive()
    assert len(list(batches)) == 23 and worker.exitcode == 0  # (asked to stop at the end)

    monkeypatch.setattr(data.loader, "SIGTERM_COPIES_S", 1.0)
    batches = iter(loader())
    next(batches)
    worker = batches._workers[0]
    os.kill(worker.pid, signal.SIGTERM)
    for _ in range(3):  # (the third batch's index was sent after the signal: its handler ran)
        next(batches)
    time.sleep(1.5)
    assert worker.is_alive()
    signal_handling._remove_worker_pids(id(batches))  # (its end is this test's doing: not
    batches._worker_pids_set = False                  # PyTorch's error in this process)
    os.kill(worker.pid, signal.SIGTERM)
    worker.join(timeout=30)
    assert worker.exitcode == -signal.SIGTERM
    batches._shutdown_workers()


class _Busy(torch.utils.data.Dataset):
    """From sample 4 on, a minute's work per sample: the worker does not take up a request
    to stop."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 4:
            time.sleep(60)
        return torch.tensor(i)


def test_a_pass_ended_kills_a_worker_that_let_its_sigterm_pass(monkeypatch):
    """PyTorch's shutdown asks a worker to stop, waits, and sends SIGTERM; a worker lets that
    pass where it comes within `SIGTERM_COPIES_S` of a preemption's SIGTERM (or cannot act on
    it, stuck in native code), and Python's exit then waited on it for ever. What is left of
    a pass after its shutdown is killed."""
    import signal

    from torch.utils.data import _utils

    from data.loader import end_pass

    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 1.0)  # (PyTorch's waits, shorter)
    ld = build_loader(_Busy(), cfg(num_workers=1, batch_size=2, persistent_workers=False),
                      train=False)
    batches = iter(ld)
    next(batches)
    worker = batches._workers[0]
    os.kill(worker.pid, signal.SIGTERM)  # (the preemption's: the shutdown's is a copy)
    time.sleep(0.5)
    end_pass(batches)
    worker.join(timeout=5)
    assert not worker.is_alive() and worker.exitcode == -signal.SIGKILL


def test_a_process_with_a_loaders_kept_workers_still_exits():
    """Workers let a first SIGTERM pass (worker_signals), and Python's exit sends one and then
    waits: a loader with persistent workers still referenced at exit is closed first, or the
    process never ended."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = ("import torch; from torch.utils.data import TensorDataset\n"
            "from data.loader import build_loader; from trainer.config import DataConfig\n"
            "ld = build_loader(TensorDataset(torch.arange(64)), DataConfig(dataset=None, "
            "input_shape=[1], num_classes=2, batch_size=4, num_workers=2, "
            "persistent_workers=True, prefetch_next_epoch=False), train=True)\n"
            "next(iter(ld)); print('served', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "served\n", proc.stderr[-2000:]


def test_a_process_with_an_abandoned_iterator_in_a_reference_cycle_still_exits():
    """An iterator of a loader without persistent workers, abandoned mid-epoch and kept from
    its collection by a reference cycle (scripts/tune_loader.py data=heavy): no loader holds
    it, and its workers, letting the exit's one SIGTERM pass, held the exit for ever."""
    import os
    import sys

    from tests.helpers import ROOT, bounded

    code = ("import gc, torch; from torch.utils.data import TensorDataset\n"
            "from data.loader import build_loader; from trainer.config import DataConfig\n"
            "gc.disable()\n"
            "ld = build_loader(TensorDataset(torch.arange(64)), DataConfig(dataset=None, "
            "input_shape=[1], num_classes=2, batch_size=4, num_workers=2, "
            "persistent_workers=False), train=True)\n"
            "it = iter(ld); next(it); cycle = [it]; cycle.append(cycle); del it, cycle, ld\n"
            "print('served', flush=True)\n")
    proc = bounded([sys.executable, "-c", code], ROOT, dict(os.environ), 60)
    assert proc.returncode == 0 and proc.stdout == "served\n", proc.stderr[-2000:]


# an iterator with running workers left as garbage in a reference cycle at the next loader's
# fork (collection is off until then), and that loader's worker collecting at once
GARBAGE_AT_FORK = """
import gc, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
if sys.argv[1] == "stoker":
    import data.loader  # noqa: F401
class Collecting(TensorDataset):
    def __getitem__(self, i):
        gc.collect()
        return super().__getitem__(i)
gc.disable()
first = iter(DataLoader(TensorDataset(torch.arange(8)), batch_size=4, num_workers=1))
next(first)  # (not run out: its workers still up)
cycle = {"iterator": first}
cycle["cycle"] = cycle
del first, cycle
print(len(list(DataLoader(Collecting(torch.arange(8)), batch_size=4, num_workers=1))))
gc.enable()
gc.collect()
"""


@pytest.mark.parametrize("imported,said", [("stoker", False), ("torch alone", True)])
def test_a_workers_collector_leaves_what_it_inherited_alone(imported, said):
    """Garbage of the training process's at a worker's fork (an iterator dropped in a
    cycle) is not collected in the worker, where its __del__ shut down workers that are not
    the worker's children and printed a traceback; torch alone shows the case is real."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    proc = subprocess.run([sys.executable, "-c", GARBAGE_AT_FORK, imported], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "2\n", proc.stderr[-2000:]
    assert ("can only test a child process" in proc.stderr) == said, proc.stderr[-2000:]


@pytest.mark.parametrize("sig", ["KILL", "SEGV"])
def test_a_loader_worker_that_dies_is_one_line_saying_how(tmp_path, sig):
    """The training process's DataLoader tells only that the worker ended, in some of its
    races: the line says how, from the worker's exit status, with the usual cause of that."""
    from tests.helpers import run_cli

    proc = run_cli(["data.dataset._target_=tests.helpers.DyingWorkerDigits",
                    f"+data.dataset.signal={sig}", "data.placement=host", "data.num_workers=1",
                    "trainer.max_epochs=1", "trainer.progress_bar=false",
                    f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1].strip(" \x00")  # (after PyTorch's SEGV line)
    # how it ended, from its process: PyTorch's words said it for some of its races only (its
    # "exited unexpectedly", or a broken connection, for others)
    said = {"KILL": "was killed (SIGKILL: the out-of-memory killer, usually; fewer "
                    "data.num_workers, a smaller data.prefetch_factor or data.batch_size take "
                    "less memory)",
            "SEGV": "was killed by signal Segmentation fault (a crash in native code the "
                    "dataset calls, a decoder's say); data.num_workers=0 runs it in the "
                    "training process, where it shows"}[sig]
    assert re.fullmatch(r"stoker: error: data: loader worker \(pid \d+\) " + re.escape(said),
                        last), last
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_a_connection_error_of_the_datasets_own_in_a_worker_is_its_own_line(tmp_path):
    """A ConnectionError the dataset raised in a worker (a service it reads from gone) was
    taken for the connection to the worker broken: a line of a killed worker, garbled, with
    the dataset's words lost."""
    from tests.helpers import run_cli

    proc = run_cli(["data.dataset._target_=tests.helpers.ConnectionLostDigits",
                    "data.placement=host", "data.num_workers=1", "trainer.max_epochs=1",
                    "trainer.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "stoker: error: ConnectionError: the feature server went away (ConnectionError in "
        "DataLoader worker process 0)"), proc.stderr[-2000:]


@pytest.mark.parametrize("text,said", [
    ("DataLoader worker (pid 77) is killed by signal: Killed. ",
     "data: loader worker (pid 77) was killed (SIGKILL: the out-of-memory killer, usually"),
    ("DataLoader worker (pid 78) is killed by signal: Segmentation fault. ",
     "data: loader worker (pid 78) was killed by signal Segmentation fault (a crash in native"),
    ("DataLoader worker (pid 80) is killed by signal: Bus error. It is possible that dataloader's "
     "workers are out of shared memory.", "data: loader worker (pid 80) was killed by signal Bus "
                                          "error (shared memory, /dev/shm, ran out, usually: "
                                          "a larger /dev/shm (docker --shm-size), fewer "
                                          "data.num_workers or a smaller data.prefetch_factor; "
                                          "or a memory-mapped data file was cut short while "
                                          "the run read it)"),
    ("DataLoader worker (pid 79) exited unexpectedly with exit code 3. Details are lost due to "
     "multiprocessing.", "data: loader worker (pid 79) exited with code 3 (sys.exit or os._exit"),
])
def test_what_pytorch_says_of_an_ended_worker_is_one_line(text, said):
    from data.loader import LoaderWorkerDied, loader_error

    error = loader_error(RuntimeError(text))
    assert isinstance(error, LoaderWorkerDied) and str(error).startswith(said), str(error)
    other = RuntimeError("something else")
    assert loader_error(other) is other


def test_workers_pytorch_saw_ended_together_are_said_by_the_one_whose_status_tells_how():
    """PyTorch's "pid(s) A, B exited unexpectedly" (a rank's two validation workers, one
    crashed) was said as "ended unexpectedly: PyTorch does not tell how" (3 runs in 4 under
    torchrun); each pid's exit status is read, as for one."""
    from types import SimpleNamespace

    from data.loader import loader_error

    holder = SimpleNamespace(_workers=[SimpleNamespace(pid=4241, exitcode=None),
                                       SimpleNamespace(pid=4242, exitcode=-11)])
    error = loader_error(RuntimeError("DataLoader worker (pid(s) 4241, 4242) exited "
                                      "unexpectedly"), (holder,))
    assert str(error).startswith("data: loader worker (pid 4242) was killed by signal "
                                 "Segmentation fault"), str(error)


def test_a_broken_connection_to_a_worker_is_its_end_and_a_datasets_own_is_not():
    """A worker that dies while its batch is received can break the connection first
    ([Errno 104] Connection reset by peer, said as if the disk or network failed)."""
    from data.loader import LoaderWorkerDied, readable

    def batches():
        yield 1
        raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(LoaderWorkerDied, match=r"^data: the connection to a loader worker broke "
                                               r"while a batch was received \(ConnectionReset"):
        list(readable(batches(), workers=True))
    with pytest.raises(ConnectionResetError):  # no workers: the dataset's own, as it is
        list(readable(batches()))


def test_a_broken_connection_from_a_worker_whose_process_ended_is_said_as_its_end():
    """A worker killed while it hands a batch over broke the connection before PyTorch's
    handler said the worker ended: the line was the connection's, now how the worker ended,
    from its process (a run's last line depended on which came first)."""
    from types import SimpleNamespace

    from data.loader import LoaderWorkerDied, readable

    class Batches:  # a DataLoader iterator whose worker 4242 was killed by SIGSEGV
        _workers = [SimpleNamespace(pid=4241, exitcode=None),
                    SimpleNamespace(pid=4242, exitcode=-11)]

        def __iter__(self):
            return self

        def __next__(self):
            raise ConnectionResetError(104, "Connection reset by peer")

    with pytest.raises(LoaderWorkerDied) as e:
        list(readable(Batches(), workers=True))
    assert str(e.value) == ("data: loader worker (pid 4242) was killed by signal Segmentation "
                            "fault (a crash in native code the dataset calls, a decoder's say); "
                            "data.num_workers=0 runs it in the training process, where it shows")


class _Hangs(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        __import__("time").sleep(3600)


def test_a_stall_kills_the_stuck_workers_at_once():
    """data.timeout passed: the one-line LoaderStalled, and the stuck workers are killed then
    (asked to stop, a stuck worker does not, and the loader's shutdown waited 5 s for each)."""
    from data.loader import LoaderStalled, readable

    loader = torch.utils.data.DataLoader(_Hangs(), batch_size=2, num_workers=2, timeout=1)
    batches = iter(loader)
    workers = list(batches._workers)
    with pytest.raises(LoaderStalled, match=r"^data: DataLoader timed out after 1 seconds "
                                            r"\(data.timeout\)"):
        next(readable(batches, workers=True, owner=loader))
    for worker in workers:
        worker.join(timeout=2)
    assert not any(w.is_alive() for w in workers)
    batches._shutdown_workers()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_makes_its_batches_trains_through_as_is(make_cfg, tmp_path, workers):
    """The stall advice's `__getitems__` that returns its batch made already: the default
    collate cannot stack it (one line says so), data.loader.as_is hands it on, and the run
    takes the steps, and reaches the weights, of the same samples made one at a time."""
    from trainer.config import ConfigError
    from trainer.runner import train

    common = ("data.placement=host", f"data.num_workers={workers}", "trainer.max_steps=5")
    made = ("data.dataset._target_=tests.helpers.BatchMakingDigits", *common)
    with pytest.raises(ConfigError, match="the default collate cannot batch"):
        train(make_cfg(*made, run_dir=tmp_path / "refused"))
    got = train(make_cfg(*made, "+data.collate_fn._target_=data.loader.as_is",
                         run_dir=tmp_path / "as_is"))
    plain = train(make_cfg(*common, run_dir=tmp_path / "plain"))
    assert got["steps"] == plain["steps"] == 5
    theirs, ours = (torch.load(s["checkpoint"], weights_only=True)["model"] for s in (plain, got))
    assert all(torch.equal(theirs[k], ours[k]) for k in theirs)


def test_a_stalled_workers_own_child_processes_end_with_it(make_cfg, tmp_path):
    """A shard whose `curl` (or `pipe:` command) never answered: the stall's line came, the
    worker was killed, and its child processes ran on, orphaned, after the run."""
    import random

    from data.loader import LoaderStalled
    from tests.helpers import processes_running
    from trainer.runner import train

    marker = f"{random.randint(10**6, 10**7)}.5"  # (this test's own sleep)
    with pytest.raises(LoaderStalled, match="DataLoader timed out after 3.0 seconds"):
        train(make_cfg("data.dataset._target_=tests.helpers.StallingInAChild",
                       f"+data.dataset.marker={marker}", "data.placement=host",
                       "data.num_workers=1", "data.timeout=3", "data.shuffle=false",
                       "trainer.max_steps=5", "trainer.progress_bar=false"))
    deadline = time.monotonic() + 10
    while processes_running("sleep", marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_running("sleep", marker)
    for pid in left:  # (not to leave them to the next test either)
        os.kill(pid, 9)
    assert not left


def _generator_collate(samples):
    yield from samples


def test_a_batch_a_worker_cannot_send_is_one_line_at_once_not_a_wait_for_data_timeout():
    """A collate returning what cannot be pickled (a generator): the queue's thread printed a
    traceback per batch and dropped it, and the run waited until data.timeout, blaming a stuck
    worker. The worker's first batch is pickled once, and its error comes back as any worker
    error does, in one line."""
    import time

    from data.loader import end_workers, readable
    from tests.helpers import numbered

    cfg = DataConfig(batch_size=4, num_workers=2, timeout=120.0)
    loader = build_loader(numbered(32), cfg, train=True, rank=0, world_size=1, seed=0,
                          num_workers=2, collate_fn=_generator_collate)
    start, batches = time.monotonic(), iter(loader)
    with pytest.raises(ConfigError) as e:
        next(readable(batches, workers=True))
    assert time.monotonic() - start < 60  # (not data.timeout's 120 s)
    end_workers(loader)
    assert str(e.value) == (
        "data: a loader worker cannot send its batch to the training process (TypeError: "
        "cannot pickle 'generator' object): the collate (data.collate_fn, or the dataset's "
        "own) must return tensors, numbers, strings, and lists, tuples or dicts of them; "
        "data.num_workers=0 takes the batch as it is")

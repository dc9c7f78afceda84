"""build_loader: the one function through which the trainer asks for data.

Every rank builds its own DataLoader (for training with persistent workers, one that runs on
into the next epoch: data/runon.py). Training shards with a resumable DistributedSampler
(seeded by the run's seed, re-shuffled through `set_epoch`, able to start mid-epoch); evaluation shards without padding, so every
validation sample is seen exactly once across ranks and metrics summed over ranks are exact.
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import math
import os
import multiprocessing.util  # noqa: F401  (its exit hook first, so that ours runs before it)
import signal
import time
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from data import handover
from data.resident import ResidentBatches, rows_of
from data.runon import RunOnLoader
from data.sampler import ResumableDistributedSampler
from data.shardplan import ShardPlan
from data.shards import ShardLoader, ShardStream
from data.workerdeath import (_ENDED, LoaderWorkerDied, _ended_worker, ended, how,
                              iterators_of, worker_died)

from trainer.config import ConfigError, DataConfig, first_line


class EvalShardSampler(Sampler[int]):
    """Indices rank, rank + world, ... : disjoint shards that cover the dataset, no padding."""

    def __init__(self, n: int, rank: int, world_size: int):
        self.n, self.rank, self.world_size = n, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.n, self.world_size))

    def epoch_tensor(self) -> torch.Tensor:
        return torch.arange(self.rank, self.n, self.world_size)

    def __len__(self) -> int:
        return max(0, math.ceil((self.n - self.rank) / self.world_size))


def build_loader(dataset: Dataset, cfg: DataConfig, *, train: bool, rank: int = 0,
                 world_size: int = 1, seed: int = 0, device: torch.device = torch.device("cpu"),
                 shuffle: bool | None = None, collate_fn=None,
                 num_workers: Optional[int] = None, placement: str = "host"):
    """A DataLoader over this rank's shard of `dataset` with the config's worker settings, or
    with `placement="device"` a ResidentBatches over the same shard (a TensorDataset's tensors
    on `device`, batched by indexing; data/resident.py).

    `collate_fn` (null: PyTorch's default) turns a list of samples into a batch.
    `shuffle` overrides `cfg.shuffle` for training (overfit mode repeats the same batches).
    `num_workers` overrides `cfg.num_workers` (the trainer passes it with `auto` resolved).
    Pinned memory is used only when the batches go to a CUDA device: by the DataLoader's pin
    thread when there are workers, on the calling thread without (PyTorch's way).
    """
    if train:
        sampler: Sampler[int] = ResumableDistributedSampler(
            len(dataset), num_replicas=world_size, rank=rank, seed=seed,
            shuffle=cfg.shuffle if shuffle is None else shuffle, drop_last=cfg.drop_last,
            batch_size=cfg.batch_size)  # (an epoch's padded repeats left out where they can be)
        batch_size = cfg.batch_size
    else:
        sampler = EvalShardSampler(len(dataset), rank, world_size)
        batch_size = cfg.eval_batch_size or cfg.batch_size
    # Worker seeding: each pass over the loader draws a base seed from this generator and
    # worker w seeds python's `random`, numpy and torch with base + w. So random
    # augmentations differ per worker, per epoch (a new base seed per pass; persistent
    # workers continue their streams) and per rank, yet repeat exactly for the same seed.
    generator = torch.Generator().manual_seed(seed + 7919 * rank)
    drop_last = cfg.drop_last if train else False
    if placement == "device":
        return ResidentBatches(rows_of(dataset), sampler, batch_size, drop_last, device,
                               generator, gather_mb=cfg.device_budget_mb)
    workers = cfg.num_workers if num_workers is None else num_workers
    if workers == "auto":
        raise ValueError("build_loader: resolve data.num_workers=auto first and pass "
                         "num_workers (trainer/feeds.py does)")
    workers = int(str(workers))
    if isinstance(dataset, ShardStream):
        return _shard_loader(dataset, cfg, train, rank, world_size, seed, device, shuffle,
                             workers, generator)
    extra = _loader_options(cfg, workers)
    if train and workers and cfg.persistent_workers and cfg.prefetch_next_epoch:
        loader = RunOnLoader(dataset, sampler, batch_size, drop_last, generator,
                             num_workers=workers, collate_fn=collate_fn,
                             pin_memory=cfg.pin_memory and device.type == "cuda", **extra)
        _WITH_WORKERS.add(loader)
        return loader
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=cfg.pin_memory and device.type == "cuda",
        drop_last=drop_last, generator=generator, **extra)
    if workers:
        _WITH_WORKERS.add(loader)
    return loader


# What a loader worker inherits at its fork is kept from its garbage collector (frozen in
# the new process, before any other code runs there): garbage of the training process's not
# collected yet (a dropped loader iterator in a reference cycle) would otherwise be collected
# in the worker, torch's worker start-up allocating before any code of ours runs there, and
# that iterator's `__del__` would shut down workers that are not the worker's children (an
# `AssertionError: can only test a child process` traceback on stderr, a few a run with shard
# streams on a loaded machine). Frozen, they also stay on the pages the fork shares. The
# training process's own collector is left as it was.
os.register_at_fork(after_in_child=gc.freeze)

# DataLoaders whose workers (`worker_signals`) are ended before Python's own exit hook
_WITH_WORKERS: "weakref.WeakSet[DataLoader]" = weakref.WeakSet()


def end_workers(loader: Any) -> None:
    """Ends a loader's running workers now: the run-on loader's (its close(), data/runon.py),
    or those of the iterator a DataLoader keeps (persistent workers), as the loader does when
    it is collected; a no-op for other loaders."""
    close = getattr(loader, "close", None)
    if close is not None:
        close()
        return
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        shut_down(iterator)
        loader._iterator = None


def end_pass(iterator: Any) -> None:
    """Ends the workers of one pass's DataLoader iterator once its reader is done with it (its
    limit reached, its batches exhausted, the reader gone), unless the loader keeps them
    (persistent workers) or they run on (data/runon.py: not a DataLoader's iterator). Left
    to the iterator's collection, a shard loader's pass, whose last worker ends on a marker
    that a reader stopping at its count of batches never takes, ended in the garbage
    collector where a reference cycle held it; the collector had by then stopped the threads
    that feed the workers' index queues, so the request to stop never reached them, and the
    shutdown waited 5 s for each, twice (10 s an epoch, counted as validation time)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    if isinstance(iterator, _MultiProcessingDataLoaderIter) and \
            not iterator._persistent_workers:
        shut_down(iterator)


def kill_workers(*holders: Any) -> None:
    """Kills the live worker processes of DataLoader iterators: `holders` themselves, or the
    ones a loader keeps (a DataLoader's persistent iterator, the run-on loader's)."""
    from torch.utils.data._utils import signal_handling

    for it in iterators_of(holders):
        if getattr(it, "_worker_pids_set", False):  # (as its shutdown does first: else the
            # SIGCHLD handler raises "worker killed" over the stall's own line)
            signal_handling._remove_worker_pids(id(it))
            it._worker_pids_set = False
        for worker in getattr(it, "_workers", None) or ():
            if worker.is_alive():
                kill_with_children(worker)


def kill_with_children(process: Any) -> None:
    """SIGKILL to a worker `process` (a multiprocessing.Process) and to the processes it
    started: a shard's `curl` or `pipe:` command, stalled with it, outlived the run."""
    below = children_of(process.pid)  # (read first: then they are init's orphans)
    process.kill()
    for pid in below:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


LEFT_AFTER_SIGTERM_S = 1.0  # how long a worker still alive after a shutdown's SIGTERM is given


def shut_down(iterator: Any) -> None:
    """A DataLoader iterator's shutdown (`_shutdown_workers`; nothing for other objects), and
    then SIGKILL for each of its workers still alive: PyTorch asks them to stop, waits, and
    sends a SIGTERM, which a worker lets pass where it is its first or a copy of that
    (`worker_signals`), or cannot act on while stuck in native code, and Python's exit then
    waited on it for ever. (Again for an iterator shut down before: its workers, checked.)"""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is None:
        return
    shutdown()
    for worker in getattr(iterator, "_workers", None) or ():
        if worker.is_alive():  # (a torch whose shutdown does not wait after its SIGTERM)
            worker.join(timeout=LEFT_AFTER_SIGTERM_S)
            if worker.is_alive():
                kill_with_children(worker)


def children_of(pid: int) -> List[int]:
    """The processes below `pid`, from Linux's /proc/<pid>/task/*/children; [] elsewhere."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{parent}/task"):
                with contextlib.suppress(OSError):
                    with open(f"/proc/{parent}/task/{task}/children") as f:
                        kids = [int(k) for k in f.read().split()]
                    found += kids
                    todo += kids
    return found


@atexit.register
def _end_workers_at_exit() -> None:
    """Python's exit (multiprocessing's hook) sends each live worker one SIGTERM and waits for
    it; `worker_signals` lets a first SIGTERM pass, so a loader nobody closed (persistent
    workers of a loader still referenced) is closed here first, as the loader would close it,
    and so is any DataLoader iterator still running (one abandoned in a reference cycle).
    (torch's own shutdown in the loader's __del__ does nothing once the exit has begun.)"""
    for loader in list(_WITH_WORKERS):
        end_workers(loader)
    # an iterator no loader keeps (not persistent workers), abandoned mid-epoch and held from
    # its collection by a reference cycle (tune_loader.py's, one loader per setting measured,
    # data=heavy), was closed by no one: its workers, which let the exit's one SIGTERM pass,
    # held the exit for ever. Every one still running is ended as its loader would end it
    # (the objects walked only where a child process lives: ~40 ms of a run's exit otherwise).
    if not multiprocessing.active_children():  # (the module, imported with its util above)
        return
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    # (shut down already, too: a worker that let the shutdown's SIGTERM pass, killed here)
    for obj in gc.get_objects():  # (type(): an isinstance() asks some modules' __class__)
        if issubclass(type(obj), _MultiProcessingDataLoaderIter) and \
                hasattr(obj, "_shutdown"):  # (without: one built only in part)
            try:
                shut_down(obj)
            except Exception:  # noqa: BLE001  (the next ones still end)
                pass
    # a worker whose iterator went before the exit, the SIGTERM of its shutdown let pass (a
    # copy, to the worker, of a preemption's within SIGTERM_COPIES_S): Python's exit sends one
    # more, also let pass, and waited on it for ever
    for child in multiprocessing.active_children():
        if _process_name(child.pid) == "pt_data_worker":  # (PyTorch names its workers so)
            kill_with_children(child)
            child.join(timeout=LEFT_AFTER_SIGTERM_S)


def _process_name(pid: Optional[int]) -> str:
    """Process `pid`'s name (Linux's /proc/PID/comm); "" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _loader_options(cfg: DataConfig, workers: int) -> dict:
    if workers == 0:  # these are errors for the DataLoader when there are no workers
        return {}
    return dict(prefetch_factor=cfg.prefetch_factor, persistent_workers=cfg.persistent_workers,
                multiprocessing_context=cfg.multiprocessing_context, timeout=cfg.timeout,
                worker_init_fn=worker_signals)


def worker_signals(worker_id: int) -> None:
    """A loader worker's SIGTERM handling. A SIGTERM to the whole process group (SLURM
    cancelling or timing out a job, `kill -- -PGID`) is the training process's to act on: it
    ends its step, saves a checkpoint and then stops its workers itself. torch's own worker
    handler ends the worker at once, and the step then fails on the lost worker; here the
    first SIGTERM is let pass, with its copies (`SIGTERM_COPIES_S`), and a later one ends
    the worker. Loaders end their workers by asking them (then terminate() the ones that did not
    stop); Python's exit, which only sends one SIGTERM and waits, comes after
    `_end_workers_at_exit` did that. SIGUSR1 (SLURM's warning before a time limit) and SIGHUP
    (a closed terminal) are the training process's alone: a worker ignores them (it ends
    when asked, or when its parent is gone)."""
    signal.signal(signal.SIGTERM, _second_ends)
    for sig in (signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    _first_batch_sendable()


def _first_batch_sendable() -> None:
    """In a loader worker: its first batch is pickled as the queue to the training process
    will pickle it, and one that cannot be (a collate that returns a generator, an open file)
    raises a ConfigError there, which reaches the training process as any worker error does.
    The queue's own thread printed the pickling error's traceback and dropped the batch, and
    the run waited for it until data.timeout, then blamed a stuck worker. (Fetchers are this
    worker process's classes: patched here, in it alone.)"""
    from multiprocessing.reduction import ForkingPickler

    from torch.utils.data._utils import fetch

    state: Dict[str, Any] = {"checked": False, "error": None}
    for cls in (fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher):
        def checked(self, index, _fetch=cls.fetch):
            if state["error"] is not None:  # (the batches after it: the same, not pickled)
                raise state["error"]
            batch = _fetch(self, index)
            if not state["checked"]:
                state["checked"] = True
                try:
                    ForkingPickler.dumps(batch)
                except Exception as e:  # noqa: BLE001  (whatever pickling raises)
                    state["error"] = ConfigError(
                        f"data: a loader worker cannot send its batch to the training process "
                        f"({type(e).__name__}: {first_line(e, empty='')}): "
                        "the collate (data.collate_fn, or the dataset's own) must return "
                        "tensors, numbers, strings, and lists, tuples or dicts of them; "
                        "data.num_workers=0 takes the batch as it is")
                    raise state["error"] from None
            return batch
        cls.fetch = checked


# SIGTERMs that reach a worker this close after its first are copies of that one: a scheduler
# that signals every process of a torchrun job (SLURM's scancel), whose torchrun then sends
# its own to each rank's process group, the workers in it (a worker that ended on the copy
# failed the step, and the preemption checkpoint was lost). Timed where the handler runs,
# after any native call the copy came in (a decoder's, a tokenizer's). A worker that lets a
# loader shutdown's SIGTERM pass is killed after it (`shut_down`).
SIGTERM_COPIES_S = 10.0
_first_sigterm: List[float] = []  # (a worker's: when its first SIGTERM came)


def _second_ends(signum, frame) -> None:
    now = time.monotonic()
    if not _first_sigterm:
        _first_sigterm.append(now)
    elif now - _first_sigterm[0] > SIGTERM_COPIES_S:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _shard_loader(stream: ShardStream, cfg: DataConfig, train: bool, rank: int,
                  world_size: int, seed: int, device: torch.device, shuffle: Optional[bool],
                  workers: int, generator: torch.Generator) -> ShardLoader:
    """A ShardLoader for this rank's part of the stream (data/shards.py)."""
    batch_size = cfg.batch_size if train else (cfg.eval_batch_size or cfg.batch_size)
    plan = ShardPlan(len(stream), world_size, rank, train,
                     cfg.shuffle if shuffle is None else shuffle, cfg.drop_last, seed, batch_size)
    loader = ShardLoader(stream, plan, workers, cfg.pin_memory and device.type == "cuda",
                         generator, **_loader_options(cfg, workers))
    if workers:
        _WITH_WORKERS.add(loader)
    return loader


def _raised_in_collate(e: BaseException) -> bool:
    """True for an error of PyTorch's default collate or of the training loader's
    (data/batchpool.pooled_collate): raised in one, or re-raised from a worker with one in the
    copied traceback."""
    if any(m in str(e) for m in ("_utils/collate.py", "default_collate", "in pooled_collate")):
        return True
    tb = e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(("_utils/collate.py", "_utils\\collate.py")) or \
                code.co_name == "pooled_collate":
            return True
        tb = tb.tb_next
    return False


class LoaderStalled(RuntimeError):
    """No batch came from the loader's workers within data.timeout seconds."""


def as_is(batch: Any) -> Any:
    """A collate that returns what it is given: `+data.collate_fn._target_=data.loader.as_is`
    for a dataset whose `__getitems__(indices)` returns its batch made already (the
    DataLoader hands a collate what `__getitems__` returned, and the default one expects a
    list of samples to stack)."""
    return batch


class Unbatchable(ConfigError):
    """The dataset's samples are not batched by the default collate (the line says why)."""


def loader_error(e: BaseException, holders: Sequence[Any] = ()) -> BaseException:
    """One line for what goes wrong inside a DataLoader, else `e` itself: a ConfigError for
    samples the default collate cannot batch (types it does not know, tensors of different
    shapes), LoaderStalled for a worker that sent nothing for data.timeout seconds.

    With workers, the DataLoader re-raises the worker's error with its traceback in the
    message; the last line of that message says what was wrong.
    """
    if isinstance(e, RuntimeError) and str(e).startswith("DataLoader timed out"):
        return LoaderStalled(f"data: {str(e).rstrip('.')} (data.timeout) waiting for a batch "
                             "from a loader worker: stuck or stopped; raise data.timeout if "
                             "single batches are that slow")
    ended = worker_died(e, holders)
    if ended is not None:
        return ended
    last = ([line.strip() for line in str(e).splitlines() if line.strip()] or [repr(e)])[-1]
    if isinstance(e, ConfigError) and "Original Traceback" in str(e):
        # raised in a worker (an unreadable file, say): the DataLoader re-raised it with the
        # worker's traceback in the message; its own one line is the last
        head, _, rest = last.partition(": ")
        return type(e)(rest if rest and head.endswith(type(e).__name__) else last)
    if not isinstance(e, (TypeError, RuntimeError, KeyError)) or not _raised_in_collate(e):
        return e
    if isinstance(e, KeyError):  # a dict sample without a key the batch's first one has
        key = last.removeprefix("KeyError: ")
        return Unbatchable(f"data: the dataset yields dict samples with different keys, which "
                           f"the default collate cannot batch (a sample without {key}, which "
                           "the batch's first sample has); give every sample the same keys, "
                           "or set data.collate_fn")
    last = last.removeprefix("TypeError: ").removeprefix("RuntimeError: ")
    return Unbatchable(f"data: the dataset yields samples the default collate cannot batch "
                       f"({last}); return tensors of one shape, numbers, or dicts/tuples of "
                       "them, or set data.collate_fn (to pad variable-length samples, say)")


def started(loader: Any, workers: bool) -> Iterator[Any]:
    """`iter(loader)`, watched as `readable` watches a read (data/handover.py): a loader with
    persistent workers waits in it for each to take up the new pass, and a word of a worker's
    death lost there would wait for data.timeout."""
    token = handover.watch((loader,), handover.timeout_of(loader)) if workers else None
    try:
        return iter(loader)
    finally:
        handover.unwatch(token)


def readable(batches: Iterator[Any], workers: bool = False, owner: Any = None
             ) -> Iterator[Any]:
    """`batches`, with what `loader_error` knows turned into one line (a sample the default
    collate cannot batch, a stalled worker, a worker's data error such as an unreadable
    file); other errors pass as they are. `workers`: the batches come from loader workers,
    so a connection that breaks while one is received is that worker's process ending. On a
    stall the workers of `batches` (or of the loader `owner` that made them) are killed: a
    stuck one ignores the request to stop, and the loader's shutdown would wait 5 s for
    each (a silent minute with several workers and loaders)."""
    token = handover.watch((batches, owner), handover.timeout_of(batches, owner)) \
        if workers else None
    try:
        yield from batches  # delegated in C: nothing per batch on the training thread
    except (TypeError, RuntimeError, KeyError, ConfigError) as e:
        _said_stall(token)
        error = loader_error(e, (batches, owner))
        if isinstance(error, LoaderStalled):
            kill_workers(batches, owner)
        if error is e:
            raise
        raise error from None
    except (ConnectionError, EOFError) as e:
        if not workers or str(e).startswith("Caught "):
            raise  # (the dataset's own, in this process or a worker's: PyTorch's re-raise)
        _said_stall(token)
        worker = _ended_worker(batches, owner)
        if worker is not None:  # (the same line as where PyTorch's handler tells of it first)
            raise ended(worker.pid, *how(worker.exitcode)) from None
        raise LoaderWorkerDied(f"data: the connection to a loader worker broke while a batch "
                               f"was received ({type(e).__name__}: {first_line(e, empty='')}): "
                               f"{_ENDED}") from None
    finally:
        handover.unwatch(token)


def _said_stall(token: Optional[int]) -> None:
    """LoaderStalled where the handover watch killed the workers (see data/handover.py): the
    error that follows (a worker gone, a broken connection) is its doing."""
    timeout = handover.stalled(token)
    if timeout is not None:
        raise LoaderStalled(f"data: a loader worker did not hand over its batch within "
                            f"{timeout:g} s (data.timeout): stuck or stopped; raise "
                            "data.timeout if single batches are that slow") from None

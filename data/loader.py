"""build_loader: the one function through which the trainer asks for data.

Every rank builds its own DataLoader (for training with persistent workers, one that runs on
into the next epoch: data/runon.py). Training shards with a resumable DistributedSampler
(seeded by the run's seed, re-shuffled through `set_epoch`, able to start mid-epoch); evaluation shards without padding, so every
validation sample is seen exactly once across ranks and metrics summed over ranks are exact.
"""
from __future__ import annotations

import atexit
import math
import multiprocessing.util  # noqa: F401  (its exit hook first, so that ours runs before it)
import signal
import time
import weakref
from typing import Any, Iterator, NamedTuple, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from data.images import default_resize
from data.resident import ResidentBatches, rows_of
from data.runon import RunOnLoader
from data.sampler import ResumableDistributedSampler
from data.shards import ShardLoader, ShardPlan, ShardStream

from trainer.config import ConfigError, DataConfig


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
            shuffle=cfg.shuffle if shuffle is None else shuffle, drop_last=cfg.drop_last)
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
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        loader._iterator = None


@atexit.register
def _end_workers_at_exit() -> None:
    """Python's exit (multiprocessing's hook) sends each live worker one SIGTERM and waits for
    it; `worker_signals` lets a first SIGTERM pass, so a loader nobody closed (persistent
    workers of a loader still referenced) is closed here first, as the loader would close it.
    (torch's own shutdown in the loader's __del__ does nothing once the exit has begun.)"""
    for loader in list(_WITH_WORKERS):
        end_workers(loader)


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
    first SIGTERM is let pass, and a second ends the worker. Loaders end their workers by
    asking them (then terminate() the ones that did not stop); Python's exit, which only
    sends one SIGTERM and waits, comes after `_end_workers_at_exit` did that."""
    signal.signal(signal.SIGTERM, _second_ends)


def _second_ends(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _shard_loader(stream: ShardStream, cfg: DataConfig, train: bool, rank: int,
                  world_size: int, seed: int, device: torch.device, shuffle: Optional[bool],
                  workers: int, generator: torch.Generator) -> ShardLoader:
    """A ShardLoader for this rank's part of the stream (data/shards.py)."""
    batch_size = cfg.batch_size if train else (cfg.eval_batch_size or cfg.batch_size)
    plan = ShardPlan(len(stream), world_size, rank, train,
                     cfg.shuffle if shuffle is None else shuffle, cfg.drop_last, seed, batch_size)
    return ShardLoader(stream, plan, workers, cfg.pin_memory and device.type == "cuda",
                       generator, **_loader_options(cfg, workers))


class SampleCost(NamedTuple):
    """What making one sample took, in seconds: of wall time, of the thread's CPU time, and
    of neither (`blocked_s`: waiting on storage, a network, a lock or a sleep, not on a CPU
    or in the queue for one, so a loaded machine does not read as waiting; None where the
    system does not say)."""
    wall_s: float
    cpu_s: float
    blocked_s: Optional[float]

    def waits(self) -> bool:
        """At least 50 microseconds, more than half of them blocked."""
        return self.blocked_s is not None and self.blocked_s >= 50e-6 \
            and self.blocked_s > 0.5 * self.wall_s


def _queued_s() -> Optional[float]:
    """Seconds this thread has spent queued for a CPU (Linux's schedstat; None elsewhere)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            ran, queued = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    # (a kernel without scheduler statistics writes zeros: no time queued is then known)
    return None if ran == "0" or not queued.isdigit() else int(queued) / 1e9


def sample_cost(dataset: Any, samples: int = 16, budget_s: float = 1.0
                ) -> Optional[SampleCost]:
    """The mean cost of making one sample of `dataset` in this thread, over up to `samples`
    spread over it within `budget_s` (two at least). None for a dataset that is not indexed,
    or whose sample fails here (advice then goes without)."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return None
    try:
        n = min(samples, len(dataset))
    except TypeError:
        return None
    wall = cpu = queued = 0.0
    start, count = time.perf_counter(), 0
    for i in range(n):
        q0, c0, w0 = _queued_s(), time.thread_time(), time.perf_counter()
        try:
            dataset[i * len(dataset) // n]
        except Exception:  # noqa: BLE001  (advice only: a sample that fails says nothing)
            return None
        w1, c1, q1 = time.perf_counter(), time.thread_time(), _queued_s()
        wall, cpu, count = wall + w1 - w0, cpu + c1 - c0, count + 1
        queued = None if q0 is None or queued is None else queued + q1 - q0
        if w1 - start > budget_s and (count >= 2 or w1 - w0 > budget_s):
            break  # (two for a steadier figure, unless one alone took the budget)
    if not count:
        return None
    blocked = None if queued is None else max(0.0, wall - cpu - queued) / count
    return SampleCost(wall / count, cpu / count, blocked)


def stall_advice(cfg: DataConfig, device: torch.device, wait_frac: float, *, workers: int,
                 cores: int, in_memory: bool, placement: str = "host",
                 why_not_device: Optional[str] = None, streamed: bool = False,
                 mapped: bool = False, uint8_images: bool = False,
                 gpu_idle: bool = False, pairs: bool = True, whole_set: bool = False,
                 converted: bool = False, sample: Optional[SampleCost] = None,
                 batch_size: int = 1) -> str:
    """One line of concrete advice for a run whose steps waited `wait_frac` of their time
    (`gpu_idle`: the share of time the GPU stood idle for data, trainer/devicewait.py).

    `workers`: the training loader's workers (auto resolved); `cores`: the CPU cores this rank
    may use (the node's, shared among its ranks); `in_memory`: the samples are rows of tensors
    already in memory; `mapped`: rows of memory-mapped arrays (data=memmap, data.cache=shm or
    disk) read by loader workers; `uint8_images`: the samples are uint8 images already (an
    image folder); `placement`: where the training batches were formed. The
    advice follows what the case shows (`why_not_device`: why the data could not be kept on
    the device): tensors in memory need no loader at all; more workers than cores only
    compete for them; fewer leave cores idle; with one worker per core the loader is CPU-bound
    and only less work per sample helps (a deeper prefetch queue does not: it hides bursts,
    not a steady shortfall). `pairs`: a sample is an (input, target) pair, which data.cache
    can hold; `whole_set`: one batch holds the rank's whole training set already;
    `converted`: the prefetcher turns each batch into normalised floats (uint8 samples) or
    augments it, in the wait. `sample`: what making one sample took in this process
    (`sample_cost`; None where unknown), which tells a sample that waits (storage, a network,
    a sleep: more workers than cores help) and one cheap to make (`batch_size` of them cost
    less than a worker's hand-over) from one the CPU is busy with.
    """
    pct = f"{100 * wait_frac:.0f}%"
    n = workers
    on = f"{count_of(n, 'worker')} on {count_of(cores, 'core')}"
    bigger = ("data.batch_size holds the whole training set already" if whole_set
              else "raise data.batch_size")
    if placement == "device" and converted and device.type == "cpu":
        fix = ("the batches are formed on the device already; the wait is their conversion to "
               "normalised floats (and augmentation), which on a CPU is compute like the step "
               "itself: neither workers nor a larger batch hide it (a GPU does it in "
               "microseconds)")
    elif placement == "device":
        fix = ("the batches are formed on the device already: the wait is the indexing itself; "
               + bigger)
    elif in_memory and why_not_device is None:
        fix = ("the samples are tensors in memory: set data.placement=device (or auto) to batch "
               "them by indexing on the training device" + (
                   f", or data.num_workers=0 ({_copiers(n)} them)"
                   if n else ""))
    elif in_memory and n:
        fix = (f"the samples are tensors in memory, which cannot stay on the device "
               f"({why_not_device}): set data.num_workers=0 ({_copiers(n)} them)")
    elif mapped and (why_not_device is None or "data.device_budget_mb" in why_not_device):
        fix = ("the samples are rows of memory-mapped arrays, read by loader workers" + (
            f" because {why_not_device}: raise data.device_budget_mb above their size, and "
            "data.placement=auto batches them by indexing on the training device"
            if why_not_device else ": set data.placement=auto (or device) to batch them by "
            "indexing on the training device"))
    elif sample is not None and sample.waits() and cfg.cache == "none" and not streamed:
        # n workers that wait give n / (1 - wait) worth of throughput needed; no more than
        # a few times as many at once (each holds the dataset and its batches in flight)
        more = min(max(math.ceil(max(n, 1) / max(1.0 - wait_frac, 1e-3)), n + 1),
                   max(4 * n, 8), 32)
        pay = ("data.cache=memory (or shm, disk) if the samples fit" if pairs
               else "fetch what __getitem__ reads ahead of the run, to local storage")
        fix = (f"making a sample mostly waits ({_duration(sample.wall_s)} a sample, "
               f"{sample.blocked_s / sample.wall_s:.0%} of it neither on a CPU nor queued for "
               "one: storage, a network, a lock?): " + (
                   "workers overlap such waits without competing for the cores, so raise "
                   f"data.num_workers from {n} to about {more} (scripts/tune_loader.py "
                   f"measures), or pay the wait once: {pay}" if more > n else
                   f"{n} workers overlap such waits already; pay the wait once: {pay}"))
    elif sample is not None and sample.cpu_s * batch_size < CHEAP_BATCH_S \
            and cfg.cache == "none" and not streamed:
        made = f"making a batch costs {_duration(sample.cpu_s * batch_size)} of CPU here"
        fix = (f"{made}, less than handing it over from a worker: data.cache=memory keeps the "
               "samples as arrays in this process (with data.placement=auto, batched by "
               "indexing on the training device)" + (", or data.num_workers=0" if n else "")
               if pairs else
               f"{made}; the wait is the loader's per-sample Python work" + (
                   " and a worker's hand-over: compare data.num_workers=0" if n else "")
               + ", and give the dataset a __getitems__(indices) that makes a whole batch "
               "at once (the DataLoader calls it when it has one)")
    elif n > cores:
        fix = (f"data.num_workers={n} is more than the {cores} CPU cores this rank has: the "
               f"workers compete for them; lower it to {cores} (or auto)")
    elif n < cores:
        fix = (f"raise data.num_workers from {n} to {cores} (the CPU cores this rank has; "
               "scripts/tune_loader.py with your overrides measures which is faster, since a "
               "cheap sample can cost more to hand over from a worker than to make"
               + ("; on a CPU the workers share the cores with the training itself, so compare "
                  "whole runs too)" if device.type == "cpu" else ")"))
    elif not cfg.persistent_workers:
        fix = "set data.persistent_workers=true (workers restart every epoch)"
    elif device.type == "cuda" and not cfg.pin_memory:
        fix = "enable data.pin_memory=true (page-locked buffers for asynchronous copies)"
    elif device.type == "cuda" and not cfg.device_prefetch:
        fix = "enable data.device_prefetch=true (copy the next batch during the step)"
    elif streamed:
        fix = (f"the loader is CPU-bound: {on} cannot decode the "
               "streamed shards faster; pack data that fits locally once (scripts/"
               "prepare_data.py --format npy, data=memmap), or store smaller images")
    elif mapped:
        fix = (f"the loader is CPU-bound reading memory-mapped arrays: {on} cannot batch "
               f"them faster; {bigger}, or store smaller samples (uint8, a lower resolution)")
    elif cfg.cache != "none":
        fix = (f"the loader is CPU-bound reading data.cache={cfg.cache}: {on} cannot batch it "
               "faster; data.cache=memory keeps it in this process (and, with data.placement="
               "auto, on the device) if it fits" + ("" if whole_set else ", else raise "
                                                    "data.batch_size"))
    elif not pairs:  # data.cache and prepare_data.py take (input, target) pairs only
        fix = (f"the loader is CPU-bound: {on} cannot prepare samples faster; if making a "
               "sample is cheap (indexing tensors), handing it over from a worker costs more: "
               "compare data.num_workers=0 (scripts/tune_loader.py measures both); else pay "
               "per-sample work once: compute what the dataset's __getitem__ computes "
               "(decoding, tokenizing) ahead of the run and load the results")
    else:
        fix = (f"the loader is CPU-bound: {on} cannot decode faster; pay "
               "per-sample work once (data.cache=memory or shm if the decoded data fits in "
               "memory, else data.cache=disk, or scripts/prepare_data.py and data=memmap)" + (
                   f"; or store the images smaller: {_stored_size(cfg)}" if uint8_images else
                   "; if samples are images, ship uint8 and augment on the device "
                   "(data.augment)"))
    what = "the GPU stood idle for data" if gpu_idle else "steps waited for data"
    return f"{what} {pct} of the time: {fix}"


def _stored_size(cfg: DataConfig) -> str:
    """The size images need no larger than: the shorter side decoding resizes them to."""
    ds = getattr(cfg, "dataset", None) or getattr(cfg, "train_dataset", None) or {}
    size, resize = ds.get("size"), ds.get("resize")
    if isinstance(size, int):
        resize = default_resize(size, resize)
    return (f"their shorter side at {resize} px, what decoding resizes them to "
            "(data.dataset.resize) before the crop" if resize is not None else
            "their shorter side at what decoding resizes them to (data.dataset.resize)")


CHEAP_BATCH_S = 1e-3  # a batch whose samples cost less CPU to make than a worker's hand-over


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def count_of(n: int, noun: str) -> str:
    """`n` and `noun`, plural unless n is 1 ("1 worker", "2 cores")."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _copiers(n: int) -> str:
    return "the one worker only copies" if n == 1 else f"each of the {n} workers only copies"


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


def loader_error(e: BaseException) -> BaseException:
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
        return ConfigError(f"data: the dataset yields dict samples with different keys, which "
                           f"the default collate cannot batch (a sample without {key}, which "
                           "the batch's first sample has); give every sample the same keys, "
                           "or set data.collate_fn")
    last = last.removeprefix("TypeError: ").removeprefix("RuntimeError: ")
    return ConfigError(f"data: the dataset yields samples the default collate cannot batch "
                       f"({last}); return tensors of one shape, numbers, or dicts/tuples of "
                       "them, or set data.collate_fn (to pad variable-length samples, say)")


def readable(batches: Iterator[Any]) -> Iterator[Any]:
    """`batches`, with what `loader_error` knows turned into one line (a sample the default
    collate cannot batch, a stalled worker, a worker's data error such as an unreadable
    file); other errors pass as they are."""
    try:
        yield from batches  # delegated in C: nothing per batch on the training thread
    except (TypeError, RuntimeError, KeyError, ConfigError) as e:
        error = loader_error(e)
        if error is e:
            raise
        raise error from None

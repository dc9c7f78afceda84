"""What a run whose steps waited for data should change: one line of advice for the case the
run shows (the feed's shape, the workers against the cores, and what making a sample costs:
computing, waiting, or cheaper than a worker's hand-over)."""
from __future__ import annotations

import math
import time
from typing import Any, NamedTuple, Optional

import torch
from torch.utils.data import IterableDataset

from data.images import default_resize
from trainer.config import DataConfig


class SampleCost(NamedTuple):
    """What making one sample took, in seconds: of wall time, of the thread's CPU time, and
    of neither (`blocked_s`: waiting on storage, a network, a lock or a sleep, not on a CPU
    or in the queue for one, so a loaded machine does not read as waiting; None where the
    system does not say)."""
    wall_s: float
    cpu_s: float
    blocked_s: Optional[float]

    def waits(self) -> bool:
        """At least 50 microseconds blocked, more than the CPU time it took (time queued for a
        CPU counts on neither side: on a loaded machine it can be most of the wall time, and a
        sample that waits then read as one that computes)."""
        return self.blocked_s is not None and self.blocked_s >= 50e-6 \
            and self.blocked_s > self.cpu_s


def queued_s() -> Optional[float]:
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
        q0, c0, w0 = queued_s(), time.thread_time(), time.perf_counter()
        try:
            dataset[i * len(dataset) // n]
        except Exception:  # noqa: BLE001  (advice only: a sample that fails says nothing)
            return None
        w1, c1, q1 = time.perf_counter(), time.thread_time(), queued_s()
        wall, cpu, count = wall + w1 - w0, cpu + c1 - c0, count + 1
        queued = None if None in (q0, q1, queued) else queued + q1 - q0
        if w1 - start > budget_s and (count >= 2 or w1 - w0 > budget_s):
            break  # (two for a steadier figure, unless one alone took the budget)
    if not count:
        return None
    blocked = None if queued is None else max(0.0, wall - cpu - queued) / count
    return SampleCost(wall / count, cpu / count, blocked)


class Feed(NamedTuple):
    """What a training feed is, as `stall_advice` reads it (its keyword arguments)."""
    workers: int
    cores: int
    in_memory: bool
    placement: str = "host"
    why_not_device: Optional[str] = None
    streamed: bool = False
    mapped: bool = False
    uint8_images: bool = False
    pairs: bool = True
    whole_set: bool = False
    converted: bool = False
    sample: Optional[SampleCost] = None
    batch_size: int = 1


def stall_advice(cfg: DataConfig, device: torch.device, wait_frac: float, *,
                 gpu_idle: bool = False, **feed: Any) -> str:
    """One line of concrete advice for a run whose steps waited `wait_frac` of their time
    (`gpu_idle`: the share of time the GPU stood idle for data, trainer/devicewait.py).

    The feed, as keywords (`Feed`): `workers`: the training loader's workers (auto resolved);
    `cores`: the CPU cores this rank may use (the node's, shared among its ranks);
    `in_memory`: the samples are rows of tensors already in memory; `mapped`: rows of
    memory-mapped arrays (data=memmap, data.cache=shm or disk) read by loader workers;
    `uint8_images`: the samples are uint8 images already (an image folder); `placement`:
    where the training batches were formed. The advice follows what the case shows
    (`why_not_device`: why the data could not be kept on the device): tensors in memory need
    no loader at all; more workers than cores only compete for them; fewer leave cores idle;
    with one worker per core the loader is CPU-bound and only less work per sample helps (a
    deeper prefetch queue does not: it hides bursts, not a steady shortfall). `pairs`: a
    sample is an (input, target) pair, which data.cache can hold; `whole_set`: one batch holds
    the rank's whole training set already; `converted`: the prefetcher turns each batch into
    normalised floats (uint8 samples) or augments it, in the wait. `sample`: what making one
    sample took in this process (`sample_cost`; None where unknown), which tells a sample that
    waits (storage, a network, a sleep: more workers than cores help) and one cheap to make
    (`batch_size` of them cost less than a worker's hand-over) from one the CPU is busy with.
    """
    f = Feed(**feed)
    s = f.sample
    fix = _placement_fix(f, device)
    if fix is None and s is not None and cfg.cache == "none" and not f.streamed and (
            s.waits() or s.cpu_s * f.batch_size < CHEAP_BATCH_S):
        fix = _sample_fix(s, f.workers, wait_frac, f.batch_size, f.pairs)
    fix = fix or _loader_fix(f, cfg, device) or _cpu_bound_fix(f, cfg)
    what = "the GPU stood idle for data" if gpu_idle else "steps waited for data"
    return f"{what} {100 * wait_frac:.0f}% of the time: {fix}"


def _bigger(f: Feed) -> str:
    return ("data.batch_size holds the whole training set already" if f.whole_set
            else "raise data.batch_size")


def _placement_fix(f: Feed, device: torch.device) -> Optional[str]:
    """The advice where the data's kind says it (on the device already, tensors in memory,
    memory-mapped arrays that could be); None for the loaders' cases."""
    n, why_not = f.workers, f.why_not_device
    if f.placement == "device" and f.converted and device.type == "cpu":
        return ("the batches are formed on the device already; the wait is their conversion to "
                "normalised floats (and augmentation), which on a CPU is compute like the step "
                "itself: neither workers nor a larger batch hide it (a GPU does it in "
                "microseconds)")
    if f.placement == "device":
        return ("the batches are formed on the device already: the wait is the indexing "
                "itself; " + _bigger(f))
    if f.in_memory and why_not is None:
        return ("the samples are tensors in memory: set data.placement=device (or auto) to "
                "batch them by indexing on the training device" + (
                    f", or data.num_workers=0 ({_copiers(n)} them)" if n else ""))
    if f.in_memory and n:
        return (f"the samples are tensors in memory, which cannot stay on the device "
                f"({why_not}): set data.num_workers=0 ({_copiers(n)} them)")
    if f.mapped and (why_not is None or "data.device_budget_mb" in why_not):
        return ("the samples are rows of memory-mapped arrays, read by loader workers" + (
            f" because {why_not}: raise data.device_budget_mb above their size, and "
            "data.placement=auto batches them by indexing on the training device"
            if why_not else ": set data.placement=auto (or device) to batch them by "
            "indexing on the training device"))
    return None


def _loader_fix(f: Feed, cfg: DataConfig, device: torch.device) -> Optional[str]:
    """The advice where a loader setting is off (workers against cores, workers restarted,
    no pinned memory or no side-stream copies on CUDA); None where the loader is set well."""
    n, cores = f.workers, f.cores
    if n > cores:
        return (f"data.num_workers={n} is more than the {cores} CPU cores this rank has: the "
                f"workers compete for them; lower it to {cores} (or auto)")
    if n < cores:
        return (f"raise data.num_workers from {n} to {cores} (the CPU cores this rank has; "
                "scripts/tune_loader.py with your overrides measures which is faster, since a "
                "cheap sample can cost more to hand over from a worker than to make"
                + ("; on a CPU the workers share the cores with the training itself, so "
                   "compare whole runs too)" if device.type == "cpu" else ")"))
    if not cfg.persistent_workers:
        return "set data.persistent_workers=true (workers restart every epoch)"
    if device.type == "cuda" and not cfg.pin_memory:
        return "enable data.pin_memory=true (page-locked buffers for asynchronous copies)"
    if device.type == "cuda" and not cfg.device_prefetch:
        return "enable data.device_prefetch=true (copy the next batch during the step)"
    return None


def _cpu_bound_fix(f: Feed, cfg: DataConfig) -> str:
    """The advice for a loader with one worker per core that still cannot keep up: less
    work per sample, in the way the data's kind allows."""
    on = f"{count_of(f.workers, 'worker')} on {count_of(f.cores, 'core')}"
    if f.streamed:
        return (f"the loader is CPU-bound: {on} cannot decode the streamed shards faster; pack "
                "data that fits locally once (scripts/prepare_data.py --format npy, "
                "data=memmap), or store smaller images")
    if f.mapped:
        return (f"the loader is CPU-bound reading memory-mapped arrays: {on} cannot batch "
                f"them faster; {_bigger(f)}, or store smaller samples (uint8, a lower "
                "resolution)")
    if cfg.cache != "none":
        return (f"the loader is CPU-bound reading data.cache={cfg.cache}: {on} cannot batch "
                "it faster; data.cache=memory keeps it in this process (and, with "
                "data.placement=auto, on the device) if it fits" + (
                    "" if f.whole_set else ", else raise data.batch_size"))
    if not f.pairs:  # data.cache and prepare_data.py take (input, target) pairs only
        return (f"the loader is CPU-bound: {on} cannot prepare samples faster; if making a "
                "sample is cheap (indexing tensors), handing it over from a worker costs "
                "more: compare data.num_workers=0 (scripts/tune_loader.py measures both); else "
                "pay per-sample work once: compute what the dataset's __getitem__ computes "
                "(decoding, tokenizing) ahead of the run and load the results")
    return (f"the loader is CPU-bound: {on} cannot decode faster; pay per-sample work once "
            "(data.cache=memory or shm if the decoded data fits in memory, else "
            "data.cache=disk, or scripts/prepare_data.py and data=memmap)" + (
                f"; or store the images smaller: {_stored_size(cfg)}" if f.uint8_images else
                "; if samples are images, ship uint8 and augment on the device "
                "(data.augment)"))


def _sample_fix(sample: SampleCost, n: int, wait_frac: float, batch_size: int,
                pairs: bool) -> str:
    """The advice for `n` workers whose samples mostly wait, or cost less CPU to make than a
    worker's hand-over (`stall_advice`)."""
    if sample.waits():
        # n workers that wait give n / (1 - wait) worth of throughput needed; no more than
        # a few times as many at once (each holds the dataset and its batches in flight)
        more = min(max(math.ceil(max(n, 1) / max(1.0 - wait_frac, 1e-3)), n + 1),
                   max(4 * n, 8), 32)
        pay = ("data.cache=memory (or shm, disk) if the samples fit" if pairs
               else "fetch what __getitem__ reads ahead of the run, to local storage")
        own = sample.blocked_s + sample.cpu_s  # (its time queued for a CPU left out)
        return (f"making a sample mostly waits ({_duration(own)} a sample, "
                f"{sample.blocked_s / own:.0%} of it neither on a CPU nor queued for "
                "one: storage, a network, a lock?): " + (
                    "workers overlap such waits without competing for the cores, so raise "
                    f"data.num_workers from {n} to about {more} (scripts/tune_loader.py "
                    f"--workers {n} {more} measures; PyTorch's warning that suggests no more "
                    f"workers than cores is for workers that compute), or pay the wait once: "
                    f"{pay}" if more > n else
                    f"{n} workers overlap such waits already; pay the wait once: {pay}"))
    made = f"making a batch costs {_duration(sample.cpu_s * batch_size)} of CPU here"
    if pairs:
        return (f"{made}, less than handing it over from a worker: data.cache=memory keeps the "
                "samples as arrays in this process (with data.placement=auto, batched by "
                "indexing on the training device)" + (", or data.num_workers=0" if n else ""))
    return (f"{made}; the wait is the loader's per-sample Python work" + (
        " and a worker's hand-over: compare data.num_workers=0, and" if n else ":")
        + " give the dataset a __getitems__(indices) that makes a batch's samples at once (the "
        "DataLoader calls it when it has one, and collates the list it returns; one that "
        "returns its batch made already wants data.loader.as_is as data.collate_fn)")


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


def count_of(n: int, noun: str, was: bool = False) -> str:
    """`n` and `noun`, plural unless n is 1 ("1 worker", "2 cores"); `was`: with the verb
    that agrees ("1 file was", "2 files were")."""
    return f"{n} {noun}" + ("" if n == 1 else "s") + (
        (" was" if n == 1 else " were") if was else "")


def _copiers(n: int) -> str:
    return "the one worker only copies" if n == 1 else f"each of the {n} workers only copies"

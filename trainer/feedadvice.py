"""What a run says of its training feed: a warning where the loader has more workers than
any stall could use, and at the end the stall advice (data.advice.stall_advice) for the feed as
it was built: its workers, where its data lives, what a sample costs."""
from __future__ import annotations

from typing import List

import numpy as np
import torch
from omegaconf import DictConfig
from torch.utils.data import IterableDataset

from data.advice import count_of, sample_cost, stall_advice
from data.prefetch import DevicePrefetcher
from data.resident import rows_of, tensors_of
from data.shards import ShardStream
from trainer import distributed


def too_many_workers(d: DictConfig, feed: DevicePrefetcher, local_world_size: int) -> List[str]:
    """A warning where the training loader has more workers per rank than even samples that
    wait on storage would use: more than 4 per CPU of the rank's share (8 at least), the most
    the stall advice asks for (data/advice.py). Between that and the CPUs, the stall advice
    at the end says, measured, whether they competed for the cores; PyTorch's own warning,
    a paragraph by each loader at every epoch against any worker past the CPUs, is left unsaid
    for these two."""
    workers = getattr(feed.loader, "num_workers", 0)
    cpus = distributed.cpus_per_rank(local_world_size)
    if workers <= max(4 * cpus, 8):
        return []
    node = distributed.cpus_per_rank(1)
    share = (f"its {count_of(cpus, 'CPU')} (bound to its task by srun)"
             if distributed.bound_to_task() else
             f"its {count_of(cpus, 'CPU')} (the node's {node} shared by {local_world_size} "
             f"ranks)" if local_world_size > 1 else f"this node's {count_of(cpus, 'CPU')}")
    return [f"data.num_workers={d.num_workers}: {workers} loader workers per rank for {share}: "
            "more than 4 per CPU (8 at least), past what even samples that wait on storage use, "
            "and each holds its copy of the dataset and batches in flight; "
            f"data.num_workers=auto gives {distributed.auto_num_workers(local_world_size)} "
            "(scripts/tune_loader.py measures others)"]


def feed_advice(d: DictConfig, feed: DevicePrefetcher, device: torch.device, wait_frac: float,
                local_world_size: int, gpu_idle: bool = False) -> str:
    """The stall advice (data.advice.stall_advice) for the training feed as it was built;
    `gpu_idle`: `wait_frac` is the GPU's idle share (trainer/devicewait.py)."""
    loader = feed.loader
    return stall_advice(d, device, wait_frac, workers=loader.num_workers,
                        cores=distributed.cpus_per_rank(local_world_size),
                        in_memory=tensors_of(loader.dataset) is not None,
                        mapped=not feed.resident and tensors_of(loader.dataset) is None
                        and rows_of(loader.dataset) is not None,
                        placement="device" if feed.resident else "host",
                        why_not_device=getattr(feed, "why_not_device", None),
                        streamed=isinstance(loader.dataset, ShardStream),
                        uint8_images=getattr(loader.dataset, "uint8_images", False) is True,
                        gpu_idle=gpu_idle, pairs=_pair_samples(loader.dataset),
                        whole_set=_one_batch(loader, d.batch_size),
                        converted=_converted(feed),
                        sample=None if feed.resident else sample_cost(loader.dataset),
                        batch_size=d.batch_size)


def _converted(feed: DevicePrefetcher) -> bool:
    """Whether the feed's transform works on each batch in the wait: uint8 samples turned into
    normalised floats, or an augmentation."""
    if not getattr(feed.transform, "identity", False):
        return True
    tensors = getattr(feed.loader, "tensors", None) or tensors_of(feed.loader.dataset)
    return tensors is not None and tensors[0].dtype == torch.uint8


def _pair_samples(dataset) -> bool:
    """Whether a sample of `dataset` is an (input, target) pair of tensors, arrays or numbers
    (what data.cache holds); True where it cannot be read here (advice as before)."""
    if isinstance(dataset, IterableDataset):
        return True
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001  (advice only: a sample that fails here says nothing)
        return True
    return (isinstance(sample, (tuple, list)) and len(sample) == 2
            and all(isinstance(v, (torch.Tensor, np.ndarray, np.generic, int, float))
                    for v in sample))


def _one_batch(loader, batch_size: int) -> bool:
    try:
        return len(loader.sampler) <= batch_size
    except TypeError:  # a stream's sampler has no length
        return False

"""build_loader: the one function through which the trainer asks for data.

Every rank builds its own DataLoader. Training shards with a DistributedSampler (seeded by the
run's seed, re-shuffled through `set_epoch`); evaluation shards without padding, so every
validation sample is seen exactly once across ranks and metrics summed over ranks are exact.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from trainer.config import DataConfig


class EvalShardSampler(Sampler[int]):
    """Indices rank, rank + world, ... : disjoint shards that cover the dataset, no padding."""

    def __init__(self, n: int, rank: int, world_size: int):
        self.n, self.rank, self.world_size = n, rank, world_size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.n, self.world_size))

    def __len__(self) -> int:
        return max(0, math.ceil((self.n - self.rank) / self.world_size))


def build_loader(dataset: Dataset, cfg: DataConfig, *, train: bool, rank: int = 0,
                 world_size: int = 1, seed: int = 0, device: torch.device = torch.device("cpu"),
                 shuffle: bool | None = None) -> DataLoader:
    """A DataLoader over this rank's shard of `dataset` with the config's worker settings.

    `shuffle` overrides `cfg.shuffle` for training (overfit mode repeats the same batches).
    Pinned memory is used only when the batches go to a CUDA device, and then by the
    DataLoader's pin thread, never on the training loop's thread.
    """
    if train:
        sampler: Sampler[int] = DistributedSampler(
            dataset, num_replicas=world_size, rank=rank, seed=seed,
            shuffle=cfg.shuffle if shuffle is None else shuffle, drop_last=cfg.drop_last)
        batch_size = cfg.batch_size
    else:
        sampler = EvalShardSampler(len(dataset), rank, world_size)
        batch_size = cfg.eval_batch_size or cfg.batch_size
    workers = cfg.num_workers
    extra = {}
    if workers > 0:  # these two are errors for the DataLoader when there are no workers
        extra = dict(prefetch_factor=cfg.prefetch_factor,
                     persistent_workers=cfg.persistent_workers)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
        pin_memory=cfg.pin_memory and device.type == "cuda",
        drop_last=cfg.drop_last if train else False,
        # seeds the workers' base seed: reproducible from the run's seed, distinct per rank
        generator=torch.Generator().manual_seed(seed + 7919 * rank), **extra)

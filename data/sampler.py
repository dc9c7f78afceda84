"""A DistributedSampler that can start an epoch part-way through, counted in global samples.

Epoch e's order is one permutation of the dataset (seeded by seed + e, the same for every
world size), padded (or, with drop_last, cut) to a multiple of the number of ranks; rank r
takes every world-size-th index from r. After n batches of b on each of w ranks the job has
consumed the first n * b * w positions of that list, whatever the ranks were, so a resumed
job skips exactly those and shards the rest over its own ranks: the same world size continues
bit for bit, another world size continues with the same samples.

The padding repeats samples (as torch's DistributedSampler does): given the batch size, a
training sampler (`batch_size`) leaves a rank's repeat out of its last batch wherever that
batch keeps a sample of its own, so that every rank still takes as many batches. An epoch
then counts each sample once, and the trainer, which weighs each batch by its count, takes
the steps of one process over batches of b * w. A repeat stays only where it is a rank's whole
last batch (its last batch of one sample, b * k + 1 a rank): there the ranks could not take
as many batches without it (`repeats_left`).
"""
from __future__ import annotations

import math
from typing import Iterator, List, Optional

import torch
from torch.utils.data import Sampler


def epoch_batches(samples: int, batch_size: int, drop_last: bool,
                  limit: Optional[int] = None) -> int:
    """Batches of `batch_size` in `samples` (the last partial one dropped with drop_last), at
    most `limit` (trainer.limit_train_batches, as `limit_left` leaves it)."""
    n = samples // batch_size if drop_last else math.ceil(samples / batch_size)
    return n if limit is None else min(n, limit)


def limit_left(limit: Optional[int], start: int, per_batch: int) -> Optional[int]:
    """What a limit of `limit` batches per epoch leaves of an epoch begun `start` global
    positions in, with `per_batch` positions per batch (one batch on every rank)."""
    return None if limit is None else max(0, limit - start // per_batch)


class ResumableDistributedSampler(Sampler[int]):
    """This rank's indices for one epoch; `set_epoch` reshuffles, `set_start` skips."""

    def __init__(self, num_samples: int, num_replicas: int = 1, rank: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 batch_size: Optional[int] = None):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside [0, {num_replicas})")
        self.n, self.num_replicas, self.rank = num_samples, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.batch_size = batch_size  # given: a repeat is left out where it can be (module doc)
        self.epoch = 0
        self.start = 0  # global positions of this epoch already consumed

    def set_epoch(self, epoch: int) -> None:
        """Selects epoch `epoch`'s order and starts it from the beginning."""
        self.epoch = epoch
        self.start = 0

    def set_start(self, global_position: int) -> None:
        """Skips the first `global_position` positions of the current epoch (all ranks')."""
        self.start = global_position

    def _epoch_order(self) -> torch.Tensor:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self.n, generator=g)
        return torch.arange(self.n)

    def _fit(self, indices: torch.Tensor) -> torch.Tensor:
        """Pads (repeating from the front) or cuts `indices` to a multiple of the ranks."""
        w = self.num_replicas
        if self.drop_last:
            return indices[:len(indices) - len(indices) % w]
        pad = -len(indices) % w
        while pad > 0 and len(indices):
            indices = torch.cat([indices, indices[:pad]])
            pad = -len(indices) % w
        return indices

    def epoch_tensor(self) -> torch.Tensor:
        """This rank's indices for the rest of the current epoch, as an int64 tensor."""
        order = self._epoch_order()
        if self.num_replicas == 1:  # nothing to pad, cut or deal (once an epoch: microseconds)
            return order[self.start:] if self.start else order
        rest = self._fit(order)[self.start:]
        mine = self._fit(rest)[self.rank::self.num_replicas]
        return mine[:len(mine) - self._repeat_left_out(len(mine))]

    def _ends_in_repeat(self, mine: int) -> bool:
        """Whether this rank's `mine` positions (the rest of its epoch) end in a padded repeat:
        its last position in the padded order is past the dataset's samples."""
        return bool(mine) and self.start + self.rank + (mine - 1) * self.num_replicas >= self.n

    def _repeat_left_out(self, mine: int) -> int:
        """1 where this rank's `mine` positions end in a padded repeat that can go: a
        training sampler given its batch size, padding (not drop_last), and a last batch that
        keeps a sample of its own without it; else 0."""
        b = self.batch_size
        if b is None or self.drop_last or self.num_replicas == 1 or \
                not self._ends_in_repeat(mine):
            return 0
        return 1 if math.ceil((mine - 1) / b) == math.ceil(mine / b) else 0

    def _repeats_kept(self) -> int:
        """1 where this rank's whole epoch ends in a padded repeat it keeps."""
        mine = math.ceil(self.n / self.num_replicas)
        return int(self._ends_in_repeat(mine) and not self._repeat_left_out(mine))

    def epoch_indices(self) -> List[int]:
        """This rank's indices for the rest of the current epoch."""
        return self.epoch_tensor().tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices())

    def __len__(self) -> int:
        w = self.num_replicas
        full = (self.n // w) * w if self.drop_last else math.ceil(self.n / w) * w
        rest = max(0, full - self.start)
        rest = (rest // w) * w if self.drop_last else math.ceil(rest / w) * w
        return rest // w - self._repeat_left_out(rest // w)


def repeats_left(n: int, world_size: int, batch_size: int, drop_last: bool = False) -> int:
    """Samples a training epoch of `n` over `world_size` ranks in batches of `batch_size`
    counts twice: the padded repeats no rank can leave out (each one a rank's whole last
    batch)."""
    if drop_last or world_size == 1:
        return 0
    return sum(ResumableDistributedSampler(n, world_size, r, shuffle=False,
                                           batch_size=batch_size)._repeats_kept()
               for r in range(world_size))

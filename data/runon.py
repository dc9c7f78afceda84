"""A training loader whose workers run on into the next epoch, so no epoch starts empty.

A DataLoader hands its workers indices only while its sampler lasts: as an epoch ends the
workers fall idle, and the next epoch's first step waits for a whole batch to be made from
nothing (`batch_size` samples in one worker: with 31 steps an epoch of 64 JPEGs at 1.4 ms each,
0.09 s of a 0.35 s epoch). `RunOnLoader` gives one DataLoader a batch sampler that follows the
training sampler's order from where the run starts and then on through the following epochs'
orders, and hands the trainer one epoch of it per pass: the last batches of an epoch are
consumed while the workers already make the next epoch's first ones.

The trainer sees a loader like any other (`sampler`, `batch_size`, `drop_last`, `generator`,
`dataset`, `num_workers`, `len()`), and its batches are the DataLoader's over the same sampler,
in the same order (each epoch's last partial batch stays its own; with `limit` set, the first
`limit` batches of each epoch, as trainer.limit_train_batches takes them). A pass whose epoch
and start position are not where the running batches stand (the first pass, a resume, a pass
the trainer left early: max_steps) starts the workers anew there.
"""
from __future__ import annotations

import copy
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, Dataset

from data.batchpool import BatchPool, pooled_collate
from data.sampler import ResumableDistributedSampler, epoch_batches, limit_left


def batches_taken(sampler: ResumableDistributedSampler, batch_size: int, drop_last: bool,
                  limit: Optional[int]) -> int:
    """Batches of the sampler's epoch from its start that a pass hands out: the rest of the
    epoch, or what a limit of `limit` batches per epoch leaves of it."""
    return epoch_batches(len(sampler), batch_size, drop_last, limit_left(
        limit, sampler.start, batch_size * sampler.num_replicas))


class _RunOnBatches:
    """Batches of indices: `sampler`'s order from (`epoch`, `start`) on, epoch after epoch.
    (It holds nothing of the RunOnLoader: no reference cycle keeps workers alive.)"""

    def __init__(self, sampler: ResumableDistributedSampler, batch_size: int, drop_last: bool,
                 epoch: int, start: int, limit: Optional[int]):
        self.sampler = copy.copy(sampler)  # its own: the trainer's sampler is left alone
        self.batch_size, self.drop_last, self.limit = batch_size, drop_last, limit
        self.epoch, self.start = epoch, start

    def __iter__(self) -> Iterator[List[int]]:
        s, bs = self.sampler, self.batch_size
        s.epoch, s.start = self.epoch, self.start
        while True:
            indices, made = s.epoch_indices(), 0
            take = batches_taken(s, bs, self.drop_last, self.limit)
            for i in range(0, len(indices), bs):
                if made == take:
                    break
                made += 1
                yield indices[i:i + bs]
            if not made and not s.start:  # a whole epoch without a batch: so are all others
                return
            s.epoch, s.start = s.epoch + 1, 0


class RunOnLoader:
    """A loader-shaped object over one DataLoader whose batch sampler runs on across epochs
    (see the module doc). `loader_kwargs` are the DataLoader's (workers > 0)."""

    def __init__(self, dataset: Dataset, sampler: ResumableDistributedSampler,
                 batch_size: int, drop_last: bool, generator: torch.Generator,
                 **loader_kwargs: Any):
        self.dataset, self.sampler = dataset, sampler
        self.batch_size, self.drop_last, self.generator = batch_size, drop_last, generator
        self.num_workers = loader_kwargs["num_workers"]
        self.loader_kwargs = {k: v for k, v in loader_kwargs.items()
                              if k != "persistent_workers"}  # one iterator for the run
        if self.loader_kwargs.get("collate_fn") is None:  # batches formed in the pool
            self.loader_kwargs["collate_fn"] = pooled_collate
        # batches the trainer takes of a whole epoch (trainer.limit_train_batches); None: all
        self.limit: Optional[int] = None
        self._limit: Optional[int] = None
        self._batches: Optional[Iterator[Any]] = None
        self._at: Optional[Tuple[int, int]] = None  # (epoch, start) the next batch begins
        self.pool: Optional[BatchPool] = None  # the running DataLoader's
        self.restarts = 0  # DataLoader iterators started (1 for a run straight through)

    def __len__(self) -> int:
        return epoch_batches(len(self.sampler), self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[Any]:
        here = (self.sampler.epoch, self.sampler.start)
        if self._batches is None or self._at != here or self._limit != self.limit:
            self.close()
            kwargs = dict(self.loader_kwargs)
            # the batches in flight, those the loop and the prefetcher hold, and one the
            # pool has not seen gone yet
            self.pool = BatchPool(self.num_workers, (kwargs.get("prefetch_factor") or 2) + 3,
                                  kwargs.pop("worker_init_fn", None))
            loader = DataLoader(self.dataset, batch_sampler=_RunOnBatches(
                self.sampler, self.batch_size, self.drop_last, *here, self.limit),
                generator=self.generator, worker_init_fn=self.pool.install, **kwargs)
            self._limit = self.limit  # the running batches follow this limit
            self._batches, self.restarts = iter(loader), self.restarts + 1
        self._at = None  # until this pass has handed out the whole epoch
        # the sampler stands at `here`: the same count as the running batches hand out
        return self._epoch(batches_taken(self.sampler, self.batch_size, self.drop_last,
                                         self.limit), here[0])

    def _epoch(self, count: int, epoch: int) -> Iterator[Any]:
        batches, pool = self._batches, self.pool
        if not count:
            self._at = (epoch + 1, 0)
        for i in range(count):
            batch = next(batches)
            if i == count - 1:  # handed out whole (a loop takes the last batch, no more)
                self._at = (epoch + 1, 0)
            yield pool.received(batch)

    def close(self) -> None:
        """Ends the running DataLoader iterator's workers now (not when it is collected)."""
        from data.loader import shut_down  # (lazy: data.loader imports this module)

        batches, self._batches, self._at = self._batches, None, None
        shut_down(batches)

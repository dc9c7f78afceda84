"""How a shard stream's epoch is cut among ranks and loader workers (data/shards.py says why):
a pure function of (seed, epoch, world size, rank, batch size, workers), so every rank agrees
without talking."""
from __future__ import annotations

import math
from typing import List, Tuple

import numpy as np
import torch


class ShardPlan:
    """The sampler-shaped part of a shard loader: which stream positions this rank takes in an
    epoch, and how far into it the job is (`set_epoch`, `set_start`, `len`: the samples left
    to this rank), as data.sampler's samplers offer the loop."""

    def __init__(self, n: int, num_replicas: int, rank: int, train: bool, shuffle: bool,
                 drop_last: bool, seed: int, batch_size: int):
        self.n, self.num_replicas, self.rank = n, num_replicas, rank
        self.train, self.shuffle, self.drop_last = train, shuffle and train, drop_last and train
        self.seed, self.batch_size = seed, batch_size
        self.epoch = 0
        self.start = 0  # global positions of this epoch already consumed
        self.workers = 1  # the loader's worker processes (0 counts as 1): its turn order

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.start = epoch, 0

    def set_start(self, global_position: int) -> None:
        self.start = global_position

    def rank_range(self) -> Tuple[int, int]:
        """This rank's [start, stop) positions of the epoch's stream (before `start`)."""
        n, w, r = self.n, self.num_replicas, self.rank
        if not self.train:
            return n * r // w, n * (r + 1) // w
        per = n // w if self.drop_last else math.ceil(n / w)
        return r * per, (r + 1) * per

    def batches(self) -> int:
        """This rank's batches in the whole epoch."""
        lo, hi = self.rank_range()
        b = self.batch_size
        return (hi - lo) // b if self.drop_last else math.ceil((hi - lo) / b)

    def taken(self) -> int:
        """This rank's batches of the epoch already consumed (from `start`)."""
        return min(self.batches(), self.start // (self.batch_size * self.num_replicas))

    def __len__(self) -> int:
        """The samples of this rank's batches not yet taken. The short last batch (without
        drop_last) is the last of the last worker's block, which the turn order may have
        passed already."""
        lo, hi = self.rank_range()
        b, n, taken = self.batch_size, self.batches(), self.taken()
        short = n * b - (hi - lo) if not self.drop_last else 0
        left = self.turns()[taken:]
        return (n - taken) * b - (short if any(i == n - 1 for _, i in left) else 0)

    def blocks(self) -> List[Tuple[int, int]]:
        """Each loader worker's block of this rank's batches (worker_blocks)."""
        return worker_blocks(self.batches(), self.workers)

    def turns(self) -> List[Tuple[int, int]]:
        """(worker, batch number) in the order the loader yields the epoch (turn_order)."""
        return turn_order(self.blocks())

    def shard_order(self, shards: int) -> List[int]:
        if not self.shuffle:
            return list(range(shards))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(shards, generator=g).tolist()


def worker_blocks(batches: int, workers: int) -> List[Tuple[int, int]]:
    """[first, stop) batch numbers of each worker's contiguous block (the first ones larger)."""
    k = max(1, workers)
    edges = [batches * w // k for w in range(k + 1)]
    sizes = sorted((edges[w + 1] - edges[w] for w in range(k)), reverse=True)
    starts = np.cumsum([0] + sizes)
    return [(int(starts[w]), int(starts[w + 1])) for w in range(k)]


def turn_order(blocks: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """(worker, batch number) in the order the DataLoader yields them: it asks the workers in
    turn and drops each one once its batches are done."""
    sizes = [stop - first for first, stop in blocks]
    return [(w, blocks[w][0] + i) for i in range(max(sizes, default=0))
            for w in range(len(blocks)) if i < sizes[w]]

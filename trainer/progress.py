"""A run's progress and its plan: what a checkpoint carries (`FitState`), the sums of one
logging window (`Window`), and how an epoch's micro-batches group into optimizer steps
(`window_plan`: k micro-batches a step with `accumulate_grad_batches=k`, a short last one).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

from torch.utils.data import DataLoader

from data.sampler import epoch_batches
from trainer.task import Count


@dataclass
class FitState:
    """Progress that a checkpoint must carry: the current epoch (= epochs completed),
    optimizer steps taken, and global samples of the current epoch already consumed."""

    epoch: int = 0
    step: int = 0
    position: int = 0
    validated_step: int = -1  # the step of the last validation (a run complete at its end)


@dataclass
class Window:
    """Host-side sums over one logging window (the loss sum is on the device, in the loop's
    Ledger); read with one sync at a logging boundary."""

    count: Count = 0  # units the loss averages over (samples or tokens)
    samples: int = 0
    steps: int = 0  # optimizer steps in the window: the same on every rank
    wait_s: float = 0.0
    paused_s: float = 0.0  # validation and epoch-end checkpoints inside the window: not its time
    start: float = field(default_factory=time.perf_counter)


def window_plan(num_samples: int, batch_size: int, drop_last: bool, limit: Optional[int],
                accumulate: int) -> List[int]:
    """Micro-batches of each optimizer step (window) of one epoch on one rank."""
    batches = epoch_batches(num_samples, batch_size, drop_last, limit)
    return [min(accumulate, batches - start) for start in range(0, batches, accumulate)]


def epoch_plan(loader: DataLoader, limit: Optional[int], accumulate: int) -> List[int]:
    """`window_plan` for this rank's shard of `loader` in one epoch."""
    return window_plan(len(loader.sampler), loader.batch_size, loader.drop_last, limit,
                       accumulate)


def steps_per_epoch(loader: DataLoader, limit: Optional[int], accumulate: int) -> int:
    return len(epoch_plan(loader, limit, accumulate))

"""A run's progress and its plan: what a checkpoint carries (`FitState`), the sums of one
logging window (`Window`), and how an epoch's micro-batches group into optimizer steps
(`window_plan`: k micro-batches a step with `accumulate_grad_batches=k`, a short last one), and
the batches an epoch and a validation take (`batch_limits`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

from omegaconf import DictConfig
from torch.utils.data import DataLoader

from data.sampler import epoch_batches, limit_left
from trainer.config import ConfigError
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


def rest_plan(loader: DataLoader, limit: Optional[int], accumulate: int, position: int,
              per_batch: int) -> List[int]:
    """`epoch_plan` for the rest of an epoch begun `position` global samples in (`per_batch`
    of them a batch on every rank), its sampler set to start there."""
    if position:
        loader.sampler.set_start(position)
    return epoch_plan(loader, limit_left(limit, position, per_batch), accumulate)


def steps_left(loader: DataLoader, limit: Optional[int], accumulate: int, state: FitState,
               max_epochs: int, max_steps: int) -> Optional[int]:
    """The optimizer steps a run at `state` has left to its limit, under this run's plan (its
    world size, batch and accumulation): the rest of the current epoch from its position, the
    whole epochs after it, max_steps where that comes first; None for a sampler that cannot
    start mid-epoch (not one of data.sampler's or a shard plan)."""
    per_epoch = len(epoch_plan(loader, limit, accumulate))
    left = per_epoch * max(0, max_epochs - state.epoch) if max_epochs > 0 else None
    sampler = loader.sampler
    if left is not None and state.position:  # the current epoch's rest, as the loop plans it
        if not (hasattr(sampler, "set_start") and hasattr(sampler, "num_replicas")):
            return None
        before = sampler.start
        try:
            rest = len(rest_plan(loader, limit, accumulate, state.position,
                                 loader.batch_size * sampler.num_replicas))
        finally:
            sampler.start = before
        left -= per_epoch - rest
    if max_steps > 0:
        left = max(0, max_steps - state.step) if left is None else \
            min(left, max(0, max_steps - state.step))
    return max(0, left or 0)


def total_steps(cfg: DictConfig, train_loader, train_limit: Optional[int]
                ) -> Tuple[int, List[str]]:
    """The run's optimizer steps (what the schedule spans), and warnings for settings that do
    not do what they say at that length (a batch larger than the rank's training set, more
    overfit or accumulated batches than an epoch has, a warmup as long as the run);
    ConfigError when an epoch has no optimizer step."""
    acc = cfg.trainer.accumulate_grad_batches
    plan = epoch_plan(train_loader, train_limit, acc)
    per_epoch = len(plan)
    n_rank = len(train_loader.sampler)
    if per_epoch == 0:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size}: no optimizer step per epoch "
                          f"with {n_rank} training samples on this rank "
                          f"(data.drop_last={cfg.data.drop_last})")
    too_big = ([f"data.batch_size={cfg.data.batch_size} is more than the {n_rank} training "
                f"samples on this rank: every epoch is one batch of {n_rank}"]
               if n_rank < cfg.data.batch_size else [])  # (with drop_last: refused above)
    overfit = cfg.trainer.overfit_batches
    if overfit and overfit > sum(plan):  # (a limit above the epoch's batches is no surprise)
        too_big.append(f"trainer.overfit_batches={overfit} is more than the {sum(plan)} "
                       f"batches of an epoch on this rank: each epoch repeats those {sum(plan)}")
    if plan and max(plan) < acc:  # every window is a whole epoch: not the logged global batch
        too_big.append(f"trainer.accumulate_grad_batches={acc} is more than the {max(plan)} "
                       f"batches of an epoch on this rank: each optimizer step accumulates "
                       f"{max(plan)}, a global batch of {max(plan)} x the per-rank batch x "
                       "the world size, not the one the start-up line gives")
    epochs = cfg.trainer.max_epochs  # (-1: no limit, and max_steps >= 1 ends the run)
    total = per_epoch * epochs if epochs > 0 else cfg.trainer.max_steps
    if cfg.trainer.max_steps > 0:
        total = min(total, cfg.trainer.max_steps)
    warmup = cfg.sched.get("warmup_steps") if isinstance(cfg.get("sched"), DictConfig) else None
    if isinstance(warmup, int) and not isinstance(warmup, bool) and warmup >= total > 0 \
            and not cfg.trainer.fast_dev_run:  # (its one step is a check, not a schedule)
        too_big.append(f"sched.warmup_steps={warmup} is not fewer than the run's {total} "
                       f"optimizer steps: the lr rises for the whole run (its last step's is "
                       f"{total / warmup:.0%} of optim.lr) and never decays")
    return total, too_big


def batch_limits(cfg: DictConfig, train_loader,
                 val_feed) -> Tuple[Optional[int], Optional[int]]:
    """The batches an epoch trains and a validation takes (None: all), a share of them
    (`trainer.limit_*_batches=0.25`) counted from this rank's loaders."""
    t = cfg.trainer
    if t.fast_dev_run:
        return 1, 1
    val = batches_of(t.limit_val_batches, val_feed, "trainer.limit_val_batches", "split")
    if t.overfit_batches:
        return t.overfit_batches, val
    return batches_of(t.limit_train_batches, train_loader, "trainer.limit_train_batches",
                    "epoch"), val


def batches_of(limit: Any, loader, key: str, what: str) -> Optional[int]:
    """A limit as a number of batches: a share of `loader`'s (rounded down; a share that
    comes to none is one line naming the key), an int or None as it is."""
    if not isinstance(limit, float):
        return limit
    if limit == 0:  # (0.0: no validation, no split built)
        return 0
    if loader is None:  # (no validation split to count)
        return None
    n = len(loader)
    taken = int(limit * n + 1e-9)  # (0.3 of 10 batches is 3, not 2.9999999999999996)
    if not taken:
        raise ConfigError(f"{key}={limit:g}: that share of the {what}'s {n} batches on this "
                          f"rank is less than one; raise it, or give a number of batches "
                          f"({key}=1)")
    return taken

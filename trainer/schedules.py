"""Learning-rate schedules stepped once per optimizer step (not per micro-batch).

`sched` configs are `_partial_: true` nodes. The trainer calls them with the optimizer and,
when the callable accepts it, `total_steps` (the run's optimizer steps), so both these
schedules and torch's own (`torch.optim.lr_scheduler.StepLR`, ...) plug in by `_target_`.
"""
from __future__ import annotations

import inspect
import math
import weakref
from typing import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from trainer.config import ConfigError


def _check_warmup(warmup_steps: int) -> None:
    if not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ConfigError(f"sched.warmup_steps={warmup_steps}: must be an integer >= 0")


def warmup_cosine(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0,
                  min_lr_ratio: float = 0.0) -> LambdaLR:
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_lr_ratio` x lr."""
    _check_warmup(warmup_steps)
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ConfigError(f"sched.min_lr_ratio={min_lr_ratio}: must be in [0, 1]")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


class WarmupConstant(LambdaLR):
    """LambdaLR with a linear warmup, then a constant factor of 1. After the warmup a step only
    counts (`last_epoch`): the learning rates are already the base ones, and recomputing them
    every step is host work a plain loop with a constant lr does not do."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int):
        self.warmup_steps = warmup_steps
        super().__init__(optimizer, lambda s: (s + 1) / warmup_steps if s < warmup_steps
                         else 1.0)

    def state_dict(self) -> dict:
        # the warmup length is this run's config (the schedule's shape follows the config on
        # resume), not state to restore
        return {k: v for k, v in super().state_dict().items() if k != "warmup_steps"}

    def step(self, epoch=None) -> None:
        if epoch is None and self.last_epoch >= self.warmup_steps:
            self.last_epoch += 1
            self._step_count += 1
            return
        super().step(epoch)


def constant(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """Constant lr after an optional linear warmup."""
    del total_steps  # accepted for a uniform call signature
    _check_warmup(warmup_steps)
    return WarmupConstant(optimizer, warmup_steps)


# the schedules `build` gave the run's own step count: their length is the run's
_SPAN_THE_RUN: "weakref.WeakSet[LRScheduler]" = weakref.WeakSet()


def spans_the_run(scheduler: LRScheduler) -> bool:
    """Whether `build` made `scheduler` with the run's own step count (a schedule of the
    run's progress, not of a step count of one's own such as StepLR's step_size)."""
    return scheduler in _SPAN_THE_RUN


def move_to(scheduler: LRScheduler, step: int) -> bool:
    """Puts `scheduler` at step `step` of its schedule, with the optimizer's learning rates
    as its formula gives them there; False, changing nothing, where it has no formula of the
    step (a schedule chained step to step: SequentialLR, MultiplicativeLR, one of one's own)."""
    if not isinstance(scheduler, LRScheduler):
        return False
    before = scheduler.last_epoch
    scheduler.last_epoch = step
    if isinstance(scheduler, LambdaLR):
        lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    elif hasattr(scheduler, "_get_closed_form_lr"):  # (torch's StepLR, CosineAnnealingLR...)
        lrs = scheduler._get_closed_form_lr()
    else:
        scheduler.last_epoch = before
        return False
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return True


def build(factory: Callable[..., LRScheduler], optimizer: Optimizer,
          total_steps: int) -> LRScheduler:
    """Calls a scheduler factory, passing `total_steps` only if it takes that argument (and
    the config did not set it: then it must be the run's); checks that the loop can step
    what it made."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    given = getattr(factory, "keywords", {}).get("total_steps")
    if given is not None and given < total_steps:  # (more is the user's choice: a cycle the
        # run stops inside, as a fast dev run or a limited run does)
        raise ConfigError(f"sched.total_steps={given}: this run takes {total_steps} optimizer "
                          "steps, and a schedule stepped past its total fails; leave the key "
                          f"out (the run's own count is passed) or set it to {total_steps} or "
                          "more")
    if "total_steps" in params and given is None:
        scheduler = factory(optimizer, total_steps=total_steps)
        _SPAN_THE_RUN.add(scheduler)
    else:
        scheduler = factory(optimizer)
    _check_schedule_step(scheduler)
    return scheduler


def _check_schedule_step(scheduler: LRScheduler) -> None:
    """The loop calls `scheduler.step()` once per optimizer step, with no argument."""
    name = type(scheduler).__name__
    try:
        step = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):
        step = []
    needed = [p.name for p in step if p.default is p.empty
              and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if needed:
        raise ConfigError(f"sched: {name}.step() needs {', '.join(needed)} (a validation "
                          "metric, say), but the loop steps the schedule once per optimizer "
                          "step with no argument; use a schedule of the step count "
                          "(warmup_cosine, constant, step, or another LRScheduler)")
    step_size = getattr(scheduler, "step_size", 1)
    if isinstance(step_size, int) and step_size < 1:
        raise ConfigError(f"sched.step_size={step_size}: {name} needs at least 1 optimizer "
                          "step between decays")
    gamma = getattr(scheduler, "gamma", None)  # StepLR's, MultiStepLR's, ExponentialLR's factor
    if isinstance(gamma, (int, float)) and not (0 < gamma < math.inf):
        # (a negative factor trained at a negative lr every other decay, and diverged, exit 0)
        raise ConfigError(f"sched.gamma={gamma}: {name} multiplies the lr by it; it must be a "
                          "number > 0 (0.1 to 0.5 are usual decays)")

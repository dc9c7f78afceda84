"""The training loss's bookkeeping, kept off the hot path: no device operation per micro-batch.

The loop needs three things from the losses it computes: the logging window's mean loss, the
run of optimizer steps whose loss was not finite (the guard that stops a diverged run), and,
for accumulation, the weight of each micro-batch. A plain loop does none of this; done with a
few tensor operations per micro-batch it cost more host time than the rest of a tiny step's
bookkeeping together. So `Ledger.add` only keeps the micro-batch's (detached) mean loss and
notes its count, no device operation at all; `fold`, at logging boundaries and whenever the
guard's answer is needed (checkpoints), reads them to the host in one stacked copy and does
the rest in Python: one device operation and the boundary's one host sync, where working it
out on the device took some twenty small operations (on a CPU step of 0.7 ms, logging every
50 steps, about 1% of the run). Long windows are compacted on the device as they go (a stack
every 256 micro-batches, no sync).
"""
from __future__ import annotations

import itertools
import math
from typing import Any, List, Optional, Tuple, Union

import torch

from trainer import distributed
from trainer.task import TaskError

Count = Union[int, torch.Tensor]
FOLD_AFTER = 256  # micro-batches kept as separate tensors before they are stacked


def counted(loss: torch.Tensor, count: Count) -> torch.Tensor:
    """`loss * count` in fp32, and 0 for a micro-batch with nothing to count (all padding),
    whose mean loss may be NaN (0 / 0): kept on the device, no host sync."""
    if isinstance(count, torch.Tensor):
        return torch.where(count > 0, loss.float() * count, 0.0)
    return loss.float() * count if count else torch.zeros_like(loss, dtype=torch.float32)


def window_factor(total: Count, base: int, world: int,
                  device: torch.device) -> Optional[Union[float, torch.Tensor]]:
    """What the window's accumulated gradients are multiplied by before the optimizer step,
    or None when that is 1.

    Every micro-batch contributed `mean loss x count / base` (`base` = per-rank batch size x
    micro-batches in the window, the same on every rank), and DDP averaged over ranks, so
    `base x world / global total` makes each counted unit weigh 1 / (the window's count over
    all ranks): one batch of all of them. One process with host counts needs no collective
    and, for full windows of samples, no multiplication at all. Otherwise the total is a
    device tensor summed over ranks (one tiny all-reduce per step, no host sync), so every
    rank multiplies its identical averaged gradients by the identical factor.
    """
    if world == 1 and not isinstance(total, torch.Tensor):
        return None if total == base else (base / total if total else 0.0)
    if isinstance(total, torch.Tensor):
        total = total.to(device, torch.float32, non_blocking=True)
    else:  # made on the device by a fill kernel, not copied from the host
        total = torch.full((), float(total), device=device)
    return base * world / distributed.all_reduce_sum(total).clamp(min=1)


class Ledger:
    """Mean losses and counts of the micro-batches since the last `fold`, by optimizer step.

    `add` per micro-batch, `end_step` per optimizer step; `fold` (at step boundaries) adds
    them to `loss_sum` (the window's sum of loss x count, reset by `take_loss_sum`) and
    updates `bad_run`, the optimizer steps in a row, up to the last one, whose loss was not
    finite. Both are host numbers; a micro-batch with a count of 0 (all padding) weighs 0,
    its mean NaN or not.
    """

    def __init__(self, device: torch.device, copy: bool = False, task: Optional[Any] = None):
        self.device, self.task = device, task  # (the task: named where a count goes wrong)
        # a loss that lives in a CUDA-graph pool (the output of a model compiled with CUDA
        # graphs: task=model_loss) is overwritten by the next replay: kept as a copy then
        self.copy = copy
        self.losses: List[torch.Tensor] = []  # 0-d, detached: nothing copied per micro-batch
        self.counts: List[Count] = []  # ... and their counts (host ints or device tensors)
        self.stacked: List[Tuple[torch.Tensor, torch.Tensor]] = []  # compacted (losses, counts)
        self.step_of: List[int] = []  # every recorded micro-batch's step since the last fold
        self.steps = 0
        self.loss_sum = 0.0
        self.bad_run = 0
        # optimizer steps since the latest folded one whose micro-batch counted 0 units with
        # a loss that was not finite, after a step whose loss was (a loss of one's own
        # dividing by its count: 0 / 0, whose NaN gradients a weight of 0 does not take
        # away, on weights that were not NaN before); None for none
        self.empty_nan_ago: Optional[int] = None

    def add(self, loss: torch.Tensor, count: Count) -> None:
        """Records a micro-batch's mean loss (a 0-d tensor) and what it averages over."""
        self.losses.append(loss.detach().clone() if self.copy else loss.detach())
        self.counts.append(count)
        self.step_of.append(self.steps)

    def end_step(self) -> None:
        self.steps += 1
        if len(self.losses) >= FOLD_AFTER:  # long logging windows: bounded memory, no sync
            self.stacked.append((torch.stack(self.losses), self._counts(self.counts)))
            self.losses, self.counts = [], []

    def _counts(self, counts: List[Count]) -> Union[List[int], torch.Tensor]:
        """Host counts as they are; counts with device tensors among them stacked on the
        device (host ints made there by a fill kernel, not copied from the host)."""
        if all(type(c) is int for c in counts):
            return counts
        return torch.stack([c.to(torch.float64) if isinstance(c, torch.Tensor) else
                            torch.full((), float(c), dtype=torch.float64, device=self.device)
                            for c in counts])

    def fold(self) -> None:
        """Moves the recorded micro-batches of completed steps into `loss_sum` and
        `bad_run`: one copy to the host of every loss and device count (a sync on a GPU), the
        rest in Python."""
        k = self.steps
        done = sum(1 for s in self.step_of if s < k)  # the completed steps' micro-batches
        n = done - sum(len(losses) for losses, _ in self.stacked)  # ... of them not stacked
        if done == 0:
            return
        parts = self.stacked + ([(torch.stack(self.losses[:n]), self._counts(self.counts[:n]))]
                                if n else [])
        on_device = [t for losses, counts in parts for t in (losses, counts)
                     if isinstance(t, torch.Tensor)]
        flat = iter((on_device[0] if len(on_device) == 1 else  # the one copy
                     torch.cat([t.to(torch.float64) for t in on_device])).tolist())
        values: List[float] = []
        counts: List[float] = []
        for losses, part_counts in parts:
            values += itertools.islice(flat, len(losses))
            counts += (part_counts if isinstance(part_counts, list)
                       else itertools.islice(flat, len(losses)))
        wrong = next((c for c in counts if c < 0), None)
        if wrong is not None:  # (the first batch's count is checked: a later one, read here)
            name = type(self.task).__name__
            raise TaskError(
                f"task {getattr(self.task, 'label', name)}: {name}.count(batch) returned "
                f"{wrong:g} for a training batch after the first ones; expected the units its "
                "loss averages over, 0 or more (a negative count turns the gradient around)")
        per_step = [0.0] * k
        empty = []
        for value, count, step in zip(values, counts, self.step_of):
            if count:  # a count of 0 weighs 0, even a NaN mean (0 / 0)
                per_step[step] += value * count
            elif not math.isfinite(value):
                empty.append(step)
        # (one after a non-finite step is the NaN weights', not their cause)
        empty = [s for s in empty if (math.isfinite(per_step[s - 1]) if s else not self.bad_run)]
        if empty:
            self.empty_nan_ago = k - 1 - empty[-1]
        elif self.empty_nan_ago is not None:
            self.empty_nan_ago += k
        self.loss_sum += sum(per_step)
        trailing = 0  # the steps after the last finite one
        for loss in reversed(per_step):
            if math.isfinite(loss):
                break
            trailing += 1
        self.bad_run = self.bad_run + k if trailing == k else trailing
        # an unfinished step's micro-batches stay, renumbered as the first step of the next fold
        self.losses, self.counts, self.stacked = self.losses[n:], self.counts[n:], []
        self.step_of, self.steps = [s - k for s in self.step_of[done:]], 0

    def take_loss_sum(self) -> float:
        """The window's loss sum (folded first); starts the next window at 0."""
        self.fold()
        total, self.loss_sum = self.loss_sum, 0.0
        return total

"""The training loss's bookkeeping, kept off the hot path: no device operation per micro-batch.

The loop needs three things from the losses it computes: the logging window's mean loss, the
run of optimizer steps whose loss was not finite (the guard that stops a diverged run), and,
for accumulation, the weight of each micro-batch. A plain loop does none of this; done with a
few tensor operations per micro-batch it cost more host time than the rest of a tiny step's
bookkeeping together. So `Ledger.add` only keeps the micro-batch's (detached) mean loss and
notes its count, no device operation at all; `fold` stacks them and turns them into the
window's loss sum and the non-finite run with a handful of vectorised operations, at logging
boundaries and whenever the guard's answer is needed. No host sync anywhere.
"""
from __future__ import annotations

from typing import List, Optional, Union

import torch

from trainer import distributed

Count = Union[int, torch.Tensor]
FOLD_AFTER = 256  # micro-batches kept before a fold at the next step's end


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
    finite. Both are 0-d device tensors.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.losses: List[torch.Tensor] = []  # 0-d, detached: nothing copied per micro-batch
        self.counts: List[Count] = []
        self.step_of: List[int] = []  # for each loss, its step's number since the last fold
        self.steps = 0
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        self.bad_run = torch.zeros((), dtype=torch.int64, device=device)

    def add(self, loss: torch.Tensor, count: Count) -> None:
        """Records a micro-batch's mean loss (a 0-d tensor) and what it averages over."""
        self.losses.append(loss.detach())
        self.counts.append(count)
        self.step_of.append(self.steps)

    def end_step(self) -> None:
        self.steps += 1
        if len(self.losses) >= FOLD_AFTER:  # long logging windows: bounded memory
            self.fold()

    def fold(self) -> None:
        """Moves the recorded micro-batches (of completed steps) into `loss_sum` and
        `bad_run`: a few device operations, no host sync."""
        k, dev = self.steps, self.device
        n = sum(1 for s in self.step_of if s < k)  # the completed steps' micro-batches
        if n == 0:
            return
        losses, counts = torch.stack(self.losses[:n]), self.counts[:n]
        if all(type(c) is int and c == counts[0] for c in counts):
            weights = counts[0]  # one count for all (a full window's samples): a scalar
        elif all(type(c) is int for c in counts):
            weights = torch.tensor(counts, dtype=torch.float32).to(dev, non_blocking=True)
        else:
            weights = torch.stack([torch.as_tensor(c, device=dev) for c in counts])
        contrib = counted(losses, weights)  # elementwise: a count of 0 weighs 0, NaN or not
        self.loss_sum += contrib.sum()
        if n == k:  # one micro-batch per step
            per_step = contrib
        else:
            step_of = torch.tensor(self.step_of[:n], dtype=torch.int64).to(dev, non_blocking=True)
            per_step = torch.zeros(k, device=dev).index_add_(0, step_of, contrib)
        # the steps after the last finite one; all k on top of the earlier run if none was
        trailing = (~torch.isfinite(per_step)).flip(0).cumprod(0).sum()
        self.bad_run = torch.where(trailing == k, self.bad_run + k, trailing)
        # an unfinished step's micro-batches stay, renumbered as the first step of the next fold
        self.losses, self.counts = self.losses[n:], self.counts[n:]
        self.step_of, self.steps = [s - k for s in self.step_of[n:]], 0

    def take_loss_sum(self) -> torch.Tensor:
        """The window's loss sum (folded first); starts the next window at 0."""
        self.fold()
        total, self.loss_sum = self.loss_sum, torch.zeros_like(self.loss_sum)
        return total

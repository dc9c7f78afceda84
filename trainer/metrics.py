"""Metrics the built-in tasks use by default. Any `torchmetrics.Metric` works as a task metric
(`task.metrics.<name>._target_=...`); this module adds only what the default jobs need.

`Accuracy` keeps two counters on the device and sums them over ranks in `compute()`; with the
evaluation sampler's disjoint shards (every validation sample on exactly one rank) the result is
the accuracy over the whole validation set, on any world size. It is written here rather than
taken from torchmetrics because importing torchmetrics costs 1-3 s of start-up (it imports its
text metrics and, when installed, transformers): a run that names no torchmetrics metric never
imports it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from trainer import distributed


class Accuracy(nn.Module):
    """Top-1 accuracy over the last dimension of the predictions: (batch, classes) logits for
    classifiers, (batch, tokens, vocabulary) for language models. Positions whose target equals
    `ignore_index` (padding, usually -100) are left out of both the hits and the count, so a
    language model's accuracy is per counted token. Needs no `num_classes`.

    The torchmetrics protocol: `update(preds, target)`, `compute()` (the value over every rank's
    updates), `reset()`, `higher_is_better`.
    """

    higher_is_better = True

    def __init__(self, ignore_index: Optional[int] = None):
        super().__init__()
        self.ignore_index = ignore_index
        # [hits, counted], summed on the device: no host sync per update
        self.register_buffer("sums", torch.zeros(2, dtype=torch.int64), persistent=False)

    def reset(self) -> None:
        self.sums.zero_()

    @torch.no_grad()
    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if preds.shape[:-1] != target.shape:
            raise ValueError(f"predictions {tuple(preds.shape)} do not fit targets "
                             f"{tuple(target.shape)} (expected (..., classes) and (...))")
        hits = preds.argmax(dim=-1) == target
        if self.ignore_index is None:
            self.sums[0] += hits.sum()
            self.sums[1] += target.numel()
        else:
            valid = target != self.ignore_index  # masks, no indexing: no host sync
            self.sums[0] += (hits & valid).sum()
            self.sums[1] += valid.sum()

    def compute(self) -> torch.Tensor:
        """Hits over counted positions of every rank (a collective under DDP: every rank
        calls it)."""
        sums = distributed.all_reduce_sum(self.sums.clone())
        return (sums[0].double() / sums[1].clamp(min=1)).float()

"""Metrics the built-in tasks use by default. Any `torchmetrics.Metric` works as a task metric
(`task.metrics.<name>._target_=...`); this module adds only what torchmetrics lacks.

torchmetrics keeps each metric's state as sums on the device and, when `compute()` runs in a
distributed job, gathers the states of every rank first; with the evaluation sampler's disjoint
shards (every validation sample on exactly one rank) the result is the metric over the whole
validation set, on any world size.
"""
from __future__ import annotations

from typing import Optional

import torch
from torchmetrics import Metric


class Accuracy(Metric):
    """Top-1 accuracy over the last dimension of the predictions: (batch, classes) logits for
    classifiers, (batch, tokens, vocabulary) for language models. Positions whose target equals
    `ignore_index` (padding, usually -100) are left out of both the hits and the count, so a
    language model's accuracy is per counted token.

    torchmetrics' MulticlassAccuracy wants `num_classes` and the class dimension second; this one
    needs neither, so it fits any classifier or token model as it comes.
    """

    higher_is_better = True
    is_differentiable = False
    full_state_update = False

    def __init__(self, ignore_index: Optional[int] = None, **kwargs):
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("correct", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("total", default=torch.zeros((), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        hits = preds.argmax(dim=-1) == target
        if self.ignore_index is None:
            self.correct += hits.sum()
            self.total += target.numel()
        else:
            valid = target != self.ignore_index  # masks, no indexing: no host sync
            self.correct += (hits & valid).sum()
            self.total += valid.sum()

    def compute(self) -> torch.Tensor:
        return self.correct.float() / self.total.clamp(min=1)

"""Test-only components, reachable by `_target_` from a real `python train.py` process."""
from __future__ import annotations

import os

from data.datasets import DigitsDataset


class FailingOnRankDigits(DigitsDataset):
    """Digits whose `fail_index`-th sample raises on rank `fail_rank` (of a torchrun job)."""

    def __init__(self, split: str = "train", fail_rank: int = 1, fail_index: int = 0, **kw):
        super().__init__(split, **kw)
        self.armed = split == "train" and int(os.environ.get("RANK", "0")) == fail_rank
        self.fail_index = fail_index
        self.seen = 0

    def __getitem__(self, i):
        self.seen += 1
        if self.armed and self.seen > self.fail_index:
            raise RuntimeError(f"injected failure on rank {os.environ.get('RANK')}")
        return super().__getitem__(i)


class NaNAfterMLP(__import__("trainer.models", fromlist=["MLP"]).MLP):
    """An MLP whose training forward returns NaN logits from its `nan_after`-th call on."""

    def __init__(self, *args, nan_after: int = 10, **kwargs):
        super().__init__(*args, **kwargs)
        self.nan_after, self.calls = nan_after, 0

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls > self.nan_after:
                out = out * float("nan")
        return out

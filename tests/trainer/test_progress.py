"""trainer/progress.py: an epoch's micro-batches grouped into optimizer steps."""
from __future__ import annotations

from trainer.progress import window_plan


def test_window_plan_groups_micro_batches_into_optimizer_steps():
    # 50 samples, batch 16 -> 16, 16, 16, 2; accumulation 3 -> windows [16,16,16] and [2]
    assert window_plan(50, 16, drop_last=False, limit=None, accumulate=3) == [3, 1]
    assert window_plan(40, 16, drop_last=False, limit=None, accumulate=2) == [2, 1]
    assert window_plan(40, 16, drop_last=True, limit=None, accumulate=2) == [2]
    assert window_plan(1000, 16, drop_last=False, limit=3, accumulate=2) == [2, 1]

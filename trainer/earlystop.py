"""trainer.early_stopping: a run that stops once its monitored metric stops improving.

It watches `trainer.checkpoint.monitor` (the run's one monitored value, which best.pt keeps)
in that key's direction, counts the validations since the last improvement larger than
`min_delta`, and ends the run after `patience` of them. Validation results are all-reduced,
so every rank decides alike without a collective of its own. The count travels in every
checkpoint: a resumed run goes on counting, and a run that stopped is complete (a requeued
job trains nothing; a larger patience, or 0, trains on).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

from trainer.callbacks import Callback


def improves(value: float, best: Optional[float], mode: Optional[str],
             min_delta: float = 0.0) -> bool:
    """Whether `value` beats `best` by more than `min_delta` in `mode` (max or min); a value
    that is not a number never does (every comparison with nan is false: a first nan would
    have stayed the best for the whole run)."""
    return math.isfinite(value) and (best is None or (
        value > best + min_delta if mode == "max" else value < best - min_delta))


class EarlyStopping(Callback):
    """Ends the run after `patience` validations in which `monitor` did not improve on its
    best by more than `min_delta` (`mode`: max or min)."""

    def __init__(self, monitor: str, mode: str, patience: int, min_delta: float = 0.0):
        self.monitor, self.mode = monitor, mode
        self.patience, self.min_delta = patience, min_delta
        self.best: Optional[float] = None
        self.best_step = -1
        self.waited = 0  # validations since the best one

    def after_epoch(self, loop, val: Optional[Dict[str, float]]) -> None:
        if not val or self.monitor not in val:
            return
        value = val[self.monitor]
        if improves(value, self.best, self.mode, self.min_delta):
            self.best, self.best_step, self.waited = value, loop.state.step, 0
        else:  # (a value that is not a number never improves)
            self.waited += 1

    def should_stop(self, loop) -> Optional[str]:
        if self.waited < self.patience:
            return None
        since = ("no finite value yet" if self.best is None else
                 f"not improved on {self.best:.6g} (step {self.best_step})")
        by = f" by more than {self.min_delta:g}" if self.min_delta else ""
        return (f"{self.monitor} has {since}{by} in trainer.early_stopping.patience="
                f"{self.patience} validations" + (" (NaN or inf in the validation data, or a "
                                                  "metric that computes none?)"
                                                  if self.best is None else ""))

    def state_dict(self) -> Dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best": self.best,
                "best_step": self.best_step, "waited": self.waited}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Goes on counting where the checkpoint's run left off, for the same key and
        direction (another monitor starts afresh)."""
        if (state.get("monitor"), state.get("mode")) == (self.monitor, self.mode):
            self.best, self.best_step = state.get("best"), int(state.get("best_step", -1))
            self.waited = int(state.get("waited", 0))

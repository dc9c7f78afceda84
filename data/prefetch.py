"""Moving batches to the training device.

`to_device` walks nested batches (tensors inside tuples, lists and dicts; anything else is
passed through) and copies tensors with `non_blocking=True`, which overlaps the copy with
host work when the source is pinned and is a plain copy otherwise.
"""
from __future__ import annotations

from typing import Any

import torch


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """The same structure as `batch` with every tensor on `device`; identity when already there."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device, non_blocking)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch

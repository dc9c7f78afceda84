"""data.cache=lru: samples kept as they are made, in each loader worker, the most recently
used up to data.cache_mb (nothing made ahead, nothing written; data/cache.py chooses it)."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset


def _sample_bytes(sample: Any) -> int:
    if isinstance(sample, torch.Tensor):
        return sample.element_size() * sample.nelement() + 64
    if isinstance(sample, dict):
        return sum(_sample_bytes(v) for v in sample.values()) + 64
    if isinstance(sample, (list, tuple)):
        return sum(_sample_bytes(v) for v in sample) + 64
    if isinstance(sample, np.ndarray):
        return sample.nbytes + 64
    return 64


class LRUCache(Dataset):
    """`dataset`'s samples as they are made, the most recently used up to `max_bytes` (tensor
    bytes plus a small per-object allowance) in each process: every loader worker holds its
    own. A sample bigger than the whole budget is passed through uncached."""

    def __init__(self, dataset: Dataset, max_bytes: int):
        self.dataset, self.max_bytes = dataset, max_bytes
        self.collate_fn = getattr(dataset, "collate_fn", None)
        self._items: "OrderedDict[int, Tuple[Any, int]]" = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:  # classes, skipped(), ... of the dataset
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, i: int) -> Any:
        found = self._items.get(i)
        if found is not None:
            self._items.move_to_end(i)
            self.hits += 1
            return found[0]
        self.misses += 1
        sample = self.dataset[i]
        size = _sample_bytes(sample)
        if sample is not None and size <= self.max_bytes:
            self._items[i] = (sample, size)
            self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, freed) = self._items.popitem(last=False)
                self.bytes -= freed
        return sample

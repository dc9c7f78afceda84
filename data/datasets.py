"""Datasets. Each is built from config as `_target_(split="train" | "val", **params)`.

- DigitsDataset: scikit-learn's 8x8 handwritten digits (1797 real images shipped inside the
  package, so nothing is downloaded), split deterministically into train and val.
- SyntheticDataset: deterministic per index, learnable (class prototypes plus noise), any
  shape and class count, with an optional per-sample CPU cost that emulates heavy decoding.
"""
from __future__ import annotations

import time
from typing import Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

SPLITS = ("train", "val")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: must be one of {SPLITS}")


class DigitsDataset(Dataset):
    """scikit-learn digits as (1, 8, 8) float images in [0, 1] and int64 labels.

    The split is a fixed permutation (`split_seed`), independent of the training seed, so
    validation accuracy is comparable across runs.
    """

    def __init__(self, split: str = "train", val_fraction: float = 0.2, split_seed: int = 0):
        _check_split(split)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction}: must be in (0, 1)")
        from sklearn.datasets import load_digits  # imported here: only this dataset needs it

        bunch = load_digits()
        order = np.random.default_rng(split_seed).permutation(len(bunch.target))
        n_val = int(round(len(order) * val_fraction))
        idx = order[-n_val:] if split == "val" else order[:-n_val]
        images = bunch.images[idx].astype(np.float32) / 16.0
        self.x = torch.from_numpy(images).unsqueeze(1).contiguous()
        self.y = torch.from_numpy(bunch.target[idx].astype(np.int64))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def burn_cpu(ms: float) -> None:
    """Busy-waits `ms` milliseconds of CPU time, as decoding or augmenting a sample would."""
    if ms <= 0:
        return
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        pass


class SyntheticDataset(Dataset):
    """Sample i is a pure function of (seed, split, i): class prototype + Gaussian noise.

    `dtype="uint8"` yields images quantised to 0..255 (compact batches to be normalised on
    the device); `cost_ms` burns that much CPU per sample in `__getitem__`.
    """

    def __init__(self, split: str = "train", num_samples: int = 1024,
                 input_shape: Sequence[int] = (3, 32, 32), num_classes: int = 10,
                 noise: float = 1.0, cost_ms: float = 0.0, dtype: str = "float32",
                 seed: int = 0):
        _check_split(split)
        if dtype not in ("float32", "uint8"):
            raise ValueError(f"dtype={dtype!r}: must be 'float32' or 'uint8'")
        if num_samples < 1:
            raise ValueError(f"num_samples={num_samples}: must be >= 1")
        self.num_samples, self.shape = num_samples, tuple(input_shape)
        self.num_classes, self.noise, self.cost_ms = num_classes, noise, cost_ms
        self.dtype, self.seed = dtype, seed
        # torch's CPU generator keeps 32 bits of a seed: mix (seed, split) into that range
        self.stream = ((seed * 2 + SPLITS.index(split)) * 0x85EBCA77) & 0xFFFFFFFF
        gen = torch.Generator().manual_seed(seed)
        self.prototypes = torch.randn((num_classes, *self.shape), generator=gen)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        burn_cpu(self.cost_ms)
        # odd multiplier: distinct seeds for distinct indices of one split
        gen = torch.Generator().manual_seed((i * 0x9E3779B1 + self.stream) & 0xFFFFFFFF)
        y = int(torch.randint(self.num_classes, (1,), generator=gen))
        x = self.prototypes[y] + self.noise * torch.randn(self.shape, generator=gen)
        if self.dtype == "uint8":
            x = (x * 32 + 128).clamp_(0, 255).to(torch.uint8)
        return x, torch.tensor(y)

"""Datasets. Each is built from config as `_target_(split="train" | "val", **params)`.

- DigitsDataset: scikit-learn's 8x8 handwritten digits (1797 real images shipped inside the
  package, so nothing is downloaded), split deterministically into train and val.
- SyntheticDataset: deterministic per index, learnable (class prototypes plus noise), any
  shape and class count, with an optional per-sample CPU cost that emulates heavy decoding
  (conf/data/heavy.yaml: the classic loader benchmark's 1024 x 3x224x224, 5 ms a sample).
- SyntheticTokens: token sequences from a fixed random successor table with a little noise,
  for the language model (inputs are tokens 0..n-1, targets tokens 1..n).
- MemmapDataset: .npy arrays written once by scripts/prepare_data.py, memory-mapped lazily
  in each worker.
"""
from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path
from typing import Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from data.imagefiles import check_split_seed
from trainer.config import first_line

SPLITS = ("train", "val")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: must be one of {SPLITS}")


def load_digits_arrays() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (1797, 8, 8) float64 pixel values 0..16 and int64 labels.

    Read from the data file scikit-learn ships (the same file `sklearn.datasets.load_digits`
    reads) without importing scikit-learn, whose import costs about a second of start-up;
    `load_digits` itself is the fallback when the file is not where it used to be.
    """
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    folder = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations \
        else None
    path = None if folder is None else Path(folder) / "datasets" / "data" / "digits.csv.gz"
    if path is not None and path.is_file():
        data = np.loadtxt(path, delimiter=",")
        return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target.astype(np.int64)


class DigitsDataset(TensorDataset):
    """scikit-learn digits as (1, 8, 8) float images in [0, 1] and int64 labels.

    The split is a fixed permutation (`split_seed`), independent of the training seed, so
    validation accuracy is comparable across runs. A TensorDataset: its samples are rows of two
    tensors, so the trainer can keep it on the training device (`data.placement`).
    """

    def __init__(self, split: str = "train", val_fraction: float = 0.2, split_seed: int = 0):
        _check_split(split)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction}: must be in (0, 1)")
        check_split_seed(split_seed)
        images, target = load_digits_arrays()
        order = np.random.default_rng(split_seed).permutation(len(target))
        n_val = int(round(len(order) * val_fraction))
        if not 0 < n_val < len(order):  # (rounded: 0.9999 of 1797 leaves no training sample)
            raise ValueError(f"val_fraction={val_fraction}: leaves "
                             f"{'no validation' if n_val == 0 else 'no training'} sample of "
                             f"the {len(order)}")
        idx = order[-n_val:] if split == "val" else order[:-n_val]
        x = torch.from_numpy(images[idx].astype(np.float32) / 16.0).unsqueeze(1).contiguous()
        super().__init__(x, torch.from_numpy(target[idx]))
        self.x, self.y = self.tensors


def burn_cpu(ms: float) -> None:
    """Spends `ms` milliseconds of this thread's CPU time, as decoding or augmenting would.

    CPU time, not wall time: more workers than cores then slow down as real decoding does.
    """
    if ms <= 0:
        return
    end = time.thread_time() + ms / 1000.0
    while time.thread_time() < end:
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


class SyntheticTokens(Dataset):
    """Sample i is a pure function of (seed, split, i): `tokens + 1` tokens where each next
    token is `successor[previous]` (one fixed random permutation of the vocabulary) or, with
    probability `noise`, a uniformly random one. Returns (sequence[:-1], sequence[1:]), int64.

    A model that learns the successor table reaches about 1 - noise next-token accuracy.
    """

    def __init__(self, split: str = "train", num_samples: int = 1024, tokens: int = 128,
                 vocab_size: int = 256, noise: float = 0.1, seed: int = 0):
        _check_split(split)
        if num_samples < 1 or tokens < 1 or vocab_size < 2:
            raise ValueError(f"num_samples={num_samples}, tokens={tokens}, "
                             f"vocab_size={vocab_size}: need >= 1, >= 1 and >= 2")
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise={noise}: must be in [0, 1]")
        gen = torch.Generator().manual_seed(seed)
        successor = torch.randperm(vocab_size, generator=gen)
        gen.manual_seed((seed * 2 + SPLITS.index(split) + 1) * 0x85EBCA77 & 0xFFFFFFFF)
        seq = torch.empty(num_samples, tokens + 1, dtype=torch.int64)
        seq[:, 0] = torch.randint(vocab_size, (num_samples,), generator=gen)
        random = torch.randint(vocab_size, (num_samples, tokens), generator=gen)
        jump = torch.rand(num_samples, tokens, generator=gen) < noise
        for t in range(tokens):  # vectorised over samples; sequential only along time
            seq[:, t + 1] = torch.where(jump[:, t], random[:, t], successor[seq[:, t]])
        self.seq = seq

    def __len__(self) -> int:
        return len(self.seq)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        row = self.seq[i]
        return row[:-1], row[1:]


_FAULT_AROUND = max(mmap.PAGESIZE, 65536)  # Linux's default fault_around_bytes


class NpyRows:
    """Rows of a .npy file, memory-mapped lazily in each process that reads them.

    Nothing is mapped until the first row is read, and a process that inherits the object
    (a forked worker) maps the file anew, so workers never copy the data. Each row is copied
    out and its pages are dropped from this process's mapping (MADV_DONTNEED): the bytes stay
    in the shared page cache, and a worker's resident memory stays flat however much it reads.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        with open(self.path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                self.shape, fortran, self.dtype = read_header(f)
            except ValueError as e:  # numpy's words name neither the file nor a way out
                raise ValueError(f"{self.path}: not a .npy array ({first_line(e)}); "
                                 "write it again with scripts/prepare_data.py") from None
            self.offset = f.tell()
        if self.dtype.hasobject:  # pickled objects: no fixed row size to map
            raise ValueError(f"{self.path}: an array of Python objects ({self.dtype}); store "
                             "numbers (np.save of a numeric array)")
        if fortran:
            raise ValueError(f"{self.path}: Fortran-ordered arrays are not supported")
        self.row_items = int(np.prod(self.shape[1:], dtype=np.int64))
        self.row_bytes = self.row_items * self.dtype.itemsize
        size, needed = os.path.getsize(self.path), self.offset + self.shape[0] * self.row_bytes
        if size < needed:  # read lazily, a short file would fail in a worker, mid-epoch
            raise ValueError(f"{self.path}: {size} bytes where its header describes {needed} "
                             "(a truncated file?); write it again with scripts/prepare_data.py")
        self._mm: Optional[mmap.mmap] = None
        self._pid = -1

    def __len__(self) -> int:
        return self.shape[0]

    def tensor(self) -> torch.Tensor:
        """Every row as one tensor over a copy-on-write mapping of the file: nothing is read
        until it is used, and nothing written to it reaches the file."""
        return torch.from_numpy(np.memmap(self.path, dtype=self.dtype, mode="c",
                                          offset=self.offset, shape=tuple(self.shape)))

    def __getstate__(self):
        return {**self.__dict__, "_mm": None, "_pid": -1}  # never ship a mapping

    def _map(self) -> mmap.mmap:
        if self._mm is None or self._pid != os.getpid():
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._pid = os.getpid()
        return self._mm

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.shape[0]:
            raise IndexError(i)
        mm = self._map()
        start = self.offset + i * self.row_bytes
        row = np.frombuffer(mm, self.dtype, self.row_items, start).reshape(self.shape[1:]).copy()
        # the kernel maps up to 64 KiB around a faulting page ("fault-around"), so drop the
        # whole 64 KiB-aligned window, or neighbours' pages would pile up in this process
        lo = start - start % _FAULT_AROUND
        hi = min(len(mm), -(-(start + self.row_bytes) // _FAULT_AROUND) * _FAULT_AROUND)
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        return row


class MemmapDataset(Dataset):
    """(input, target) pairs from `<root>/<split>/x.npy` and `y.npy`, as written by
    scripts/prepare_data.py (or the shm cache). Inputs keep their stored dtype."""

    def __init__(self, split: str = "train", root: str = "data_cache"):
        _check_split(split)
        folder = Path(root) / split
        if not (folder / "x.npy").is_file() or not (folder / "y.npy").is_file():
            raise FileNotFoundError(f"data.dataset.root={root}: no {split}/x.npy and "
                                    f"{split}/y.npy there; write them with "
                                    "scripts/prepare_data.py")
        self.x, self.y = NpyRows(folder / "x.npy"), NpyRows(folder / "y.npy")
        if len(self.x) != len(self.y):
            raise ValueError(f"{folder}: x.npy has {len(self.x)} rows, y.npy {len(self.y)}")
        meta = Path(root) / "meta.json"  # an image folder's class names, when prepared from one
        record = json.loads(meta.read_text()) if meta.is_file() else {}
        self.classes = record.get("classes") if isinstance(record, dict) else None
        shape = record.get("input_shape") if isinstance(record, dict) else None
        if isinstance(shape, list) and list(self.x.shape[1:]) != shape:
            # (arrays rewritten by hand: the run trained on one size and validated on another)
            raise ValueError(f"{folder / 'x.npy'}: its samples are {tuple(self.x.shape[1:])}, "
                             f"and {meta} says input_shape {shape}; write the dataset again "
                             "with scripts/prepare_data.py")

    def __len__(self) -> int:
        return len(self.x)

    def fingerprint(self) -> str:
        """What identifies the samples: the arrays' files (paths, sizes, times), so that a
        disk cache of them is rebuilt when they are written again (a cache keyed by the
        config alone kept serving the rows of arrays prepare_data.py had since rewritten)."""
        stamps = [(str(Path(p).resolve()), os.stat(p)) for p in (self.x.path, self.y.path)]
        return repr([(p, st.st_size, st.st_mtime_ns) for p, st in stamps])

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.x[i]), torch.from_numpy(self.y[i])

    def as_tensors(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """(x, y) as memory-mapped tensors whose row i is sample i, for batching by indexing
        (data/resident.py); None when a subclass makes its samples otherwise."""
        if type(self).__getitem__ is not MemmapDataset.__getitem__ or \
                type(self).__len__ is not MemmapDataset.__len__:
            return None
        return self.x.tensor(), self.y.tensor()


def read_meta(root: str) -> dict:
    """The `meta.json` that scripts/prepare_data.py writes beside the arrays."""
    path = Path(root) / "meta.json"
    if not path.is_file():
        what = ("no such folder" if not Path(root).exists() else
                "a file, not the folder scripts/prepare_data.py writes" if not Path(root).is_dir()
                else "no meta.json in that folder")
        raise FileNotFoundError(f"data.dataset.root={root}: {what}; write the dataset with "
                                "scripts/prepare_data.py")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e}); write the dataset again with "
                         "scripts/prepare_data.py") from None

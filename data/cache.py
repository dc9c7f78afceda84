"""Materialising a dataset once: to .npy files (disk or /dev/shm) or into memory.

Decoding, augmenting or generating a sample every epoch is work the CPU repeats for nothing
when the result is the same each time. `write_arrays` runs a dataset once, in parallel
through a DataLoader, and stores inputs and targets as .npy arrays that MemmapDataset reads
back; `cache_dataset` applies the `data.cache` setting to a freshly built dataset.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from data.datasets import MemmapDataset
from trainer.config import ConfigError

SHM_ROOT = Path("/dev/shm")
OWNER = "owner.json"  # who wrote a /dev/shm cache: see reclaim_shm


def _pairs(dataset: Dataset, num_workers: int, batch_size: int = 256):
    # its own generator: materialising data must not draw from the global RNG
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                        generator=torch.Generator().manual_seed(0))
    for batch in loader:
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2
                and all(isinstance(t, torch.Tensor) for t in batch)):
            raise ConfigError("data.cache and scripts/prepare_data.py need a dataset of "
                              "(input, target) tensor pairs; use data.cache=none for other "
                              "samples")
        yield batch


def write_arrays(dataset: Dataset, folder: Path, num_workers: int = 0) -> Tuple[int, ...]:
    """Writes `folder/x.npy` and `folder/y.npy` (row i = sample i) without holding the whole
    dataset in memory; returns the input shape. Files appear under their names only once
    complete (written as .tmp, then renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    n = len(dataset)
    x_out = y_out = None
    row = 0
    for x, y in _pairs(dataset, num_workers):
        if x_out is None:
            x_out = np.lib.format.open_memmap(folder / "x.npy.tmp", mode="w+",
                                              dtype=x.numpy().dtype, shape=(n, *x.shape[1:]))
            y_out = np.lib.format.open_memmap(folder / "y.npy.tmp", mode="w+",
                                              dtype=y.numpy().dtype, shape=(n, *y.shape[1:]))
        x_out[row:row + len(x)] = x.numpy()
        y_out[row:row + len(y)] = y.numpy()
        row += len(x)
    if x_out is None:
        raise ValueError("cannot cache an empty dataset")
    shape = tuple(x_out.shape[1:])
    for arr, name in ((x_out, "x.npy"), (y_out, "y.npy")):
        arr.flush()
        del arr
        os.replace(folder / f"{name}.tmp", folder / name)
    return shape


def _in_memory(dataset: Dataset, num_workers: int) -> TensorDataset:
    xs, ys = zip(*_pairs(dataset, num_workers))
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def _in_shm(dataset: Dataset, key: str, local_rank: int, num_workers: int,
            wait: Callable[[], None], owner: Optional[dict]) -> MemmapDataset:
    """One copy per node in /dev/shm: local rank 0 writes it while the other ranks wait."""
    root = SHM_ROOT / f"stoker-{key}"
    if local_rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        # the owner first: a later run reclaims the folder once this process is gone, even
        # after a SIGKILL that skips the atexit clean-up below
        (root / OWNER).write_text(json.dumps(owner or {}))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        write_arrays(dataset, root / "train", num_workers)  # "train" is MemmapDataset's layout
    wait()
    return MemmapDataset("train", str(root))


def reclaim_shm(alive: Callable[[dict], bool], root: Path = SHM_ROOT) -> List[Path]:
    """Removes the /dev/shm caches whose owner process is gone (`alive(owner)` is False);
    returns them. Folders without an owner record are left alone."""
    gone = []
    for folder in root.glob("stoker-*"):
        try:
            who = json.loads((folder / OWNER).read_text())
        except (OSError, ValueError):
            continue
        if not alive(who):
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder)
    return gone


def cache_dataset(dataset: Dataset, mode: str, tag: str, local_rank: int = 0,
                  num_workers: int = 0, wait: Callable[[], None] = lambda: None,
                  owner: Optional[dict] = None) -> Dataset:
    """`dataset` as `data.cache` says: unchanged ("none"), materialised in this process's
    memory ("memory"), or in node-shared memory under /dev/shm ("shm").

    `tag` names the cached data, the same on every rank of a job and different between jobs
    (the trainer uses its run dir, dataset config and split); `wait` blocks until every rank
    got there (the job's barrier), so no rank reads /dev/shm before local rank 0 wrote it.
    """
    if mode == "none":
        return dataset
    if mode == "memory":
        return _in_memory(dataset, num_workers)
    key = hashlib.sha1(tag.encode()).hexdigest()[:16]
    return _in_shm(dataset, key, local_rank, num_workers, wait, owner)

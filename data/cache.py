"""Materialising a dataset once, or caching its samples as they are made.

Decoding, augmenting or generating a sample every epoch is work the CPU repeats for nothing
when the result is the same each time. `data.cache` picks where the results are kept:

- `memory`: the whole dataset, made once (in parallel through a DataLoader) into a
  TensorDataset in the training process, which the trainer can then keep on the device;
- `shm`: the same as .npy arrays in /dev/shm, one copy per node, removed when the job ends
  (a sweep's job too: release_shm);
- `disk`: the same as .npy arrays under `data.cache_dir`, kept between runs, keyed by the
  dataset's config and (when it has one) its `fingerprint()` (an image folder's file names,
  sizes and times), so a changed config or changed files get a new cache;
- `lru`: samples kept as they are made, by each loader worker, up to `data.cache_mb` MB per
  worker (least recently used out first): nothing is made ahead, nothing is written.

`write_arrays` is also what scripts/prepare_data.py writes with; MemmapDataset reads back.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from data.advice import count_of
from data.cachewait import (WRITER, _await, _disk_writer_state, _reclaim_tmp, _writer_state,
                            keep_record, mark_failed)
from data.datasets import MemmapDataset
from data.loader import Unbatchable, readable
from data.lrucache import LRUCache
from trainer.config import ConfigError, first_line

log = logging.getLogger("stoker")
SHM_ROOT = Path("/dev/shm")
OWNER = "owner.json"  # who wrote a /dev/shm cache: see reclaim_shm
FAILED = "failed.txt"  # a failed write's line for the ranks waiting for it (cachewait.mark_failed)


def pair_batches(dataset: Dataset, num_workers: int, batch_size: int = 256):
    """The dataset's samples as batches of (inputs, targets) tensors, for writing as arrays or
    shards; any other sample (dicts, string labels, a third item) is one ConfigError saying
    what its batches hold."""
    # its own generator: materialising data must not draw from the global RNG; the dataset's
    # own collate (an image folder's leaves out the files it skipped)
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                        generator=torch.Generator().manual_seed(0),
                        collate_fn=getattr(dataset, "collate_fn", None))
    batches = readable(iter(loader), workers=num_workers > 0)  # a worker's error in one line
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Unbatchable as e:  # (its advice, data.collate_fn, does not reach the cache)
            raise ConfigError(f"{_NEEDS}: {str(e).removeprefix('data: ').split('; ')[0]}; "
                              "use data.cache=none for other samples") from None
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2
                and all(isinstance(t, torch.Tensor) for t in batch)):
            raise ConfigError(f"{_NEEDS}, not samples that batch to {_held(batch)}; use "
                              "data.cache=none for other samples")
        yield batch


_NEEDS = ("data.cache and scripts/prepare_data.py need a dataset of (input, target) tensor "
          "pairs, which the default collate batches")


def _held(batch: Any) -> str:
    """What a batch holds, briefly: `dict(image, label)`, `list(Tensor, Tensor, list)`."""
    if isinstance(batch, dict):
        return "dict(" + ", ".join(map(str, batch)) + ")"
    if isinstance(batch, (list, tuple)):
        return f"{type(batch).__name__}(" + ", ".join(type(v).__name__ for v in batch) + ")"
    return type(batch).__name__


def write_arrays(dataset: Dataset, folder: Path, num_workers: int = 0) -> Tuple[int, ...]:
    """Writes `folder/x.npy` and `folder/y.npy` (row i = sample i) without holding the whole
    dataset in memory; returns the input shape. Files appear under their names only once
    complete (written as .tmp, then renamed)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return _write_arrays(dataset, folder, num_workers)
    except BaseException:
        for name in ("x.npy", "y.npy"):  # nothing half-written is left
            for suffix in (".tmp", ".short"):
                (folder / f"{name}{suffix}").unlink(missing_ok=True)
        raise


def _write_arrays(dataset: Dataset, folder: Path, num_workers: int) -> Tuple[int, ...]:
    n = len(dataset)
    x_out = y_out = None
    row = 0
    for x, y in pair_batches(dataset, num_workers):
        if x_out is None:
            x_out = _open_reserved(folder / "x.npy.tmp", x.numpy().dtype, (n, *x.shape[1:]))
            y_out = _open_reserved(folder / "y.npy.tmp", y.numpy().dtype, (n, *y.shape[1:]))
        x_out[row:row + len(x)] = x.numpy()
        y_out[row:row + len(y)] = y.numpy()
        row += len(x)
    if x_out is None or row == 0:
        raise _nothing_read(n)
    shape = tuple(x_out.shape[1:])
    for arr, name in ((x_out, "x.npy"), (y_out, "y.npy")):
        arr.flush()
        if row < n:  # samples were skipped (unreadable files): keep the rows written
            short = _open_reserved(folder / f"{name}.short", arr.dtype, (row, *arr.shape[1:]))
            short[:] = arr[:row]
            short.flush()
            del short
            os.replace(folder / f"{name}.short", folder / f"{name}.tmp")
        del arr
        os.replace(folder / f"{name}.tmp", folder / name)
    return shape


def _open_reserved(path: Path, dtype, shape: Tuple[int, ...]) -> np.memmap:
    """A new .npy file mapped for writing, its blocks reserved on disk first: a mapping over
    a sparse file that the disk cannot fill kills the process with SIGBUS at the first write
    past the free space, where a reservation fails at once with an error naming the file."""
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    try:
        with open(path, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        return array
    except OSError as e:
        why = e.strerror
    del array  # (unmapped before the caller removes the file)
    size = np.dtype(dtype).itemsize * int(np.prod(shape)) / 2**20
    raise OSError(f"{path.parent}: cannot reserve {size:.1f} MB for "
                  f"{path.name.split('.npy')[0]}.npy: {why}")


def _nothing_read(n: int) -> ConfigError:
    return ConfigError(f"data: nothing to cache or pack: none of the dataset's {n} samples "
                       "could be read (every file unreadable? the warnings above name them)")


def _in_memory(dataset: Dataset, num_workers: int) -> TensorDataset:
    pairs = list(pair_batches(dataset, num_workers))
    if sum(len(y) for _, y in pairs) == 0:
        raise _nothing_read(len(dataset))
    xs, ys = zip(*pairs)
    return TensorDataset(torch.cat(xs), torch.cat(ys))


def _write_marked(dataset: Dataset, folder: Path, num_workers: int, failed: Path,
                  owner: Optional[dict]) -> None:
    """write_arrays, leaving `failed` (the error's one line) for the waiting ranks if it fails."""
    try:
        write_arrays(dataset, folder, num_workers)
    except BaseException as e:
        mark_failed(failed, first_line(e), owner)
        raise


def _in_shm(dataset: Dataset, key: str, local_rank: int, num_workers: int,
            wait: Callable[[], None], owner: Optional[dict], alive: Callable[[dict], bool],
            start_s: float) -> MemmapDataset:
    """One copy per node in /dev/shm: local rank 0 writes it while the other ranks wait."""
    root = SHM_ROOT / f"stoker-{key}"
    done, failed = root / "train" / "y.npy", root / FAILED  # y.npy: renamed in last
    if local_rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        failed.unlink(missing_ok=True)
        # the owner first: a later run reclaims the folder once this process is gone, even
        # after a SIGKILL that skips the atexit clean-up below
        (root / OWNER).write_text(json.dumps(owner or {}))
        _MADE.append((root, failed))  # removed at the job's end (release_shm) or at exit
        atexit.register(_remove_shm, root, failed)
        # (MemmapDataset's layout)
        _write_marked(dataset, root / "train", num_workers, failed, owner)
    else:
        _await(done, failed, f"data.cache=shm in {root}",
               lambda: _writer_state(root / OWNER, owner, alive), start_s, owner)
    wait()
    return MemmapDataset("train", str(root))


# the /dev/shm copies this process wrote for its current job
_MADE: List[Tuple[Path, Path]] = []


def release_shm() -> None:
    """Removes the /dev/shm copies this process wrote, at its job's end: a sweep's jobs run
    one after another in one process, and each kept its copy (a dataset's size in memory)
    until the whole sweep ended. (The other ranks on the node are past their last read by
    then; a rank's loader workers keep their open arrays after the files go.)"""
    while _MADE:
        _remove_shm(*_MADE.pop())


def _remove_shm(root: Path, failed: Path) -> None:
    """The node's copy, at exit. After a failed write only the arrays go: the error's line
    and the owner stay for the ranks still waiting to read it (the folder is reclaimed with
    the other dead runs' once the owner is gone, reclaim_shm)."""
    if not failed.exists():
        shutil.rmtree(root, ignore_errors=True)
        return
    _strip(root)  # (at exit again after release_shm: the line and owner left)


def _strip(root: Path) -> bool:
    """Removes a /dev/shm cache's data, leaving its owner record and a failed write's line;
    whether it had any data. (Raises OSError when the folder is gone.)"""
    data = [path for path in root.iterdir() if path.name not in (OWNER, FAILED)]
    for path in data:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return bool(data)


def _on_disk(dataset: Dataset, cache_dir: Path, key: str, describe: str, local_rank: int,
             num_workers: int, wait: Callable[[], None], owner: Optional[dict],
             alive: Callable[[dict], bool], start_s: float) -> MemmapDataset:
    """`cache_dir/<key>/`, written once and kept: local rank 0 of each node writes it unless it
    is there, into a folder of its own renamed into place when complete (a node that loses the
    race on a shared file system drops its copy); the other ranks wait for it."""
    root = cache_dir / key
    done, failed = root / "done.json", cache_dir / f"{key}.failed-{socket.gethostname()}"
    writer = cache_dir / WRITER.format(key=key, host=socket.gethostname(), pid=os.getpid())
    reused = False
    if local_rank == 0 and not done.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        _reclaim_tmp(cache_dir, FAILED_KEEP_S)
        failed.unlink(missing_ok=True)
        if root.exists() and not done.is_file():  # (a write is renamed into place whole,
            # done.json in it: not ours, or cut since; the whole set was decoded again, then
            # the rename failed on it. Asked again: another node may have just renamed its own)
            incomplete = ConfigError(f"data.cache=disk: the cache {root} is incomplete (no "
                                     "done.json, which a finished write leaves in it); delete "
                                     "that folder and the next run writes it again")
            mark_failed(failed, str(incomplete), owner)
            raise incomplete
        tmp = cache_dir / f"{key}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        writer.write_text(json.dumps(owner or {}))
        try:
            _write_marked(dataset, tmp / "train", num_workers, failed, owner)
            skipped = getattr(dataset, "skipped", None)  # unreadable files, left out
            record = {"dataset": describe, "skipped": skipped() if callable(skipped) else []}
            (tmp / "done.json").write_text(json.dumps(record, indent=2) + "\n")
            try:
                os.rename(tmp, root)  # atomic: `root` only ever appears complete
                log.info("data.cache=disk: wrote %s in %.1f s", root,
                         time.perf_counter() - start)
            except OSError:
                if not done.is_file():  # not another node's finished copy: say so
                    raise
                log.info("data.cache=disk: %s was written by another run meanwhile; using "
                         "that copy", root)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # ours alone
            writer.unlink(missing_ok=True)
    elif local_rank == 0:
        log.info("data.cache=disk: reusing %s", root)
        reused = True
    else:
        _await(done, failed, f"data.cache=disk in {root}",
               lambda: _disk_writer_state(cache_dir, key, owner, alive), start_s, owner)
    wait()
    # every rank reads the same files to the same verdict: a damaged cache is refused by all
    # of them here, after the barrier, not by local rank 0 alone while the others wait in it
    try:
        left_out = json.loads(done.read_text()).get("skipped") or []
        cached = MemmapDataset("train", str(root))
    except (OSError, ValueError, AttributeError) as e:  # (a ConfigError: the folder's checks)
        raise _damaged(root, e) from None
    if reused and left_out:  # said again on every run that uses the cache, not only the first
        log.warning("data.cache=disk: %s left out when %s was written, e.g. %s",
                    count_of(len(left_out), "unreadable file", was=True), root,
                    ", ".join(left_out[:3]))
    return cached


_PACKED_WAY_OUT = re.compile(r";\s*write (it again|them) with scripts/prepare_data\.py")


def _damaged(root: Path, e: BaseException) -> ConfigError:
    """A disk cache whose files were changed or cut after it was written."""
    reason = first_line(e)
    reason = _PACKED_WAY_OUT.sub("", reason)  # (a packed array's own way out: not this)
    return ConfigError(f"data.cache=disk: the cache {root} is damaged ({type(e).__name__}: "
                       f"{reason[:200]}); delete that folder and the next run writes it again")


def cache_key(tag: str, dataset: Dataset) -> str:
    """A short key for `tag` and the dataset's fingerprint (when it has one)."""
    fingerprint = getattr(dataset, "fingerprint", None)
    text = tag + "|" + (fingerprint() if callable(fingerprint) else "")
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# how long the few bytes a waiting rank reads stay after their writer is gone: a failed
# write's line, a killed writer's record (data/cachewait.py's keep_record)
FAILED_KEEP_S = 3600.0


def reclaim_shm(alive: Callable[[dict], bool], root: Path = SHM_ROOT) -> List[Path]:
    """Frees the /dev/shm caches whose owner process is gone (`alive(owner)` is False);
    returns those it freed. Their data goes at once; their owner record and a failed write's
    line (a few bytes) stay for FAILED_KEEP_S after that (or after the failure): the job's
    other ranks may still be on their way to read them (another job on the node starting
    meanwhile took the record of a writer killed mid-write, and they waited for one that
    never began). Folders without an owner record are left alone, and so is one whose
    record changed since it was read (a next attempt of its job began writing there)."""
    freed = []
    for folder in root.glob("stoker-*"):
        record, failed = folder / OWNER, folder / FAILED
        try:
            who = json.loads(record.read_text())
            if not isinstance(who, dict) or alive(who):  # (not a record of ours: left alone)
                continue
            if json.loads(record.read_text()) != who:
                continue
            if _strip(folder):
                os.utime(record)  # (its while runs from now: keep_record)
                freed.append(folder)
            elif not keep_record(failed if failed.exists() else record, FAILED_KEEP_S):
                shutil.rmtree(folder, ignore_errors=True)
                freed.append(folder)
        except (OSError, ValueError):  # (gone meanwhile: another run's reclaim took it)
            continue
    return freed


def cache_dataset(dataset: Dataset, mode: str, tag: str, local_rank: int = 0,
                  num_workers: int = 0, wait: Callable[[], None] = lambda: None,
                  owner: Optional[dict] = None, cache_dir: str = "data_cache/auto",
                  cache_mb: float = 1024.0, alive: Callable[[dict], bool] = lambda who: True,
                  start_s: float = 0.0) -> Dataset:
    """`dataset` as `data.cache` says (module doc): unchanged ("none"), "memory", "shm",
    "disk" or "lru".

    `tag` names the cached data, the same on every rank of a job (the trainer uses its run
    dir, the data config and the split; for "disk" the data config and split only, so that
    later runs find it); `wait` blocks until every rank got there (the job's barrier), so no
    rank reads a shared cache before local rank 0 wrote it. The ranks that wait for local
    rank 0's shm or disk copy stop (WriterGone) when the writer `owner` records (who this
    process is: its launch) is gone by `alive`, or has not begun within `start_s` seconds.
    """
    if mode == "none":
        return dataset
    if mode == "memory":
        return _in_memory(dataset, num_workers)
    if mode == "lru":
        return LRUCache(dataset, int(cache_mb * 2**20))
    key = cache_key(tag, dataset)
    if mode == "disk":
        return _on_disk(dataset, Path(cache_dir), key, tag, local_rank, num_workers, wait,
                        owner, alive, start_s)
    return _in_shm(dataset, key, local_rank, num_workers, wait, owner, alive, start_s)

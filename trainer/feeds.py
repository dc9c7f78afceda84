"""Datasets to per-rank feeds: build the datasets, apply the cache, place them, build loaders.

`build_feeds` is the one place that decides, per split, where the data lives and how batches
are formed (README "The input pipeline"):

- `data.placement=device` (what `auto` picks for a set of tensors within the budget): the
  tensors go to the training device once and batches are formed by indexing
  (data/resident.py); no loader workers, no collate, no per-step host-to-device copy;
- `host`: a DataLoader with `data.num_workers` workers (`auto`: 0 for tensors already in
  memory, where workers only add inter-process copies, else the node's CPUs shared among its
  ranks) behind the device prefetcher.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from data.cache import cache_dataset, reclaim_shm
from data.advice import count_of
from data.sampler import repeats_left
from data.loader import build_loader
from data.prefetch import DeviceAugment, DevicePrefetcher, InputTransform
from data.images import SkipCollate
from data.resident import gathers, nbytes, rows_of, tensors_of
from data.shards import ShardStream
from trainer import components, distributed, runlock
from trainer.config import ConfigError, cpu_workers
from trainer.distributed import DistEnv

# the share of a GPU's free memory that device placement may take for one split
FREE_MEMORY_SHARE = 0.5
# dtypes that torch's index_select (how device batches are formed) has no kernel for
UNINDEXABLE = (torch.uint16, torch.uint32, torch.uint64)


def build_datasets(cfg: DictConfig) -> Tuple[Dataset, Optional[Dataset]]:
    """The train and val datasets the data config names (val may be None: no validation, also
    where trainer.limit_val_batches=0, which builds none)."""
    d = cfg.data
    splits = ("train",) if cfg.trainer.limit_val_batches == 0 else ("train", "val")
    if d.dataset is not None:
        target = components.target_of(d.dataset, "data.dataset")
        if not components.accepts(target, "split"):
            raise ConfigError(f"data.dataset: {d.dataset._target_} takes no split argument; "
                              "give data.train_dataset and data.val_dataset instead")
        if "split" in d.dataset:  # (instantiate's split=... would replace it unsaid)
            raise ConfigError(f"data.dataset.split={d.dataset.split}: data.dataset is built "
                              "twice, with split=train and split=val; leave the key out, or "
                              "give data.train_dataset and data.val_dataset")
        sets = [components.build(d.dataset, "data.dataset", split=s,
                                 hint="; data=custom starts from no dataset keys")
                if s in splits else None for s in ("train", "val")]
        keys = ("data.dataset",) * 2
    else:
        keys = ("data.train_dataset", "data.val_dataset")
        sets = [None if node is None or s not in splits else components.build(node, key)
                for node, key, s in zip((d.train_dataset, d.val_dataset), keys, ("train", "val"))]
    trained = None  # the training split's count of classes, where it names them
    if all(isinstance(ds, ShardStream) for ds in sets):
        _same_index(*sets)
    for ds, key in zip(sets, keys):
        if ds is None:
            continue
        if isinstance(ds, IterableDataset) or (hasattr(ds, "__iter__")
                                               and not hasattr(ds, "__len__")):
            raise ConfigError(f"{key}: {type(ds).__name__} is an iterable dataset; Stoker needs "
                              "a map-style dataset (__len__ and __getitem__) to shard it exactly "
                              "across ranks and resume mid-epoch")
        if not hasattr(ds, "__len__") or not (hasattr(ds, "__getitem__")
                                              or isinstance(ds, ShardStream)):
            raise ConfigError(f"{key}: {type(ds).__name__} is not a dataset: it needs __len__ "
                              "and __getitem__ (a map-style torch.utils.data.Dataset)")
        try:
            n = len(ds)
        except (TypeError, ValueError) as e:  # a __len__ that returns -1, None, ...
            raise ConfigError(f"{key}: {type(ds).__name__}.__len__() failed ({e}); it must "
                              "return the number of samples") from None
        if n == 0:  # (of data.dataset, built once per split: which split)
            split = f" split={'val' if ds is sets[1] else 'train'}" \
                if keys[0] == keys[1] else ""
            raise ConfigError(f"{key}: {type(ds).__name__}{split} has no samples")
        if not isinstance(ds, ShardStream):
            _order_fits(key, ds, n)
        classes = getattr(ds, "classes", None)  # an image folder's (shards': their index's)
        if not isinstance(classes, (list, tuple)):
            continue
        named = (f"{len(classes)} classes ({', '.join(map(str, classes[:5]))}"
                 f"{', ...' if len(classes) > 5 else ''})")
        if trained is not None and trained != len(classes):
            raise ConfigError(f"data: {key} (the validation split) has {named}, the training "
                              f"split {trained}; give both splits the same classes")
        trained = len(classes) if trained is None else trained
        if d.num_classes is not None and d.num_classes != len(classes):
            raise ConfigError(f"data.num_classes={d.num_classes}: {key} has {named}; leave the "
                              "key out to take its count")
        if d.num_classes is None:
            # a dataset of one's own that names its classes: the count the model and the
            # task read from data.num_classes (an image folder's config resolves it itself)
            if len(classes) < 2:
                raise ConfigError(f"data: {key} has {named}; a classifier needs 2 or more "
                                  "(task=regression for one real value)")
            d.num_classes = len(classes)
    return sets[0], sets[1]


ORDER_BYTES = 48  # a sample's share of an epoch's order: its index in a tensor, then a list
# of Python ints the sampler hands out (40 bytes a sample measured)


def _order_fits(key: str, ds: Any, n: int) -> None:
    """A map-style set's epoch order fits in memory: the sampler draws a permutation of its
    whole length on every rank of the node (ORDER_BYTES a sample), so a `__len__` of 10**12
    (a stream's "endless" length) would fill the machine's memory before the first step,
    unsaid."""
    try:
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # a platform that does not say
        return
    ranks = distributed.detect().local_world_size
    need = ORDER_BYTES * n * ranks
    if need > have // 2:
        raise ConfigError(f"{key}: {type(ds).__name__} has {n:,} samples, whose shuffled order "
                          f"alone takes {need / 1e9:,.0f} GB"
                          + (f" for this node's {ranks} ranks" if ranks > 1 else "")
                          + f", more than half of this machine's {have / 1e9:,.0f} GB of "
                          "memory; check its __len__, or stream a set this size from shards "
                          "(data=shards, written by scripts/prepare_data.py --format shards)")


def _same_index(train: ShardStream, val: ShardStream) -> None:
    """A shard set's two splits describe the same samples: the val index.json's kind,
    classes and shapes are the train index's (a val split of fewer classes was blamed on
    data.num_classes, which the train index sets; of another count unnamed, accepted)."""
    for key in ("kind", "classes", "num_classes", "input_shape"):
        mine, theirs = getattr(val, key), getattr(train, key)
        if mine != theirs:
            raise ConfigError(
                f"data: {val.root}/{val.split}/index.json says {key} {json.dumps(mine)[:80]}, "
                f"{train.root}/{train.split}/index.json {json.dumps(theirs)[:80]}; write both "
                "splits with one scripts/prepare_data.py --format shards run")


def placement(d: DictConfig, dataset: Dataset, device: torch.device,
              has_collate: bool, reserved_mb: float = 0.0) -> Tuple[str, Optional[str]]:
    """(`device` or `host`, why not `device`) for one split on this rank, as `data.placement`
    asks; `build_feeds` agrees on it across ranks before anyone acts on it. `reserved_mb`:
    device memory an earlier split placed there will still take (its epoch's copy, made when
    it is first iterated), not free for this one."""
    if d.placement == "host":
        return "host", None
    tensors = tensors_of(dataset)
    # arrays mapped from files: on CPU too, reading them all is bounded by the budget
    mapped = tensors is None and (tensors := rows_of(dataset)) is not None
    why_not = None
    if has_collate and d.get("collate_fn"):  # (first: what one's own collate batches is not
        # rows anyway; a dataset's own, an image folder's, is said below)
        why_not = "data.collate_fn is set, and device batches are formed by indexing"
    elif tensors is None and isinstance(dataset, TensorDataset):
        why_not = (f"{type(dataset).__name__} overrides TensorDataset.__getitem__, so its "
                   "samples are not rows of its tensors")
    elif tensors is None:
        why_not = (f"{type(dataset).__name__} is not a set of tensors (a TensorDataset, "
                   "which data.cache=memory makes, or memory-mapped arrays: data=memmap, "
                   "data.cache=shm or disk)")
    elif has_collate:
        why_not = (f"{type(dataset).__name__} batches with a collate_fn of its own, and device "
                   "batches are formed by indexing")
    elif any(t.dtype in UNINDEXABLE for t in tensors):
        dtypes = sorted({str(t.dtype) for t in tensors if t.dtype in UNINDEXABLE})
        why_not = (f"its {'arrays' if mapped else 'tensors'} hold {', '.join(dtypes)}, which "
                   "index_select does not support (store int64, int32 or uint8)")
    elif device.type != "cpu" or mapped:  # on CPU tensors in memory stay where they are
        size = nbytes(tensors)
        size_mb = size / 2**20
        free_mb = (torch.cuda.mem_get_info(device)[0] / 2**20 - reserved_mb
                   if device.type == "cuda" else float("inf"))
        # an epoch's gathered copy doubles it (data/resident.py)
        needed_mb = size_mb * (2 if gathers(size, d.device_budget_mb) else 1)
        if needed_mb > FREE_MEMORY_SHARE * free_mb:
            copy = f" ({needed_mb:.1f} MB with an epoch's copy)" if needed_mb > size_mb else ""
            besides = f" besides {reserved_mb:.0f} MB for the training set's epoch copy" \
                if reserved_mb else ""
            why_not = (f"its {'arrays' if mapped else 'tensors'} take {size_mb:.1f} MB{copy}, "
                       "more than half of the "
                       f"{free_mb:.0f} MB free on {device}{besides}")
        elif d.placement == "auto" and size_mb > d.device_budget_mb:
            why_not = (f"its {'arrays' if mapped else 'tensors'} take {size_mb:.1f} MB > "
                       "data.device_budget_mb")
    return ("host", why_not) if why_not else ("device", None)


def _agreed(d: DictConfig, where: str, why_not: Optional[str], split: str,
            device: torch.device) -> str:
    """The placement every rank uses: `device` only where every rank can (free device memory
    differs between GPUs); `data.placement=device` that some rank cannot have fails on every
    rank alike, so none is left waiting in a collective."""
    if distributed.is_active():
        flag = torch.tensor([1.0 if where == "host" else 0.0], device=device)
        if distributed.all_reduce_max(flag).item() > 0 and where == "device":
            where, why_not = "host", "another rank cannot keep it on its device"
    if where == "host" and d.placement == "device":
        raise ConfigError(f"data.placement=device: the {split} set cannot be kept on the "
                          f"device: {why_not}; use data.placement=auto or host")
    return where


def _workers(d: DictConfig, dataset: Dataset, where: str, local_world_size: int) -> int:
    """Loader workers for one split: `data.num_workers`, with `auto` resolved."""
    if where == "device":
        return 0
    if d.num_workers == "auto" and tensors_of(dataset) is not None:
        return 0  # samples are rows of tensors in memory: workers would only copy them
    return cpu_workers(d, local_world_size)


def build_feeds(cfg: DictConfig, env: DistEnv, device: torch.device):
    """Per-rank train and val feeds (val None without a validation set): a DataLoader or a
    device-resident batcher, behind a DevicePrefetcher with the on-device transforms
    (augmentation on the training feed only); and a line per split for the log, which the
    caller writes once every check passed."""
    d = cfg.data
    _check_worker_count(d, env.local_world_size)
    collate = components.build_callable(d.collate_fn, "data.collate_fn")
    # (too_many_workers says it once, in a line naming the key)
    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    if env.local_rank == 0:  # caches of runs that died without cleaning up (SIGKILL)
        reclaim_shm(runlock.owner_alive)
    sources = build_datasets(cfg)
    streamed = any(isinstance(ds, ShardStream) for ds in sources)
    if d.collate_fn is not None and streamed:
        raise ConfigError("data.collate_fn: streamed shards (data=shards) are batched in the "
                          "loader workers by their own collate; set data.collate_fn=null")
    if d.cache != "none" and streamed:
        raise ConfigError(f"data.cache={d.cache}: streamed shards (data=shards) are read as "
                          "they come, not cached; use data.cache=none, or scripts/"
                          "prepare_data.py --format npy and data=memmap for data that fits")
    _check_cache_dir(d)
    # trainer.validate_only reads no training sample: that split is neither cached (a whole
    # decode of it, to validate) nor put on the device
    unread = "train" if cfg.trainer.validate_only else None
    sets = [None if ds is None else cache_dataset(
        ds, "none" if split == unread else d.cache, _cache_tag(cfg, split),
        local_rank=env.local_rank,
        num_workers=cpu_workers(d, env.local_world_size), wait=distributed.barrier,
        owner=runlock.owner(), cache_dir=d.cache_dir, cache_mb=d.cache_mb,
        alive=runlock.owner_alive, start_s=cfg.trainer.ddp.timeout_s)
        for ds, split in zip(sources, ("train", "val"))]
    # overfit mode repeats the same first batches every epoch, so no shuffling
    shuffle = False if cfg.trainer.overfit_batches else None
    feeds, lines = [], []
    reserved_mb = 0.0  # the epoch copies of splits already on the device, made when iterated
    for ds, source, split in zip(sets, sources, ("train", "val")):
        if ds is None:
            feeds.append(None)
            continue
        split_collate = collate_for(ds, collate)
        if split == unread:
            where, why_not = "host", None
        else:
            where, why_not = placement(d, ds, device, split_collate is not None, reserved_mb)
            where = _agreed(d, where, why_not, split, device)
        workers = _workers(d, ds, where, env.local_world_size)
        loader = build_loader(ds, d, train=split == "train", rank=env.rank,
                              world_size=env.world_size, seed=cfg.seed, device=device,
                              shuffle=shuffle, collate_fn=split_collate, num_workers=workers,
                              placement=where)
        if getattr(loader, "gathered", False):  # kept from epoch to epoch (data/resident.py)
            reserved_mb += nbytes(loader.tensors) / 2**20
        lines.append("data: " + describe_feed(split, ds, where, workers, device, d, why_not))
        if split == unread:
            lines[-1] = (f"data: {split} set: {count_of(len(ds), 'sample')}, not read "
                         "(trainer.validate_only)")
        elif d.cache != "none":
            lines[-1] += f"; data.cache={d.cache}" + (
                f" in {Path(ds.x.path).parents[1]}" if d.cache == "disk" else "")
        if split == "train":
            lines[-1] += repeated(len(ds), env.world_size, d.batch_size, d.drop_last)
        augment = DeviceAugment(d.augment.crop_padding, d.augment.hflip, cfg.seed, env.rank) \
            if split == "train" else None
        if augment:
            lines[-1] += (f"; augmented on the device (crop_padding={d.augment.crop_padding}, "
                          f"hflip={str(d.augment.hflip).lower()})")
        transform = InputTransform(d.normalize_mean, d.normalize_std, d.channels_last, augment,
                                   input_key=OmegaConf.select(cfg, "task.input_key"))
        feed = DevicePrefetcher(loader, device, transform, enabled=d.device_prefetch)
        feed.why_not_device = why_not  # for the stall advice
        feed.source = source  # the dataset as built (its classes, the files it skipped)
        feeds.append(feed)
    return feeds[0], feeds[1], lines


def _cache_tag(cfg: DictConfig, split: str) -> str:
    """What names a split's cached data: the data config (and, except for the disk cache,
    which later runs are meant to find, the run dir)."""
    d = cfg.data
    data = OmegaConf.to_container(d, resolve=True)
    mode = d.cache
    for key in ("batch_size", "eval_batch_size", "num_workers", "pin_memory",
                "prefetch_factor", "persistent_workers", "prefetch_next_epoch", "shuffle",
                "drop_last", "timeout",
                "multiprocessing_context", "device_prefetch", "placement", "device_budget_mb",
                "augment", "cache_dir", "cache_mb", "cache", "normalize_mean", "normalize_std",
                "channels_last", "collate_fn"):  # how it is fed, not what it holds
        data.pop(key, None)
    tag = f"{OmegaConf.to_yaml(OmegaConf.create(data))}|{split}"
    return tag if mode == "disk" else f"{cfg.run_dir}|{tag}"


def repeated(n: int, world_size: int, batch_size: int, drop_last: bool) -> str:
    """What the training log's data line adds where `n` samples do not share out evenly among
    the ranks and the sampler's padding keeps repeats (a rank's whole last batch: see
    data/sampler.py), so that an epoch's last step is not exactly one process's over the same
    samples."""
    kept = repeats_left(n, world_size, batch_size, drop_last)
    if not kept:
        return ""
    return (f"; {count_of(kept, 'sample')} repeated each epoch (as a rank's whole last batch, "
            f"so that every rank takes as many batches; the epoch's last step counts "
            f"{'it' if kept == 1 else 'them'} twice; another data.batch_size, or "
            "data.drop_last=true, which leaves samples out, avoids it)")


def describe_feed(split: str, dataset: Dataset, where: str, workers: int,
                  device: torch.device, d: DictConfig, why_not: Optional[str] = None) -> str:
    """One line for the log: where a split's data lives and how its batches are made (and,
    for tensors or arrays that auto placement left on the host, why)."""
    if where == "device":
        size = nbytes(rows_of(dataset)) / 2**20
        unused = (f"; data.num_workers={d.num_workers} is not used (data.placement=host for "
                  "loader workers)") if d.num_workers not in ("auto", 0) else ""
        what = "tensors" if tensors_of(dataset) is not None else "memory-mapped arrays"
        return (f"{split} set: {count_of(len(dataset), 'sample')}, {size:.1f} MB of {what} kept on "
                f"{device}, batched by indexing (data.placement={d.placement}){unused}")
    source = f"streamed from {count_of(len(dataset.urls), 'tar shard')} " \
        if isinstance(dataset, ShardStream) else ""
    why = f"; not batched on the device: {why_not}" \
        if why_not and d.placement != "host" and rows_of(dataset) is not None else ""
    return (f"{split} set: {count_of(len(dataset), 'sample')} {source}through a DataLoader with "
            f"{count_of(workers, 'worker')} (data.num_workers={d.num_workers}, "
            f"data.placement={d.placement}){why}")


def _check_worker_count(d: DictConfig, local_world_size: int) -> None:
    """A count of loader workers per rank no machine runs: 16 per CPU of the rank's share (64
    at least), four times what too_many_workers warns past. Each is a forked process holding
    its copy of the dataset: `data.num_workers=100000` (zeros too many) forked until the
    memory ran out, and the processes outlived the run that started them."""
    workers, cpus = cpu_workers(d, local_world_size), distributed.cpus_per_rank(local_world_size)
    most = max(16 * cpus, 64)
    if workers > most:
        raise ConfigError(f"data.num_workers={d.num_workers}: {workers} loader processes per rank "
                          f"for {count_of(cpus, 'CPU')}; at most {most} (16 per CPU, 64 at "
                          "least): each is a process holding its copy of the dataset; "
                          f"data.num_workers=auto gives "
                          f"{distributed.auto_num_workers(local_world_size)}")


def collate_for(dataset, collate):
    """The collate a loader of `dataset` uses: the dataset's own (an image folder's leaves
    out the files it skipped), with `collate` (data.collate_fn, built) given the samples
    that are there; `collate` alone for other datasets."""
    own = getattr(dataset, "collate_fn", None)
    if collate is None:
        return own
    return SkipCollate(own.shape, collate) if isinstance(own, SkipCollate) else collate


def _check_cache_dir(d: DictConfig) -> None:
    """data.cache=disk writes its folders into data.cache_dir: inside a folder the data reads
    (<root>/train, <root>/val; <root> itself for a folder of classes split by val_fraction),
    they become part of it (an image folder's class folders), and every later run fails. A
    hidden folder right under it (<root>/.cache) is never read as data."""
    if d.cache != "disk":
        return
    cache = os.path.realpath(d.cache_dir)
    for key in ("dataset", "train_dataset", "val_dataset"):
        root = OmegaConf.select(d, f"{key}.root", default=None)
        if not isinstance(root, str) or "://" in root:
            continue
        whole = OmegaConf.select(d, f"{key}.val_fraction", default=None) is not None
        for shown in ([root] if whole else [f"{root}/train", f"{root}/val"]):
            folder = os.path.realpath(shown)
            hidden = os.path.relpath(cache, folder).split(os.sep)[0]  # (".": the folder)
            if os.path.commonpath([cache, folder]) == folder and \
                    (hidden == "." or not hidden.startswith(".")):
                raise ConfigError(f"data.cache_dir={d.cache_dir}: inside {shown}, which "
                                  f"data.{key} reads, where the cache's folders would become "
                                  f"part of the data; put it outside (or in a hidden folder "
                                  f"such as {root}/.cache)")


def skipped_files(*feeds) -> List[str]:
    """The files these feeds' datasets skipped as unreadable (image folders and shards with
    on_error=skip), in the training process and its loader workers."""
    files: List[str] = []
    for feed in feeds:
        skipped = getattr(getattr(feed, "source", None), "skipped", None)
        if callable(skipped):
            files += skipped()
    return files

"""Data bigger than memory or local disk: samples streamed from tar shards (WebDataset format).

    python scripts/prepare_data.py --format shards --out shards/images data=image_folder \
        data.dataset.root=data_images
    python train.py data=shards data.dataset.root=shards/images model=cnn

A split is `<root>/<split>/index.json` (the shards, in order, with their sample counts) and the
tar shards it names (data/shardwriter.py writes both), read with WebDataset
(`webdataset.gopen`: local paths, `file:`, `http(s)://` through curl, `pipe:` commands such as
`pipe:aws s3 cp s3://bucket/x.tar -`; nothing is downloaded ahead). A sample is a group of tar
members sharing a key: `<key>.<image extension>` + `<key>.cls` (an image folder's files as they
were, decoded in the workers like `data=image_folder`) or `<key>.x.npy` + `<key>.y.npy` (any
dataset's tensors).

How an epoch is cut (`ShardPlan`, data/shardplan.py), all of it a pure function of (seed, epoch, world size,
rank, batch size, workers), so every rank agrees without talking:
- the shards' order is shuffled per epoch (the samples inside a shard keep theirs; prepare
  writes them in a shuffled order), giving one stream of N samples;
- training: rank r takes the contiguous positions [r n, (r + 1) n) of that stream, n = N / W
  rounded up (the stream then wraps round, repeating its first samples, as PyTorch's
  DistributedSampler pads) or down with data.drop_last; validation: rank r takes
  [N r / W, N (r + 1) / W), no padding, so every sample is evaluated exactly once;
- the rank's batches are split into one contiguous block per loader worker, so each worker
  reads a run of whole shards and only the shards at a block's ends partly; the DataLoader
  takes the workers' batches in turn, and each worker shuffles its samples within windows of
  `shuffle_buffer` (seeded per epoch, rank, worker and window).

Resume: the loop's position counts global samples (batches x batch size x ranks). With the same
world size, batch size and data.num_workers it is exact: each worker skips, without decoding,
the batches of its block already taken, and the workers are rotated so that the DataLoader's
turn order continues the interrupted one. With another world size or worker count the epoch
continues at the same position per rank, so samples near the cut may repeat or be missed until
the epoch ends.
"""
from __future__ import annotations

import io
import json
import logging
import math
import os
import posixpath
import re
import tarfile
import weakref
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from data.imagefiles import IMAGE_EXTENSIONS
from data.images import SkipCollate, Unreadable, decode, image_settings, unreadable_errors
from data.shardplan import ShardPlan
from trainer.config import ConfigError, first_line

INDEX = "index.json"
log = logging.getLogger("stoker")


def _open(url: str):
    from webdataset.gopen import gopen

    return gopen(url, "rb")


def _join(root: str, name: str) -> str:
    if "://" in name or name.startswith(("/", "pipe:", "file:")):
        return name
    return posixpath.join(root, name)


KINDS = ("image", "npy")  # what a shard's samples are: .jpg/.png + .cls, or x.npy + y.npy


def _check_index(index: Any, where: str) -> List[Dict]:
    """The shard list of an index.json, checked: {"shards": [{"url": ..., "samples": n >= 0},
    ...], "kind": image | npy, ...} as scripts/prepare_data.py writes it; one line naming
    `where` and what is wrong, else."""
    shards = index.get("shards") if isinstance(index, dict) else None
    if not isinstance(shards, list):
        raise ValueError(f"{where}: not a shard index (expected a JSON object whose \"shards\" "
                         "is a list of {\"url\", \"samples\"}; scripts/prepare_data.py --format "
                         "shards writes one)")
    for i, shard in enumerate(shards):
        count = shard.get("samples") if isinstance(shard, dict) else None
        if not isinstance(shard, dict) or not isinstance(shard.get("url"), str) or \
                not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"{where}: shards[{i}] is {json.dumps(shard)[:80]}; each shard "
                             "needs a \"url\" (a string) and a \"samples\" count (an integer "
                             ">= 0)")
    empty = next((i for i, shard in enumerate(shards) if shard["samples"] == 0), None)
    if empty is not None:  # (read as holding none: its samples were left out, unsaid)
        raise ValueError(f"{where}: shards[{empty}] ({json.dumps(shards[empty]['url'])[:80]}) "
                         "says 0 samples; list only shards that hold samples, with their "
                         "counts (scripts/prepare_data.py --format shards writes them)")
    first: Dict[str, int] = {}
    for i, shard in enumerate(shards):  # (a shard listed twice: its samples twice an epoch)
        j = first.setdefault(shard["url"], i)
        if j != i:
            raise ValueError(f"{where}: shards[{j}] and shards[{i}] are both "
                             f"{json.dumps(shard['url'])[:80]}; list each shard once")
    kind = index.get("kind", "image")
    if kind not in KINDS:
        raise ValueError(f"{where}: \"kind\": {json.dumps(kind)}; must be one of "
                         + ", ".join(KINDS))
    return shards


class ShardStream:
    """One split of a shard set: its index and how samples are decoded (module doc).

    `root`: the folder or URL prefix holding `<split>/index.json`; `size`/`resize`/`on_error`:
    as `data.images.ImageFolder` for image samples; `shuffle_buffer`: samples each worker
    shuffles together (1: none).
    """

    def __init__(self, split: str = "train", root: str = "shards", size: int = 224,
                 resize: Optional[int] = None, on_error: str = "skip",
                 shuffle_buffer: int = 1000):
        self.resize = image_settings(size, resize, on_error)
        if not isinstance(shuffle_buffer, int) or isinstance(shuffle_buffer, bool) or \
                shuffle_buffer < 1:
            raise ValueError(f"data.dataset.shuffle_buffer={shuffle_buffer}: must be a whole "
                             "number >= 1")
        self.split, self.root = split, root
        self.size, self.on_error, self.shuffle_buffer = size, on_error, shuffle_buffer
        folder = _join(root, split)
        try:
            with _open(_join(folder, INDEX)) as f:
                index = json.loads(f.read())
        except (OSError, ValueError) as e:
            arrays = os.path.isfile(os.path.join(root, split, "x.npy"))  # (npy's, not shards)
            raise FileNotFoundError(f"data.dataset.root={root}: " + (
                f"arrays ({split}/x.npy), which data=memmap reads" if arrays else
                f"cannot read {split}/{INDEX} ({e}); write shards with "
                "scripts/prepare_data.py --format shards")) from None
        shards = _check_index(index, f"data.dataset.root={root}: {split}/{INDEX}")
        self.urls = [_join(folder, s["url"]) for s in shards]
        self.counts = [s["samples"] for s in shards]
        self.kind = index.get("kind", "image")
        self.classes = index.get("classes")
        self.num_classes = index.get("num_classes")
        self.input_shape = index.get("input_shape")
        if not self.urls or sum(self.counts) == 0:
            raise ValueError(f"data.dataset.root={root}: {split}/{INDEX} lists no samples")
        self.collate_fn = SkipCollate((3, size, size)) if self.kind == "image" \
            else default_collate
        # flags by key (stream positions as prepare writes them), a byte each, for the first
        # 64 Mi samples (beyond them: warned each time, not counted)
        self.unreadable = Unreadable(on_error, min(len(self), 2**26), "sample", "samples")

    def skipped(self) -> List[str]:
        """The samples skipped so far (by key), in this process and its workers."""
        return [f"{self.split} sample {k:09d}" for k in self.unreadable.indices()]

    def __len__(self) -> int:
        return sum(self.counts)

    def samples_in(self, order: Sequence[int], start: int, stop: int) -> Iterator[Dict]:
        """The raw samples (dicts of tar member bytes by extension, with __key__ and __url__)
        at stream positions [start, stop) of the shards taken in `order`; positions past the
        end wrap round to the beginning."""
        n = len(self)
        edges = np.cumsum([0] + [self.counts[s] for s in order])
        pos = start
        while pos < stop:
            p = pos % n
            k = int(np.searchsorted(edges, p, side="right")) - 1
            shard, offset = order[k], p - int(edges[k])
            take = min(self.counts[shard] - offset, stop - pos)
            yield from self._read(self.urls[shard], offset, take, self.counts[shard])
            pos += take

    def _read(self, url: str, skip: int, take: int, count: int) -> Iterator[Dict]:
        """Samples [skip, skip + take) of the shard at `url`, which its index says holds
        `count`. A read that reaches the shard's end by its index looks one sample further:
        a shard holding more than its index says (written again after the index) fails in
        one line rather than training on part of it unsaid."""
        from webdataset.tariterators import group_by_keys, tar_file_expander, url_opener

        samples = group_by_keys(tar_file_expander(url_opener([{"url": url}])))
        got, more, i = 0, False, -1
        try:
            for i, sample in enumerate(samples):
                if i < skip:
                    continue
                if got == take:  # (only reached when the read ends at the shard's end)
                    more = True
                    break
                yield sample
                got += 1
                if got == take and skip + take < count:
                    return
        except (tarfile.TarError, OSError, ValueError) as e:  # damaged, cut short, missing
            reason = first_line(e)
            # nothing came from an address (curl's empty stream: a wrong host, a network down)
            remote = url.startswith(("http://", "https://", "pipe:")) and i < 0
            fix = ("is the address right, and reachable from this machine? (the same command "
                   "with curl, or the pipe's own, says more)" if remote else
                   "write it again (scripts/prepare_data.py --format shards) or remove it from "
                   "its index.json")
            raise ConfigError(f"data: shard {url} cannot be read ({type(e).__name__}: "
                              f"{reason}); {fix}") from None
        if more:
            raise ConfigError(f"data: shard {url} holds more samples than the {count} its "
                              "index says (written after its index.json?); write the set again "
                              "(scripts/prepare_data.py --format shards) or correct its count")
        if got < take:
            raise ConfigError(f"data: shard {url} ended after {skip + got} samples; its "
                              f"index says {skip + take} or more (a truncated shard?)")

    def decode(self, sample: Dict) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """A raw sample as (input, target); None for an unreadable image with on_error=skip."""
        if self.kind == "npy":
            return self._arrays(sample)
        ext = next((e for e in (x.lstrip(".") for x in IMAGE_EXTENSIONS) if e in sample), None)
        where = f"{sample.get('__url__')}:{sample.get('__key__')}" + (
            f" ({sample['path'].decode()})" if "path" in sample else "")  # the file it was
        try:
            if ext is None or "cls" not in sample:
                raise ValueError(f"no image or no .cls member (has {sorted(sample)})")
            text = sample["cls"].decode(errors="replace").strip()
            if not re.fullmatch(r"-?[0-9]+", text):
                raise ValueError(f"its .cls member holds {text[:20]!r}, not a class index")
            image = decode(io.BytesIO(sample[ext]), self.size, self.resize, name=where)
        except unreadable_errors() as e:
            key = sample.get("__key__", "")
            self.unreadable.handle(e, int(key) if key.isdigit() else None, where)
            return None
        return image, torch.tensor(int(text))

    def _arrays(self, sample: Dict) -> Tuple[torch.Tensor, torch.Tensor]:
        """An npy sample's (x, y) arrays; a member missing or not an array is one line naming
        the shard, the sample and the member (a machine-written set: damaged, as a shard that
        cannot be read is, whatever data.dataset.on_error says)."""
        arrays = []
        for member in ("x.npy", "y.npy"):
            data = sample.get(member)
            try:
                if data is None:
                    has = sorted(k for k in sample if not k.startswith("__"))
                    raise ValueError(f"no {member} member (it has {', '.join(has)})")
                if not data.startswith(b"\x93NUMPY"):
                    raise ValueError(f"its {member} member is not a .npy array (no NumPy header)")
                arrays.append(torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False)))
            except (ValueError, OSError, EOFError) as e:
                reason = first_line(e)
                raise ConfigError(f"data: shard {sample.get('__url__')}: sample "
                                  f"{sample.get('__key__')} cannot be read ({reason}); write the "
                                  "set again (scripts/prepare_data.py --format shards)") from None
        return arrays[0], arrays[1]


class _Epoch(IterableDataset):
    """What each loader worker runs for one pass: its block of the rank's batches, shuffled
    within windows, decoded and collated into batches."""

    def __init__(self, stream: ShardStream, plan: ShardPlan):
        self.stream, self.workers = stream, plan.workers
        self.order = plan.shard_order(len(stream.urls))
        self.lo, self.hi = plan.rank_range()
        self.batch = plan.batch_size
        self.blocks = plan.blocks()
        self.seed, self.shuffle = (plan.seed, plan.epoch, plan.rank), plan.shuffle
        sequence = plan.turns()
        taken = plan.taken()
        self.done = [0] * self.workers  # batches of each block already consumed
        for w, _ in sequence[:taken]:
            self.done[w] += 1
        # the DataLoader always asks its worker 0 first: rotate so that it plays the block
        # whose turn was next when the job stopped
        self.rotation = sequence[taken][0] if taken < len(sequence) else 0

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid = 0 if info is None else info.id
        return self._block((wid + self.rotation) % self.workers)

    def _block(self, w: int) -> Iterator[Any]:
        first, stop = self.blocks[w]
        b, span = self.batch, self.hi - self.lo
        start, end = self.lo + first * b, self.lo + min(stop * b, span)
        skip = self.done[w] * b  # samples of this block already consumed
        window = self.stream.shuffle_buffer
        # a window is shuffled as a whole: resume reads from the start of the window that
        # holds the resume point, and skips the rest of the way without decoding
        first_window = skip // window
        skip -= first_window * window
        pending: List[Any] = []
        raw = self.stream.samples_in(self.order, start + first_window * window, end)
        for number, offset in enumerate(range(first_window * window, end - start, window),
                                        start=first_window):
            chunk = [s for _, s in zip(range(min(window, end - start - offset)), raw)]
            if self.shuffle and window > 1:  # the same order on a resume: seeded by position
                seed = int(np.random.SeedSequence([*self.seed, w, number]).generate_state(1)[0])
                g = torch.Generator().manual_seed(seed)
                chunk = [chunk[i] for i in torch.randperm(len(chunk), generator=g).tolist()]
            for sample in chunk:
                if skip:
                    skip -= 1
                    continue
                pending.append(self.stream.decode(sample))
                if len(pending) == b:
                    yield self.stream.collate_fn(pending)
                    pending = []
        if pending:
            yield self.stream.collate_fn(pending)


class ShardLoader:
    """A loader-shaped object over a ShardStream for one rank: `sampler` (a ShardPlan),
    `batch_size`, `drop_last`, `num_workers`, `generator`, `dataset`, `len` and, per pass, a
    DataLoader whose workers each read their block of the rank's part of the epoch."""

    def __init__(self, stream: ShardStream, plan: ShardPlan, num_workers: int,
                 pin_memory: bool, generator: torch.Generator, **loader_kwargs: Any):
        self.dataset, self.sampler = stream, plan
        plan.workers = max(1, num_workers)
        self.batch_size, self.drop_last = plan.batch_size, plan.drop_last
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.generator = generator
        # workers are started per pass: each must know the pass's epoch and position
        self.loader_kwargs = {k: v for k, v in loader_kwargs.items()
                              if k not in ("persistent_workers",)}
        self._pass: Optional["weakref.ref"] = None  # the latest pass's iterator

    def close(self) -> None:
        """Ends the workers of the latest pass, if they run: the run's end, also where an
        error's traceback still holds the pass (its workers let a first SIGTERM pass, and
        Python's exit, which sends one and waits, would wait on them for ever)."""
        from data.loader import shut_down  # (lazy: data.loader imports this module)

        shut_down(self._pass() if self._pass is not None else None)

    def __len__(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        epoch = _Epoch(self.dataset, self.sampler)
        loader = DataLoader(epoch, batch_size=None, num_workers=self.num_workers,
                            pin_memory=self.pin_memory, generator=self.generator,
                            **self.loader_kwargs)
        it = iter(loader)
        self._pass = weakref.ref(it)
        return it


def shards_meta(root: str, key: str, size: int) -> Any:
    """`num_classes` or `input_shape` of a shard set, from its train index (for the config)."""
    stream = ShardStream("train", root, size=size)
    if key == "num_classes":
        return stream.num_classes
    if key in IMAGENET:  # image samples are normalised on the device; other data as it is
        return IMAGENET[key] if stream.kind == "image" else None
    return [3, size, size] if stream.kind == "image" else stream.input_shape


IMAGENET = {"normalize_mean": [0.485, 0.456, 0.406], "normalize_std": [0.229, 0.224, 0.225]}

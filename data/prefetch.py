"""Getting batches onto the training device without making the step wait for the copy.

`DevicePrefetcher` wraps a DataLoader. On CUDA it copies batch i+1 to the GPU on its own side
stream (non_blocking, from pinned memory) while the compute stream runs step i:

- one side stream per prefetcher, created once, never one per epoch (a stream per epoch
  leaks memory);
- the compute stream waits on the side stream before it uses a batch (an event recorded
  after the batch's copy and transform; one event, recorded again for every batch);
- every tensor handed out gets `record_stream(compute stream)`, so the caching allocator does
  not recycle its memory while the compute stream may still use it;
- the side stream does not wait on the compute stream. It reads only the pinned batch and
  memory of its own: PyTorch's caching allocator hands a freed block only to allocations on
  the stream it was allocated on (so the compute stream's freed activations never become a
  copy's destination), and a handed-out batch's block is guarded by `record_stream` above.
  A wait there would put a round trip between the streams before every copy: the copies of
  consecutive batches could not run back to back, and a copy could not start before every
  step queued ahead of it had finished. The exception: a batch that reaches the prefetcher
  on the device already (a collate of one's own that moves it), which the compute stream
  wrote: for it the side stream waits, and records its use of the batch;
- optional on-device work, done on the side stream too: uint8 -> float in [0, 1], training
  augmentation (random crop with padding, horizontal flip), per-channel normalisation and
  channels_last, so workers can ship compact uint8 batches and need not augment.

On CPU (or with `enabled=False`) it is a pass-through that applies the same on-device
transform in the main process, so a batch looks the same on every device.
"""
from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Mapping, MutableMapping
from typing import Any, Iterator, Optional, Sequence

import torch

from data.loader import end_pass, end_workers, readable, started
from data.resident import ResidentBatches
from trainer.config import ConfigError

_MIX = 1_000_003  # combines (seed, rank, epoch, position) into one generator seed


def to_device(batch: Any, device: torch.device, non_blocking: bool = True,
              there: Optional[list] = None) -> Any:
    """The same structure as `batch` with every tensor on `device`; identity when already
    there (such tensors are appended to `there` when it is given)."""
    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device != device:
            return t.to(device, non_blocking=non_blocking)
        if there is not None:
            there.append(t)
        return t

    return map_tensors(batch, move)


def map_tensors(batch: Any, fn) -> Any:
    """`batch` with `fn` applied to every tensor inside tuples, lists, mappings (dicts and
    dict-like batches such as Hugging Face's `BatchEncoding`), namedtuples and dataclasses;
    anything else passes as it is. A batch's own type is kept (a plain dict for a mapping
    that cannot be rebuilt from one)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if type(batch) is dict:  # the common case, without the copy below
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, Mapping):
        mapped = {k: map_tensors(v, fn) for k, v in batch.items()}
        if isinstance(batch, MutableMapping):  # a copy keeps the type and its other state
            clone = copy.copy(batch)
            clone.update(mapped)
            return clone
        try:
            return type(batch)(mapped)
        except TypeError:
            return mapped
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        clone = copy.copy(batch)
        for field in dataclasses.fields(batch):  # (object.__setattr__: frozen ones too)
            object.__setattr__(clone, field.name, map_tensors(getattr(batch, field.name), fn))
        return clone
    return batch


def each_tensor(batch: Any, fn) -> None:
    """Calls `fn` on every tensor `map_tensors` would map, building nothing: no copy of a
    dict-like batch or a dataclass (a per-batch cost, and a type that refuses other values
    would fail its rebuild)."""
    if isinstance(batch, torch.Tensor):
        fn(batch)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            each_tensor(v, fn)
    elif isinstance(batch, Mapping):
        for v in batch.values():
            each_tensor(v, fn)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            each_tensor(getattr(batch, field.name), fn)


class DeviceAugment:
    """Random crop with zero padding and horizontal flips of N x C x H x W inputs, drawn per
    sample on the device in one gather.

    A batch's randomness is a pure function of (seed, rank, epoch, the batch's position in the
    epoch in global samples): a run resumed mid-epoch draws exactly what the uninterrupted run
    drew, with no generator state to save. Padding is 0 in the input's scale after uint8 inputs
    became [0, 1] (black), before normalisation, as torchvision's RandomCrop(padding=p) on images.
    """

    def __init__(self, crop_padding: int = 0, hflip: bool = False, seed: int = 0, rank: int = 0):
        self.pad, self.hflip, self.seed, self.rank = crop_padding, hflip, seed, rank
        self._generators: dict = {}

    def __bool__(self) -> bool:
        return bool(self.pad or self.hflip)

    def key(self, epoch: int, position: int) -> int:
        return (((self.seed * _MIX + self.rank) * _MIX + epoch) * _MIX + position) % 2**63

    def __call__(self, x: torch.Tensor, key: int) -> torch.Tensor:
        if x.dim() != 4:
            raise ConfigError(f"data.augment: crops and flips need image batches (N, C, H, W); "
                              f"the inputs are {tuple(x.shape)}; set data.augment.crop_padding=0 "
                              "and data.augment.hflip=false")
        n, c, h, w = x.shape
        dev = x.device
        g = self._generators.get(dev)
        if g is None:
            g = self._generators[dev] = torch.Generator(device=dev)
        g.manual_seed(key)
        rows = torch.arange(h, device=dev).expand(n, h)
        cols = torch.arange(w, device=dev).expand(n, w)
        if self.pad:
            p = self.pad
            x = torch.nn.functional.pad(x, (p, p, p, p))
            offsets = torch.randint(0, 2 * p + 1, (2, n, 1), generator=g, device=dev)
            rows, cols = rows + offsets[0], cols + offsets[1]
        if self.hflip:
            flip = torch.randint(0, 2, (n, 1), generator=g, device=dev).bool()
            cols = torch.where(flip, cols.flip(1), cols)
        batch = torch.arange(n, device=dev).view(n, 1, 1, 1)
        channel = torch.arange(c, device=dev).view(1, c, 1, 1)
        return x[batch, channel, rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]


# the entries of a dict batch that hold its images, where task.input_key names none: Hugging
# Face vision models' keyword, then Stoker's own
IMAGE_KEYS = ("pixel_values", "inputs")


class InputTransform:
    """Device-side preparation of a batch's inputs (element 0 of a tuple/list batch; of a dict
    batch the entry `input_key` names (task.input_key), else its `pixel_values` or `inputs`);
    targets and everything else pass untouched. Order: uint8 to [0, 1], augmentation
    (training batches, when given a key), normalisation, memory format. A dict batch with no
    such entry, given normalisation or augmentation, is a ConfigError: they would not apply.
    """

    def __init__(self, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, channels_last: bool = False,
                 augment: Optional[DeviceAugment] = None, input_key: Optional[str] = None):
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32)
        self.channels_last = channels_last
        self.augment = augment if augment else None
        self.identity = self.mean is None and not channels_last and self.augment is None
        self.keys = (input_key,) if input_key else IMAGE_KEYS
        self._scale_checked = False

    def _check_scale(self) -> None:
        """uint8 images are scaled to [0, 1] before normalising: statistics on the 0-255
        scale (as some model zoos give them) left the model inputs near -2 whatever the
        image, and it learnt nothing, silently. Once, on the host copy of the statistics."""
        self._scale_checked = True
        if float(self.mean.abs().max()) > 1:  # (a [0, 1] image's mean cannot be)
            shown = lambda t: "[" + ",".join(f"{v:g}" for v in t.tolist()) + "]"  # noqa: E731
            raise ConfigError(
                f"data.normalize_mean={shown(self.mean)} data.normalize_std={shown(self.std)}: "
                "on the 0-255 scale, and uint8 images are scaled to [0, 1] before they are "
                f"normalised; divide them by 255 (data.normalize_mean={shown(self.mean / 255)} "
                f"data.normalize_std={shown(self.std / 255)})")

    def _inputs(self, x: torch.Tensor, key: Optional[int]) -> torch.Tensor:
        if x.dtype == torch.uint8:
            if self.mean is not None and not self._scale_checked:
                self._check_scale()
            x = x.float().div_(255.0)
        if self.augment is not None and key is not None:
            x = self.augment(x, key)
        if self.mean is not None:
            shape = (-1,) + (1,) * (x.dim() - 2)  # broadcast over the channel dimension
            if self.mean.device != x.device:  # moved once, not per batch
                self.mean, self.std = self.mean.to(x.device), self.std.to(x.device)
            x = (x.float() - self.mean.view(shape)) / self.std.view(shape)
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def __call__(self, batch: Any, key: Optional[int] = None) -> Any:
        if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
            if self.identity and batch[0].dtype != torch.uint8:
                return batch
            items = [self._inputs(batch[0], key), *batch[1:]]
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        if isinstance(batch, dict):
            name = next((k for k in self.keys if isinstance(batch.get(k), torch.Tensor)), None)
            if name is not None:
                return {**batch, name: self._inputs(batch[name], key)}
            if self.mean is not None or self.augment is not None:
                where = (f"task.input_key={self.keys[0]}" if self.keys != IMAGE_KEYS else
                         f"task.input_key, else {' or '.join(IMAGE_KEYS)}")
                raise ConfigError(
                    f"data.normalize_mean{'/augment' if self.augment is not None else ''}: a "
                    f"dict batch's images are its entry named by {where}; this batch has "
                    f"{', '.join(map(str, batch))}, none of them a tensor there (name the "
                    "images' entry so; for data that is not images, data.normalize_mean=null "
                    "and no data.augment)")
        return batch


def _stream_context(stream: Optional[torch.cuda.Stream]):
    """A maker of the context that makes `stream` current (and its device) for a block: the
    stream itself where it is a `torch.Stream`, whose `with` switches in C++, else
    `torch.cuda.stream`'s, whose Python (a current-stream lookup and two `set_stream`
    calls) is an estimated 10 µs a batch, a tiny step's visible share. None without a stream."""
    if stream is None:
        return None
    if isinstance(stream, torch.Stream) and hasattr(torch.Stream, "__enter__"):
        return lambda: stream
    return lambda: torch.cuda.stream(stream)


class DevicePrefetcher:
    """Iterable over a DataLoader that yields batches already on `device` (see module doc).

    Re-iterable (one pass per epoch), handles empty loaders, and exposes the loader it wraps
    as `.loader` for its sampler and batch settings. A `ResidentBatches` loader's batches are
    on the device already: they only get the transform.
    """

    def __init__(self, loader, device: torch.device, transform: Optional[InputTransform] = None,
                 enabled: bool = True):
        self.loader = loader
        if device.type == "cuda" and device.index is None:  # "cuda": the current GPU, named,
            # so that a batch made there compares equal to it (cuda:0 != cuda)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.transform = transform or InputTransform()
        self.resident = isinstance(loader, ResidentBatches)
        self.side_stream = (torch.cuda.Stream(device=device)
                            if enabled and device.type == "cuda" and not self.resident
                            else None)
        # the compute stream's wait for a batch: one event, recorded again after each batch's
        # copy (a wait binds to the record before it), not a new event per batch
        self._copied = torch.cuda.Event() if self.side_stream is not None else None
        self._on_side = _stream_context(self.side_stream)

    def __len__(self) -> int:
        return len(self.loader)

    def close(self) -> None:
        """Ends the loader's workers now: the run-on loader's (data/runon.py), already into an
        epoch nobody may train, and a DataLoader's kept ones (persistent workers)."""
        end_workers(self.loader)

    def _keys(self) -> Iterator[Optional[int]]:
        """Each coming batch's augmentation key (None without augmentation): its epoch and its
        position in the epoch, counted in global samples from where the sampler starts."""
        augment = self.transform.augment
        sampler = getattr(self.loader, "sampler", None)  # any iterable of batches will do
        if augment is None or not hasattr(sampler, "epoch"):
            return itertools.repeat(None)
        per_batch = self.loader.batch_size * getattr(sampler, "num_replicas", 1)
        epoch = sampler.epoch
        return (augment.key(epoch, pos)
                for pos in itertools.count(getattr(sampler, "start", 0), per_batch))

    def __iter__(self) -> Iterator[Any]:
        return self.take(None)

    def take(self, limit: Optional[int]) -> Iterator[Any]:
        """A pass over at most `limit` batches (None: all): on CUDA, where the next batch is
        fetched and copied while the current one is used, none is read past the limit (a
        validation pass of `limit_val_batches` would otherwise load one more each time)."""
        transform, keys = self.transform, self._keys()
        if self.resident:  # on the device already; the transform passes float batches as they are
            # (a transform of one's own, with no `identity`, is called on every batch)
            source = self.loader if limit is None else itertools.islice(self.loader, limit)
            identity = getattr(transform, "identity", False)
            if identity and self.loader.tensors[0].dtype != torch.uint8:
                yield from source  # nothing to do per batch (a tiny step's microsecond)
                return
            for batch in source:
                yield transform(batch, next(keys))
            return
        workers = getattr(self.loader, "num_workers", 0) > 0
        source = started(self.loader, workers)
        batches = readable(source, workers=workers, owner=self.loader)
        if limit is not None:
            batches = itertools.islice(batches, limit)
        try:
            yield from self._pass(batches, keys)
        finally:
            end_pass(source)

    def _pass(self, batches: Iterator[Any], keys: Iterator[Optional[int]]) -> Iterator[Any]:
        """`batches` on the device, transformed (on CUDA, each copied on the side stream
        while the one before is used)."""
        transform = self.transform
        if self.side_stream is None:
            on_cpu = self.device.type == "cpu"  # a loader's batches are there: nothing to walk
            for batch in batches:
                yield transform(batch if on_cpu else to_device(batch, self.device), next(keys))
            return
        side, copied = self.side_stream, self._copied
        compute = torch.cuda.current_stream(self.device)
        pending = self._preload(batches, keys, compute)
        while pending is not None:
            compute = torch.cuda.current_stream(self.device)
            copied.record(side)  # after the copy and transform of `pending`
            compute.wait_event(copied)  # ... which the compute stream must not overtake
            batch = pending
            each_tensor(batch, lambda t: t.record_stream(compute))
            # overlaps with the step that uses `batch`
            pending = self._preload(batches, keys, compute)
            yield batch

    def _preload(self, batches: Iterator[Any], keys: Iterator[Optional[int]],
                 compute: torch.cuda.Stream) -> Optional[Any]:
        """The next batch, copied and transformed on the side stream (queued, not waited
        for); None when the pass is over. The side stream waits on the compute stream only
        for a batch the loader made on the device already (a collate of one's own that moves
        it): the compute stream wrote it, and may reuse its memory once it is freed."""
        try:
            cpu_batch = next(batches)
        except StopIteration:
            return None
        side, made_there = self.side_stream, []
        with self._on_side():
            batch = to_device(cpu_batch, self.device, there=made_there)
            if made_there:
                side.wait_stream(compute)
                for t in made_there:
                    t.record_stream(side)
            return self.transform(batch, next(keys))

"""Getting batches onto the training device without making the step wait for the copy.

`DevicePrefetcher` wraps a DataLoader. On CUDA it copies batch i+1 to the GPU on its own side
stream (non_blocking, from pinned memory) while the compute stream runs step i:

- one side stream per prefetcher, created once, never one per epoch (a stream per epoch
  leaks memory);
- the side stream waits on the compute stream before it copies, and the compute stream waits
  on the side stream before it uses a batch, so neither reads memory the other still writes;
- every tensor handed out gets `record_stream(compute stream)`, so the caching allocator does
  not recycle its memory while the compute stream may still use it;
- optional on-device work, done on the side stream too: uint8 -> float in [0, 1],
  per-channel normalisation and channels_last, so workers can ship compact uint8 batches.

On CPU (or with `enabled=False`) it is a pass-through that applies the same on-device
transform in the main process, so a batch looks the same on every device.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch

from data.loader import loader_error


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """The same structure as `batch` with every tensor on `device`; identity when already there."""
    return map_tensors(batch, lambda t: t if t.device == device
                        else t.to(device, non_blocking=non_blocking))


def map_tensors(batch: Any, fn) -> Any:
    """`batch` with `fn` applied to every tensor inside tuples, lists, dicts, namedtuples."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, map_tensors(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


class InputTransform:
    """Device-side preparation of a batch's inputs (element 0 of a tuple/list batch, or the
    "inputs" entry of a dict batch); targets and everything else pass untouched."""

    def __init__(self, mean: Optional[Sequence[float]] = None,
                 std: Optional[Sequence[float]] = None, channels_last: bool = False):
        self.mean = None if mean is None else torch.tensor(mean, dtype=torch.float32)
        self.std = None if std is None else torch.tensor(std, dtype=torch.float32)
        self.channels_last = channels_last

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.uint8:
            x = x.float().div_(255.0)
        if self.mean is not None:
            shape = (-1,) + (1,) * (x.dim() - 2)  # broadcast over the channel dimension
            mean = self.mean.to(x.device, non_blocking=True).view(shape)
            std = self.std.to(x.device, non_blocking=True).view(shape)
            x = (x.float() - mean) / std
        if self.channels_last and x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return x

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
            items = [self._inputs(batch[0]), *batch[1:]]
            return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
        if isinstance(batch, dict) and isinstance(batch.get("inputs"), torch.Tensor):
            return {**batch, "inputs": self._inputs(batch["inputs"])}
        return batch


def _readable(batches: Iterator[Any]) -> Iterator[Any]:
    """`batches`, with the default collate's failures (samples it cannot batch) and a worker
    that sends nothing for data.timeout seconds turned into one line (see
    data.loader.loader_error); other errors pass as they are."""
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (TypeError, RuntimeError) as e:
            error = loader_error(e)
            if error is e:
                raise
            raise error from None
        yield batch


class DevicePrefetcher:
    """Iterable over a DataLoader that yields batches already on `device` (see module doc).

    Re-iterable (one pass per epoch), handles empty loaders, and exposes the loader it wraps
    as `.loader` for its sampler and batch settings.
    """

    def __init__(self, loader, device: torch.device, transform: Optional[InputTransform] = None,
                 enabled: bool = True):
        self.loader = loader
        self.device = device
        self.transform = transform or InputTransform()
        self.side_stream = (torch.cuda.Stream(device=device)
                            if enabled and device.type == "cuda" else None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        batches = _readable(iter(self.loader))
        if self.side_stream is None:
            for batch in batches:
                yield self.transform(to_device(batch, self.device))
            return
        pending = self._preload(batches)
        while pending is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.side_stream)  # the copy of `pending` must be complete
            batch = pending
            map_tensors(batch, lambda t: t.record_stream(compute))
            pending = self._preload(batches)  # overlaps with the step that uses `batch`
            yield batch

    def _preload(self, batches: Iterator[Any]) -> Optional[Any]:
        try:
            cpu_batch = next(batches)
        except StopIteration:
            return None
        # the side stream must not start before the compute stream is done with what it
        # has queued so far (memory it frees may be handed to this copy)
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.side_stream):
            return self.transform(to_device(cpu_batch, self.device, non_blocking=True))

"""Device-resident data: a dataset of tensors kept on the training device, batched by indexing.

For data that is already a set of tensors (a `TensorDataset`: data=digits, `data.cache=memory`
results, a user's own; or arrays memory-mapped from files: data=memmap, `data.cache=shm|disk`)
and fits a memory budget, a DataLoader's work per step is pure overhead:
fetching each sample through `__getitem__`, stacking them in `collate`, then copying the batch
to the device. `ResidentBatches` copies the tensors to the device once and forms each batch
in the sampler's order: for data within `data.device_budget_mb`, one `index_select` per
tensor per epoch and a slice (a view) per batch; for larger data, one `index_select` per tensor
per batch:

- the same sampler as the loader path (`ResumableDistributedSampler` for training,
  the evaluation shards for validation), so sharding, shuffling and the exact mid-epoch resume
  are unchanged;
- the same batches: `index_select` copies exactly the rows the default collate would stack
  (bitwise equal on CPU), as a list like the default collate returns for tuple samples;
- one host-to-device copy of the epoch's indices per epoch, none per step, no workers.

It exposes what the trainer reads from a DataLoader (`sampler`, `batch_size`, `drop_last`,
`generator`, `dataset`, `len()`), so the loop and checkpointing treat both alike.
"""
from __future__ import annotations

from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import Dataset, Sampler, TensorDataset

from data.sampler import epoch_batches


def tensors_of(dataset: Dataset) -> Optional[Tuple[torch.Tensor, ...]]:
    """The dataset's tensors when sample i is exactly row i of each of them (a TensorDataset
    that does not override `__getitem__`), else None."""
    if isinstance(dataset, TensorDataset) and \
            type(dataset).__getitem__ is TensorDataset.__getitem__:
        return tuple(dataset.tensors)
    return None


def rows_of(dataset: Dataset) -> Optional[Tuple[torch.Tensor, ...]]:
    """`tensors_of(dataset)`, or else the memory-mapped tensors of a dataset whose samples are
    rows of arrays in files (`as_tensors()`: data=memmap, data.cache=shm and disk), or None."""
    tensors = tensors_of(dataset)
    # looked up on the class: a wrapper that forwards attributes to the dataset it holds (a
    # cache, a transform) has samples of its own, which the wrapped arrays are not
    as_tensors = getattr(type(dataset), "as_tensors", None)
    if tensors is None and callable(as_tensors):
        tensors = as_tensors(dataset)
    return None if tensors is None else tuple(tensors)


def _uses(t: torch.Tensor) -> Optional[int]:
    """How many hold `t`'s memory (it, its views, storages of it); None where PyTorch does
    not say (then no copy is ever reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return None if count is None else count(t.untyped_storage()._cdata)


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes `tensors` hold."""
    return sum(t.numel() * t.element_size() for t in tensors)


def gathers(size_bytes: int, budget_mb: Optional[float]) -> bool:
    """Whether tensors of `size_bytes` are gathered once per epoch (within `budget_mb`, None:
    no limit; `data.device_budget_mb` in training) rather than indexed per batch."""
    return budget_mb is None or size_bytes <= budget_mb * 2**20


class ResidentBatches:
    """Batches of `tensors` (on `device`) in `sampler`'s order; see the module doc.

    Tensors within `gather_mb` (see `gathers`) are gathered once per epoch in the sampler's
    order, and each batch is a slice of that copy: no work per step but a view, for twice the
    data's memory (the copy is kept for the next epoch to gather into). Larger ones are
    indexed batch by batch."""

    num_workers = 0

    def __init__(self, tensors: Sequence[torch.Tensor], sampler: Sampler[int], batch_size: int,
                 drop_last: bool, device: torch.device,
                 generator: Optional[torch.Generator] = None,
                 gather_mb: Optional[float] = None):
        self.tensors = tuple(t.to(device) for t in tensors)
        self.dataset = TensorDataset(*self.tensors)
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last
        self.device = device
        self.generator = generator  # kept for the checkpoint's random state, like a loader's
        self.gathered = gathers(nbytes(self.tensors), gather_mb)
        # the last epoch's copy of each tensor, and how many held it when it was made
        self._copies: Dict[int, Tuple[Optional[torch.Tensor], Optional[int]]] = {}

    def __len__(self) -> int:
        return epoch_batches(len(self.sampler), self.batch_size, self.drop_last)

    def _gather(self, k: int, order: torch.Tensor) -> torch.Tensor:
        """Tensor `k`'s rows in `order`: written over the last epoch's copy when nothing else
        holds any of it (no batch of that epoch is left: the trainer's epoch has returned;
        a tensor or view of it counts, a bare `untyped_storage()` of a batch kept on its own
        does not), else a new copy. A new copy of host memory is faulted in page by page: on a VM, the
        second epoch of 300 MB of images took 0.4-0.5 s against 0.03 s reusing the pages."""
        t, (last, uses) = self.tensors[k], self._copies.get(k, (None, None))
        if last is not None and uses is not None and len(last) == len(order) \
                and _uses(last) == uses:
            return torch.index_select(t, 0, order, out=last)
        self._copies[k] = None, None  # (let go of the old copy first: its memory may serve)
        copy = t.index_select(0, order)
        self._copies[k] = copy, _uses(copy)
        return copy

    def __iter__(self) -> Iterator[List[torch.Tensor]]:
        tensor = getattr(self.sampler, "epoch_tensor", None)  # the order without a list
        order = tensor() if tensor else torch.as_tensor(list(self.sampler), dtype=torch.int64)
        if self.drop_last:
            order = order[:len(order) - len(order) % self.batch_size]
        if not len(order):
            return  # (splitting an empty tensor would give one empty batch)
        order = order.to(self.device, non_blocking=True)  # once per epoch
        if self.gathered:  # one copy in this epoch's order; a batch is a view of it
            # (views: a pass left suspended holds its copy, seen by the next pass's _gather)
            epoch = [self._gather(k, order)[:] for k in range(len(self.tensors))]
            for start in range(0, len(order), self.batch_size):
                yield [t[start:start + self.batch_size] for t in epoch]
        else:
            for idx in order.split(self.batch_size):
                yield [t.index_select(0, idx) for t in self.tensors]

"""Shared-memory batch buffers that loader workers reuse once the training process lets go.

A DataLoader worker hands each batch to the training process through shared memory: PyTorch
moves every batch into a new shared-memory block, which the kernel must allocate and zero page
by page (a 9.6 MB batch of 64 uint8 224x224 images: about 8 ms of a worker's time here, a sixth
of decoding the 64 JPEGs), and the training process maps anew. A `BatchPool` gives each worker
a few such blocks (`slots`) that it forms its batches in directly and takes again for later
batches, so the pages are allocated once per run.

A slot is taken by its worker (its flag set to 1) and given back only by the training process
(its flag set to 0) once nothing there can read the batch any more: when the loader's pin
thread has copied it into page-locked memory, or else when every tensor that shares its memory
is gone (a weak reference to the storage has expired). A batch the training process never gives
back (one a collate of the user's turned into something else, say) keeps its slot taken for
good: the worker then allocates a new block for each batch, as PyTorch does, and never writes
into memory somebody may still read. With no free slot a worker does the same; it never waits.

Who forms batches there: a dataset's own batch fetch through `batch_buffer` and `hand_out`
(the image folder's), and `pooled_collate`, the training loader's collate when no
`data.collate_fn` is set, for samples of tensors and numbers: one block a batch (one file
descriptor for the receiving process to fetch, not one per tensor), its small tensors copied
out on receipt (`BatchPool.received`) so that kept labels keep nothing of the block.

Only workers under the file-descriptor sharing strategy pool (Linux's default; forked workers
inherit the training process's, spawned ones start with the default); under `file_system`
they allocate a block per batch as before.

What the pool cannot see: the training process sending a batch on to another process (a
logger's queue, say), which maps the same block; or code that keeps a raw pointer
(`data_ptr()`) past the tensors. Copy such a batch first (`.clone()`).
"""
from __future__ import annotations

import itertools
import math
import multiprocessing
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.data import get_worker_info

_installed: Optional["BatchPool"] = None  # in a loader worker: its DataLoader's pool
_pools: "weakref.WeakValueDictionary[int, BatchPool]" = weakref.WeakValueDictionary()
_tokens = itertools.count(1)


Specs = Sequence[Tuple[Tuple[int, ...], torch.dtype]]  # (shape, dtype) of each tensor


def _layout(specs: Specs) -> Tuple[List[int], int]:
    """Where each tensor of `specs` starts in one block (64-byte aligned), and its bytes."""
    starts, at = [], 0
    for shape, dtype in specs:
        starts.append(at)
        at += -(-math.prod(shape) * dtype.itemsize // 64) * 64
    return starts, max(at, 1)


def _views(storage: torch.UntypedStorage, specs: Specs, starts: List[int]
           ) -> List[torch.Tensor]:
    """Tensors of `specs` in `storage`, each from its start (`_layout`'s)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    return [raw[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for at, (shape, dtype) in zip(starts, specs)]


class BatchPool:
    """`slots` reusable shared-memory batch buffers for each of `workers` loader workers.
    Made in the training process before the workers start; `install` (the DataLoader's
    worker_init_fn) makes it the pool of the worker it runs in."""

    def __init__(self, workers: int, slots: int, worker_init_fn: Optional[Any] = None):
        self.workers, self.slots = workers, slots
        self.token = next(_tokens)  # names the pool in the batches its workers send
        self.taken = multiprocessing.RawArray("b", workers * slots)
        # per worker: batches formed in a slot reused, in a slot's first block, in a new block
        self.counts = multiprocessing.RawArray("q", workers * 3)
        self.worker_init_fn = worker_init_fn
        self._blocks: Dict[int, torch.UntypedStorage] = {}  # a worker's own slots
        self._lent: List[Tuple[StorageWeakRef, int]] = []  # the training process's batches
        _pools[self.token] = self

    def __getstate__(self) -> Dict[str, Any]:  # (spawned workers: the arrays travel at spawn)
        return {k: v for k, v in self.__dict__.items() if k not in ("_blocks", "_lent")}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state, _blocks={}, _lent=[])

    def install(self, worker_id: int) -> None:
        """Makes this the pool of the worker process it is called in (worker_init_fn)."""
        global _installed
        if torch.multiprocessing.get_sharing_strategy() == "file_descriptor":
            _installed = self
        if self.worker_init_fn is not None:
            self.worker_init_fn(worker_id)

    def take(self, worker: int, nbytes: int) -> Optional[Tuple[torch.UntypedStorage, int]]:
        """A free slot of `worker`'s (at least `nbytes`) and its number, now taken; None when
        every slot of the worker's is out."""
        for slot in range(worker * self.slots, (worker + 1) * self.slots):
            if self.taken[slot]:
                continue
            block = self._blocks.get(slot)
            first = block is None or block.nbytes() < nbytes
            if first:
                block = self._blocks[slot] = torch.UntypedStorage._new_shared(nbytes)
            self.taken[slot] = 1
            self.counts[3 * worker + (1 if first else 0)] += 1
            return block, slot
        self.counts[3 * worker + 2] += 1
        return None

    def stats(self) -> Dict[str, int]:
        """Batches formed in a reused slot, in a slot's first block, and in a new block because
        every slot of the worker's was out (summed over the workers)."""
        c = list(self.counts)
        return {"reused": sum(c[0::3]), "first": sum(c[1::3]), "unpooled": sum(c[2::3])}

    def give_back(self, slot: int) -> None:
        self.taken[slot] = 0

    def received(self, batch: Any) -> Any:
        """In the training process, each batch as it comes from the DataLoader: a
        `PooledBatch` becomes the batch it carries, its slot given back once nothing uses its
        memory any more; any other batch passes as it is."""
        if self._lent:  # give back the slots whose batches are gone by now
            still = []
            for ref, slot in self._lent:
                if ref.expired():
                    self.give_back(slot)
                else:
                    still.append((ref, slot))
            self._lent = still
        if not isinstance(batch, PooledBatch):
            return batch
        if batch.token == self.token:  # (another pool's slot stays taken: never reused)
            self._lent.append((batch.storage_ref(), batch.slot))
        return _small_ones_copied(batch.batch)


def _small_ones_copied(batch: Any) -> Any:
    """`batch`, a list or tuple of tensors sharing one block, with each tensor of under an
    eighth of the largest one's bytes copied out of it: keeping only those (the labels, say)
    keeps nothing of the block, as with the default collate's block per tensor (2 KB a batch
    for 256 int64 labels); tensors of about one size stay, and keeping one keeps them all."""
    if type(batch) not in (list, tuple) or len(batch) < 2:
        return batch
    sizes = [t.nbytes if type(t) is torch.Tensor else None for t in batch]
    big = max((n for n in sizes if n is not None), default=0)
    if not any(n is not None and n * 8 < big for n in sizes):
        return batch
    return type(batch)(t.clone() if n is not None and n * 8 < big else t
                       for t, n in zip(batch, sizes))


class PooledBatch:
    """A batch formed in a pool's slot, on its way from the worker to the training process:
    the pool (`received`, or the loader's pin thread through `pin_memory`) gives the batch to
    the training loop and the slot back. `anchor` is a tensor over the slot's memory; `ref`
    (instead) a weak reference to it, for a batch the pin thread could not copy whole."""

    def __init__(self, batch: Any, token: int, slot: int, anchor: Optional[torch.Tensor],
                 ref: Optional[StorageWeakRef] = None):
        self.batch, self.token, self.slot, self.anchor, self.ref = batch, token, slot, anchor, ref

    def __getstate__(self) -> Dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "ref"}  # (never sent: made here)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state, ref=None)

    def storage_ref(self) -> StorageWeakRef:
        """A weak reference to the slot's memory (the anchor let go of)."""
        if self.ref is None:
            self.ref = StorageWeakRef(self.anchor.untyped_storage())
            self.anchor = None
        return self.ref

    def pin_memory(self, device: Optional[str] = None) -> Any:
        """The batch in page-locked memory (the DataLoader's pin thread calls this). The slot
        is given back at once when the copy left nothing of it (a batch of tensors, lists,
        dicts...); a batch of a class PyTorch does not know how to pin may still hold it, and
        goes on to `received`, which gives the slot back once that is gone."""
        from torch.utils.data._utils.pin_memory import pin_memory

        batch, self.batch = self.batch, None
        ref = self.storage_ref()
        pinned = pin_memory(batch)
        del batch
        if ref.expired():
            pool = _pools.get(self.token)
            if pool is not None:
                pool.give_back(self.slot)
            return pinned
        return PooledBatch(pinned, self.token, self.slot, None, ref)


class Lease:
    """A pool's slot that a worker formed a batch in: `anchor` spans its memory."""

    def __init__(self, token: int, slot: int, storage: torch.UntypedStorage):
        self.token, self.slot = token, slot
        self.anchor = torch.empty(0, dtype=torch.uint8).set_(storage)


def batch_buffer(*specs: Tuple[Tuple[int, ...], torch.dtype]
                 ) -> Tuple[List[torch.Tensor], Optional[Lease]]:
    """Uninitialised tensors of `specs` (shape, dtype) to form a batch in, all in one block of
    memory (one block to hand over), and its lease (None when not leased).

    In a loader worker with a pool (data/runon.py installs one): a slot of the pool's; in
    another worker, or with every slot out, a new shared-memory block (what PyTorch's collate
    allocates: the batch then leaves the worker without another copy); in the training
    process, ordinary memory. A leased batch must leave the worker as `hand_out` wraps it."""
    starts, nbytes = _layout(specs)
    info = get_worker_info()
    if info is None:
        return _views(torch.UntypedStorage(nbytes), specs, starts), None
    if _installed is not None:
        got = _installed.take(info.id, nbytes)
        if got is not None:
            return _views(got[0], specs, starts), Lease(_installed.token, got[1], got[0])
    return _views(torch.UntypedStorage._new_shared(nbytes), specs, starts), None


def hand_out(batch: Any, lease: Optional[Lease]) -> Any:
    """`batch` (formed in tensors that `batch_buffer` gave with `lease`) as the worker must
    send it: wrapped for the pool to give the slot back, or as it is when not leased."""
    if lease is None:
        return batch
    return PooledBatch(batch, lease.token, lease.slot, lease.anchor)


def _position(values: Sequence[Any]) -> Optional[Tuple[Tuple[int, ...], torch.dtype]]:
    """The (shape, dtype) of one position's stacked batch, or None when the default collate
    must batch it: plain tensors of one shape and dtype (dense, on the CPU: the first tells;
    any other the stack refuses, and the default collate answers), or Python ints or floats
    (int64, float64, as the default collate makes them)."""
    first = values[0]
    if type(first) is torch.Tensor:
        if first.layout != torch.strided or first.is_nested or first.is_quantized or \
                first.device.type != "cpu":
            return None
        shape, dtype = first.shape, first.dtype
        if all(type(t) is torch.Tensor and t.shape == shape and t.dtype == dtype
               for t in values):
            return (len(values), *shape), dtype
        return None
    if type(first) in (int, float) and all(type(v) is type(first) for v in values):
        return (len(values),), torch.int64 if type(first) is int else torch.float64
    return None


def _columns(samples: Sequence[Any]) -> Optional[List[Sequence[Any]]]:
    """Each position's values across `samples`: one for tensors, one per element for tuples
    and lists, one per key of the first for dicts (None where a sample lacks it); None for
    other samples."""
    first = samples[0] if len(samples) else None
    if isinstance(first, torch.Tensor):
        return [samples]
    if type(first) is dict:
        return [[s.get(k) if type(s) is dict else None for s in samples] for k in first]
    if type(first) in (tuple, list):
        return list(zip(*samples))
    return None


def _shapes_checked(samples: Sequence[Any], columns: Optional[List[Sequence[Any]]]
                    ) -> Sequence[Any]:
    """`samples`, after raising torch.stack's own error ("stack expects each tensor to be
    equal size, but got ...") for a column (`_columns`) whose tensors differ in shape: the
    default collate's message outside a worker, where in a worker it fails resizing its
    shared block instead ("Trying to resize storage that is not resizable")."""
    for values in columns or ():
        if all(type(t) is torch.Tensor and not t.is_nested for t in values) and \
                len({t.shape for t in values}) > 1:
            torch.stack(values)  # raises
    return samples


def pooled_collate(samples: Sequence[Any]) -> Any:
    """PyTorch's default collate, with one difference for the common shape of sample, a tuple
    or list of tensors and numbers (or a tensor): the batch is stacked into one block of
    memory of the worker's pool (`batch_buffer`), reused from batch to batch instead of a new
    shared-memory block per tensor that the worker allocates and zeroes, and handed over as one
    block (each block costs the receiving process a connection to the worker to fetch its file
    descriptor). Values, dtypes, shapes and strides are the default collate's, and so are the
    types (a tuple becomes a list, as there). Other samples, tensors that differ, a default
    collate of one's own (`default_collate_fn_map` changed for tensors) or anything the stack
    refuses go to the default collate, with its errors."""
    from torch.utils.data import default_collate
    from torch.utils.data._utils.collate import collate_tensor_fn, default_collate_fn_map

    first = samples[0] if len(samples) else None
    single = isinstance(first, torch.Tensor)
    columns = _columns(samples)
    if (not single and type(first) not in (tuple, list)) or \
            default_collate_fn_map.get(torch.Tensor) is not collate_tensor_fn:
        return default_collate(_shapes_checked(samples, columns))
    if not single and not (first and all(type(s) is type(first) and len(s) == len(first)
                                         for s in samples)):
        return default_collate(samples)
    try:
        specs = [_position(values) for values in columns]
    except RuntimeError:  # (a nested tensor among them has no shape)
        specs = [None]
    if any(spec is None for spec in specs):
        return default_collate(_shapes_checked(samples, columns))
    tensors, lease = batch_buffer(*specs)
    try:
        for out, values in zip(tensors, columns):
            if type(values[0]) is torch.Tensor:
                torch.stack(values, out=out)
            else:
                out.copy_(torch.tensor(values, dtype=out.dtype))
    except Exception:  # (an int beyond int64, say): the default collate's answer, or error
        if lease is not None and _installed is not None:
            _installed.give_back(lease.slot)
        return default_collate(samples)
    return hand_out(tensors[0] if single else tensors, lease)

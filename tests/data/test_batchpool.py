"""data/batchpool.py: loader workers form batches in shared-memory slots they reuse, and only
once the training process holds none of a slot's batch."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from data import batchpool
from data.batchpool import BatchPool, PooledBatch
from data.images import ImageFolder, SkipCollate
from data.runon import RunOnLoader
from data.sampler import ResumableDistributedSampler
from scripts.make_images import write_images


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool")
    write_images(root, count=40, size=24, classes=4, val_fraction=0.0)
    return ImageFolder("train", str(root), size=16)


def run_on(ds, collate, context=None):
    sampler = ResumableDistributedSampler(len(ds), 1, 0, seed=5)
    return RunOnLoader(ds, sampler, 4, False, torch.Generator().manual_seed(0), num_workers=2,
                       prefetch_factor=2, collate_fn=collate, multiprocessing_context=context)


def expected(ds, sampler, epoch):
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [default_collate([ds[i] for i in order[k:k + 4]]) for k in range(0, len(order), 4)]


@pytest.mark.parametrize("context", [None, "spawn"])
def test_a_run_on_loader_over_images_forms_the_same_batches_in_reused_slots(images, context):
    loader = run_on(images, images.collate_fn, context)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        got = list(loader)
        want = expected(images, run_on(images, None).sampler, epoch)
        assert len(got) == len(want) == 10
        for (x, y), (wx, wy) in zip(got, want):
            assert type(x) is torch.Tensor and torch.equal(x, wx) and torch.equal(y, wy)
        del got  # the loop lets go of an epoch's batches: their slots come back
    stats = loader.pool.stats()
    assert loader.restarts == 1 and stats["reused"] > 0
    assert stats["first"] <= 2 * loader.pool.slots
    loader.close()


@pytest.mark.parametrize("collate", ["default", "keeps_views"])
def test_batches_the_loop_holds_are_never_written_over(images, collate):
    # a user's collate that returns the samples as they come: views into the slot's memory
    fn = images.collate_fn if collate == "default" else SkipCollate((3, 16, 16), list)
    loader = run_on(images, fn)
    held, window = [], 2 * (2 + 3) + 2  # more than all the workers' slots (2 x 5)
    for epoch in range(4):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            tensors = batch if collate == "default" else [t for s in batch for t in s]
            held.append((tensors, [t.clone() for t in tensors]))
            if len(held) > window:  # this batch's slot may now be given back and reused
                old, copies = held.pop(0)
                assert all(torch.equal(a, b) for a, b in zip(old, copies))
    for tensors, copies in held:
        assert all(torch.equal(a, b) for a, b in zip(tensors, copies))
    stats = loader.pool.stats()
    # every slot was held at once (new blocks were made then) and slots came back later
    assert stats["unpooled"] > 0 and stats["reused"] > 0
    loader.close()


def test_the_pin_thread_gives_the_slot_back_once_the_batch_is_copied(monkeypatch):
    pool = BatchPool(workers=1, slots=2)
    pool.taken[1] = 1
    block = torch.arange(6)
    monkeypatch.setattr("torch.utils.data._utils.pin_memory.pin_memory",
                        lambda batch: [t.clone() for t in batch])  # pinned copies
    batch = PooledBatch([block[:3]], pool.token, 1, block)
    del block
    out = batch.pin_memory()
    assert type(out) is list and out[0].tolist() == [0, 1, 2] and list(pool.taken) == [0, 0]


def test_a_batch_the_pin_thread_cannot_copy_keeps_its_slot_until_it_is_gone():
    class Batch:  # a class of the user's: PyTorch's pin_memory passes it as it is
        def __init__(self, x):
            self.x = x

    pool = BatchPool(workers=1, slots=1)
    pool.taken[0] = 1
    block = torch.arange(6)
    out = PooledBatch(Batch(block[:3]), pool.token, 0, block).pin_memory()
    del block
    assert isinstance(out, PooledBatch) and pool.taken[0] == 1
    batch = pool.received(out)
    del out
    assert type(batch) is Batch and batch.x.tolist() == [0, 1, 2]
    pool.received(None)
    assert pool.taken[0] == 1  # the loop still reads the slot's memory
    del batch
    pool.received(None)
    assert pool.taken[0] == 0


def test_the_training_process_gives_a_slot_back_when_its_batch_is_gone():
    pool = BatchPool(workers=1, slots=1)
    pool.taken[0] = 1
    block = torch.zeros(8)
    batch = pool.received(PooledBatch([block[:4]], pool.token, 0, block))
    del block
    assert type(batch) is list
    pool.received(None)
    assert pool.taken[0] == 1  # the loop still holds the batch
    del batch
    assert pool.received("next") == "next" and pool.taken[0] == 0
    other = BatchPool(workers=1, slots=1)
    other.taken[0] = 1
    assert pool.received(PooledBatch([1], other.token, 0, torch.zeros(1))) == [1]
    other.received(None)
    assert other.taken[0] == 1  # another pool's slot is not this pool's to give back


def test_only_the_file_descriptor_strategy_is_pooled_and_a_users_init_still_runs(monkeypatch):
    called = []
    monkeypatch.setattr(batchpool, "_installed", None)
    monkeypatch.setattr(torch.multiprocessing, "get_sharing_strategy", lambda: "file_system")
    BatchPool(1, 1, worker_init_fn=called.append).install(3)
    assert batchpool._installed is None and called == [3]
    monkeypatch.setattr(torch.multiprocessing, "get_sharing_strategy",
                        lambda: "file_descriptor")
    pool = BatchPool(1, 1)
    pool.install(0)
    assert batchpool._installed is pool


def test_outside_a_worker_a_batch_buffer_is_ordinary_memory_without_a_lease():
    (x, y), lease = batchpool.batch_buffer(((2, 3), torch.uint8), ((2,), torch.int64))
    assert lease is None and not x.is_shared()
    assert x.shape == (2, 3) and y.dtype == torch.int64
    assert y.data_ptr() % 64 == x.data_ptr() % 64  # one block, the second part aligned
    assert x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()


@pytest.mark.gpu
def test_pinned_batches_give_their_slots_back_in_the_pin_thread(images):
    sampler = ResumableDistributedSampler(len(images), 1, 0, seed=5)
    loader = RunOnLoader(images, sampler, 4, False, torch.Generator().manual_seed(0),
                         num_workers=2, prefetch_factor=2, collate_fn=images.collate_fn,
                         pin_memory=True)
    held = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        got = list(loader)  # the loop holds every pinned batch: the slots came back anyway
        want = expected(images, run_on(images, None).sampler, epoch)
        for (x, y), (wx, wy) in zip(got, want):
            assert x.is_pinned() and torch.equal(x, wx) and torch.equal(y, wy)
        held += got
    assert loader.pool.stats()["unpooled"] == 0 and loader.pool.stats()["reused"] > 0
    loader.close()


SAMPLES = {
    "tuple": [(torch.randn(3, 4), torch.tensor(i)) for i in range(5)],
    "list": [[torch.randn(2), torch.arange(3) + i, torch.ones(2, dtype=torch.uint8)]
             for i in range(5)],
    "tensor": [torch.randn(3) for _ in range(5)],
    "scalar": [torch.tensor(float(i)) for i in range(5)],
    "int_label": [(torch.randn(3, 4), i) for i in range(5)],  # torchvision's (image, class)
    "float_target": [[torch.randn(2), float(i) / 3] for i in range(5)],
}


@pytest.mark.parametrize("kind", SAMPLES)
def test_pooled_collate_gives_the_default_collates_batch(kind):
    samples = SAMPLES[kind]
    got, want = batchpool.pooled_collate(samples), default_collate(samples)
    assert type(got) is type(want)  # a tuple of tensors becomes a list, as by default
    for g, w in (zip(got, want) if isinstance(want, list) else [(got, want)]):
        assert g.dtype == w.dtype and g.shape == w.shape and g.is_contiguous()
        assert torch.equal(g, w)


@pytest.mark.parametrize("samples", [
    [{"x": torch.ones(2)}, {"x": torch.zeros(2)}],  # dicts
    [(torch.ones(2), True), (torch.zeros(2), False)],  # a bool label
    [(torch.ones(2), 1), (torch.zeros(2), 0.5)],  # an int and a float
    [(torch.ones(2), torch.tensor(1)), [torch.zeros(2), torch.tensor(0)]],  # mixed containers
    [(torch.ones(2, dtype=torch.float64),), (torch.ones(2),)],  # dtypes differ
    [(torch.ones(2, requires_grad=True),), (torch.ones(2),)],  # a tensor that needs a grad
    [(torch.ones(2), 2**70), (torch.ones(2), 1)],  # an int beyond int64
])
def test_other_samples_go_to_the_default_collate(samples):
    try:
        want = default_collate(samples)
    except Exception as e:  # its own error, unchanged
        with pytest.raises(type(e)):
            batchpool.pooled_collate(samples)
        return
    got = batchpool.pooled_collate(samples)
    assert type(got) is type(want) and repr(got) == repr(want)


@pytest.mark.parametrize("samples", [
    [(torch.ones(2),), (torch.ones(3),)],
    [{"input_ids": torch.ones(2)}, {"input_ids": torch.ones(3)}],  # (a worker's default
    [torch.ones(2, dtype=torch.int64), torch.ones(3)],  # collate says "Trying to resize")
])
def test_samples_of_different_shapes_meet_the_default_collates_error(samples):
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        batchpool.pooled_collate(samples)


def test_a_run_on_loader_without_a_collate_stacks_tensor_samples_in_reused_slots():
    from torch.utils.data import TensorDataset

    ds = TensorDataset(torch.randn(40, 3, 5, 5), torch.arange(40))
    loader = run_on(ds, None)
    held = []
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        got = list(loader)
        want = expected(ds, run_on(ds, None).sampler, epoch)
        assert len(got) == len(want) == 10
        for batch, wanted in zip(got, want):
            assert type(batch) is list and all(torch.equal(a, b) for a, b in zip(batch, wanted))
        held.append((got[0], [t.clone() for t in got[0]]))  # kept: its slot stays taken
        del got
    stats = loader.pool.stats()
    assert stats["reused"] > 0 and stats["first"] <= 2 * loader.pool.slots
    for batch, copies in held:  # never written over while held
        assert all(torch.equal(a, b) for a, b in zip(batch, copies))
    loader.close()


def test_a_stack_that_fails_gives_its_slot_back_and_the_default_collate_answers(monkeypatch):
    pool = BatchPool(1, 2)
    monkeypatch.setattr(batchpool, "_installed", pool)
    monkeypatch.setattr(batchpool, "get_worker_info", lambda: type("Info", (), {"id": 0}))
    stack, calls = torch.stack, []

    def first_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("refused")
        return stack(*args, **kwargs)

    monkeypatch.setattr(torch, "stack", first_fails)
    samples = SAMPLES["tuple"]
    got = batchpool.pooled_collate(samples)
    assert type(got) is list and all(torch.equal(g, w) for g, w in
                                     zip(got, default_collate(samples)))
    assert list(pool.taken) == [0, 0]  # the slot the failed stack had taken is free again


def test_keeping_only_the_labels_keeps_nothing_of_the_pools_blocks():
    """On CPU the loop gets the batch in the pool's block itself: labels kept across steps
    (for an epoch's metric, say) must not hold the images' block, or the pool would stop."""
    from torch.utils.data import TensorDataset

    ds = TensorDataset(torch.randn(40, 3, 8, 8), torch.arange(40))
    loader = run_on(ds, None)
    kept = []
    for epoch in range(4):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            kept.append((y, y.clone()))
    del x
    stats = loader.pool.stats()
    assert stats["unpooled"] == 0 and stats["reused"] >= 40 - 2 * loader.pool.slots
    assert all(torch.equal(a, b) for a, b in kept)
    loader.close()

"""DevicePrefetcher: pass-through semantics on CPU; side-stream copies on CUDA (marked gpu)."""
from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from data.prefetch import DevicePrefetcher, InputTransform, to_device

Pair = namedtuple("Pair", "x y")
CPU = torch.device("cpu")


class DictSet(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return {"inputs": torch.full((3, 2, 2), i, dtype=torch.uint8),
                "meta": {"id": i, "half": torch.tensor(i, dtype=torch.float16)}}


def test_to_device_keeps_nested_structure_and_types():
    batch = {"img": torch.ones(2, dtype=torch.uint8), "meta": [torch.zeros(1), "id-7", 3],
             "pair": Pair(torch.ones(1), (torch.ones(1, dtype=torch.int64),))}
    out = to_device(batch, CPU)
    assert out["img"].dtype == torch.uint8 and out["meta"][1:] == ["id-7", 3]
    assert isinstance(out["pair"], Pair) and isinstance(out["pair"].y, tuple)
    assert out["img"] is batch["img"]  # already there: no copy


def test_cpu_pass_through_order_exhaustion_and_reiteration():
    ds = TensorDataset(torch.arange(10).float().view(10, 1), torch.arange(10))
    feed = DevicePrefetcher(DataLoader(ds, batch_size=4), CPU)
    assert feed.side_stream is None and len(feed) == 3
    for _ in range(2):  # a second epoch iterates again from the start
        ys = [y.tolist() for _, y in feed]
        assert ys == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    it = iter(feed)
    for _ in range(3):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_empty_loader_yields_nothing():
    empty = TensorDataset(torch.zeros(0, 1), torch.zeros(0))
    assert list(DevicePrefetcher(DataLoader(empty, batch_size=4), CPU)) == []


def test_dict_batches_uint8_inputs_become_floats_and_the_rest_passes():
    feed = DevicePrefetcher(DataLoader(DictSet(), batch_size=3), CPU)
    batches = list(feed)
    assert len(batches) == 2
    first = batches[0]
    assert first["inputs"].dtype == torch.float32
    assert torch.allclose(first["inputs"][1], torch.full((3, 2, 2), 1 / 255))
    assert first["meta"]["half"].dtype == torch.float16 and first["meta"]["id"].tolist() == [0, 1, 2]


def test_transform_normalises_per_channel_and_sets_channels_last():
    t = InputTransform(mean=[0.5, 0.0], std=[0.5, 2.0], channels_last=True)
    x = torch.stack([torch.full((2, 3, 3), 255, dtype=torch.uint8)] * 2)
    x[:, 1] = 0
    out, y = t((x, torch.tensor([1, 2])))
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out[:, 0], torch.ones(2, 3, 3))  # (1 - 0.5) / 0.5
    assert torch.allclose(out[:, 1], torch.zeros(2, 3, 3))
    assert y.tolist() == [1, 2]
    floats = torch.randn(2, 3)
    assert InputTransform()((floats, y))[0] is floats  # nothing asked: untouched


CUDA = torch.device("cuda", 0) if torch.cuda.is_available() else None


@pytest.mark.gpu
def test_cuda_values_equal_and_one_stream_across_epochs():
    ds = TensorDataset(torch.randint(0, 255, (64, 3, 8, 8), dtype=torch.uint8),
                       torch.arange(64))
    feed = DevicePrefetcher(DataLoader(ds, batch_size=8, pin_memory=True), CUDA)
    stream = feed.side_stream
    assert stream is not None
    for epoch in range(3):
        got = [(x.cpu(), y.cpu()) for x, y in feed]
        assert feed.side_stream is stream  # never a new stream per epoch
        assert torch.equal(torch.cat([x for x, _ in got]), ds.tensors[0].float() / 255)
        assert torch.equal(torch.cat([y for _, y in got]), ds.tensors[1])
        if epoch == 0:
            torch.cuda.synchronize()
            after_first = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= after_first  # nothing accumulates per epoch


@pytest.mark.gpu
def test_cuda_copy_does_not_block_the_compute_stream():
    """While batch 1 is copied on the side stream, the compute stream is free to run step 0:
    an event queued on the compute stream completes before the copy does."""
    ds = TensorDataset(torch.randn(3, 64, 1024, 1024), torch.arange(3))  # 256 MB batches
    feed = DevicePrefetcher(DataLoader(ds, batch_size=1, pin_memory=True), CUDA)
    it = iter(feed)
    next(it)  # batch 0 is ready; batch 1's copy has just been queued on the side stream
    copy_done, compute_free = torch.cuda.Event(), torch.cuda.Event()
    copy_done.record(feed.side_stream)
    compute_free.record(torch.cuda.current_stream(CUDA))
    compute_free.synchronize()
    assert not copy_done.query(), "the compute stream waited for the next batch's copy"
    copy_done.synchronize()
    x, y = next(it)
    assert torch.equal(x.cpu(), ds.tensors[0][1:2]) and y.item() == 1

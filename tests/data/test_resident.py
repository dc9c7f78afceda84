"""ResidentBatches: the same batches as the DataLoader path, formed by indexing on the device."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from data.datasets import DigitsDataset
from data.loader import build_loader
from data.resident import ResidentBatches, nbytes, tensors_of
from trainer.config import DataConfig

CPU = torch.device("cpu")


def cfg(**kw) -> DataConfig:
    base = dict(dataset=None, input_shape=[3], num_classes=5, batch_size=8, num_workers=0)
    return DataConfig(**{**base, **kw})


def data(n: int = 45) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(5, (n,), generator=g))


class Doubled(TensorDataset):
    def __getitem__(self, i):  # a transform: samples are no longer rows of the tensors
        x, y = super().__getitem__(i)
        return 2 * x, y


def test_tensors_of_only_for_plain_rows_of_tensors():
    ds = data()
    assert tensors_of(ds) == ds.tensors and nbytes(ds.tensors) == 45 * 3 * 4 + 45 * 8
    assert tensors_of(DigitsDataset("val")) is not None
    assert tensors_of(Doubled(*ds.tensors)) is None
    assert tensors_of(torch.utils.data.Subset(ds, [0, 1])) is None


@pytest.mark.parametrize("budget_mb", [1024.0, 0.0], ids=["gathered", "indexed"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world", [1, 3])
def test_batches_equal_the_loader_path_bitwise_per_rank_epoch_and_start(world, drop_last,
                                                                        budget_mb):
    """Within data.device_budget_mb an epoch is gathered once and batches are slices of it;
    above it each batch is indexed: the same batches either way."""
    ds, c = data(), cfg(drop_last=drop_last, device_budget_mb=budget_mb)
    for rank in range(world):
        kw = dict(train=True, rank=rank, world_size=world, seed=3, device=CPU)
        host = build_loader(ds, c, **kw)
        device = build_loader(ds, c, placement="device", **kw)
        assert isinstance(device, ResidentBatches) and device.num_workers == 0
        assert device.gathered == (budget_mb > 0)
        for epoch, start in [(0, 0), (1, 0), (2, 24)]:  # 24: a resume mid-epoch
            for ld in (host, device):
                ld.sampler.set_epoch(epoch)
                ld.sampler.set_start(start)
            a, b = list(host), list(device)
            assert len(a) == len(b) == len(host) == len(device)
            # (3 ranks, drop_last, resumed at 24 of 45: 7 samples a rank, no full batch left)
            assert a or (world, drop_last, start) == (3, True, 24)
            for x, y in zip(a, b):
                assert type(x) is type(y) is list  # what the default collate gives
                assert all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(x, y))


def test_validation_shards_match_and_cover_every_sample_once():
    ds = data(10)
    seen = []
    for rank in range(3):
        host = list(build_loader(ds, cfg(), train=False, rank=rank, world_size=3))
        device = list(build_loader(ds, cfg(), train=False, rank=rank, world_size=3,
                                   placement="device"))
        assert all(torch.equal(u, v) for a, b in zip(host, device) for u, v in zip(a, b))
        seen += [row for batch in device for row in batch[1].tolist()]
    assert sorted(seen) == sorted(ds.tensors[1].tolist())


def test_uint8_batches_become_floats_on_both_paths():
    from data.prefetch import DevicePrefetcher

    ds = TensorDataset(torch.arange(12, dtype=torch.uint8).view(12, 1) * 20, torch.arange(12))
    feeds = [DevicePrefetcher(build_loader(ds, cfg(), train=False, placement=p), CPU)
             for p in ("host", "device")]
    for a, b in zip(*feeds):
        assert a[0].dtype == b[0].dtype == torch.float32 and torch.equal(a[0], b[0])
        assert float(a[0].max()) <= 1.0


def test_a_gathered_batch_changed_in_place_leaves_the_data_and_other_batches_alone():
    ds = data()
    before = [t.clone() for t in ds.tensors]
    loader = build_loader(ds, cfg(), train=True, seed=3, device=CPU, placement="device")
    assert loader.gathered
    batches = list(loader)
    batches[0][0].mul_(0)  # a model writing into its inputs
    assert all(torch.equal(a, b) for a, b in zip(before, ds.tensors))
    assert all(batch[0].abs().sum() > 0 for batch in batches[1:])
    again = list(loader)  # the next epoch gathers afresh from the untouched data
    assert again[0][0].abs().sum() > 0


def test_an_epoch_gathers_into_the_last_ones_copy_unless_a_batch_of_it_is_held():
    ds = data()
    host = build_loader(ds, cfg(), train=True, seed=3, device=CPU)
    device = build_loader(ds, cfg(), train=True, seed=3, device=CPU, placement="device")

    def epoch(e, start=0):
        for ld in (host, device):
            ld.sampler.set_epoch(e)
            ld.sampler.set_start(start)
        got, want = list(device), list(host)
        assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))
        return got, got[0][0].data_ptr()

    first = epoch(0)[1]  # (the batches are let go of here, as the trainer's epoch does)
    held, second = epoch(1)
    assert second == first  # the same memory, gathered anew
    copies = [[t.clone() for t in batch] for batch in held]
    third = epoch(2)[1]  # a batch of epoch 1 is still held: a new copy, epoch 1's untouched
    assert third != second
    assert all(torch.equal(a, b) for h, c in zip(held, copies) for a, b in zip(h, c))
    del held
    assert epoch(3, start=16)[1] != third  # a resumed epoch is shorter: a copy of its size
    for ld in (host, device):
        ld.sampler.set_epoch(4)
        ld.sampler.set_start(0)
    want = list(host)
    left = iter(device)  # epoch 4's pass, left suspended after a batch (nothing else holds it)
    got = [[t.clone() for t in next(left)]]
    device.sampler.set_epoch(5)
    assert len(list(device)) == len(want)  # another pass meanwhile: a copy of its own
    got += [[t.clone() for t in batch] for batch in left]
    assert all(torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))

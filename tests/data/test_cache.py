"""write_arrays and the data.cache modes give back exactly the source samples."""
from __future__ import annotations


import pytest
import torch

from data import cache
from data.datasets import MemmapDataset, SyntheticDataset


def source():
    return SyntheticDataset("train", num_samples=10, input_shape=(2, 4, 4), num_classes=3)


def same(a, b):
    assert len(a) == len(b)
    for i in range(len(a)):
        assert torch.equal(a[i][0], b[i][0]) and int(a[i][1]) == int(b[i][1])


def test_write_arrays_round_trip_and_no_temp_files(tmp_path):
    shape = cache.write_arrays(source(), tmp_path / "train", num_workers=2)
    assert shape == (2, 4, 4)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == ["x.npy", "y.npy"]
    same(MemmapDataset("train", str(tmp_path)), source())


@pytest.mark.parametrize("mode", ["none", "memory", "shm"])
def test_cache_modes_keep_the_samples(mode, monkeypatch, tmp_path):
    monkeypatch.setattr(cache, "SHM_ROOT", tmp_path)  # keep the test out of /dev/shm
    cached = cache.cache_dataset(source(), mode, tag="t")
    same(cached, source())
    if mode == "shm":
        assert isinstance(cached, MemmapDataset) and str(tmp_path) in cached.x.path


def test_cache_refuses_datasets_that_are_not_pairs():
    class Triples(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return torch.zeros(1), torch.zeros(1), torch.zeros(1)

    with pytest.raises(ValueError, match="\\(input, target\\) tensor pairs"):
        cache.cache_dataset(Triples(), "memory", tag="t")

from __future__ import annotations

import time

import pytest
import torch

from data.datasets import DigitsDataset, SyntheticDataset


def test_digits_split_is_fixed_disjoint_and_complete():
    train, val = DigitsDataset("train"), DigitsDataset("val")
    assert len(train) + len(val) == 1797 and len(val) == 359
    x, y = train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= float(train.x.min()) and float(train.x.max()) <= 1.0
    rows = {tuple(r.flatten().tolist()) for r in train.x}
    overlap = sum(tuple(r.flatten().tolist()) in rows for r in val.x)
    assert overlap < 5  # a few digits are pixel-identical duplicates in the source
    assert torch.equal(DigitsDataset("val").x, val.x)


def test_bad_split_and_fraction():
    with pytest.raises(ValueError, match="split='test'"):
        DigitsDataset("test")
    with pytest.raises(ValueError, match="val_fraction"):
        DigitsDataset("train", val_fraction=1.5)


def test_synthetic_is_a_pure_function_of_index():
    a = SyntheticDataset("train", num_samples=10, input_shape=[2, 4, 4], num_classes=3)
    b = SyntheticDataset("train", num_samples=10, input_shape=[2, 4, 4], num_classes=3)
    for i in (0, 9, 3):
        assert torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1])
    assert not torch.equal(a[0][0], a[1][0])
    val = SyntheticDataset("val", num_samples=10, input_shape=[2, 4, 4], num_classes=3)
    assert not torch.equal(a[0][0], val[0][0])
    with pytest.raises(IndexError):
        a[10]


def test_synthetic_uint8_and_cpu_cost():
    d = SyntheticDataset("train", num_samples=4, input_shape=[3, 8, 8], dtype="uint8",
                         cost_ms=20)
    t0 = time.process_time()
    x, _ = d[0]
    assert x.dtype == torch.uint8
    assert time.process_time() - t0 >= 0.015  # CPU time, not sleep


def test_synthetic_is_learnable_labels_follow_prototypes():
    d = SyntheticDataset("train", num_samples=200, input_shape=[16], num_classes=4, noise=0.1)
    hits = sum(int(((d.prototypes - x).flatten(1).norm(dim=1)).argmin()) == int(y)
               for x, y in (d[i] for i in range(200)))
    assert hits == 200

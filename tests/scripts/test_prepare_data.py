"""scripts/prepare_data.py writes a dataset that data=memmap trains on."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from data.datasets import DigitsDataset, MemmapDataset
from tests.helpers import ROOT, compose_cfg
from trainer.runner import train


@pytest.mark.slow
def test_prepare_then_train_on_memmap(tmp_path):
    out = tmp_path / "digits"
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["input_shape"] == [1, 8, 8] and meta["num_classes"] == 10
    assert meta["splits"] == {"train": 1438, "val": 359}
    mm, src = MemmapDataset("val", str(out)), DigitsDataset("val")
    assert all(torch.equal(mm[i][0], src[i][0]) for i in range(len(src)))
    direct = train(compose_cfg(tmp_path / "a", "trainer.max_epochs=2"))
    cached = train(compose_cfg(tmp_path / "b", "data=memmap", f"data.dataset.root={out}",
                               "data.eval_batch_size=256", "trainer.max_epochs=2"))
    assert cached["val_acc"] == direct["val_acc"]  # same samples, same run

"""scripts/tune_loader.py sweeps the grid and prints a paste-able override line."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_smoke_prints_best_override_line(tmp_path):
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [sys.executable, "scripts/tune_loader.py", "--workers", "0", "1", "--prefetch", "2", "4",
         "--batches", "3", "--out", str(out), "data=synthetic", "data.dataset.num_samples=256"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    grid = [(r["num_workers"], r["prefetch_factor"]) for r in result["results"]]
    assert grid == [(0, 2), (1, 2), (1, 4)]  # prefetch_factor means nothing without workers
    assert all(r["samples_per_s"] > 0 for r in result["results"])
    line = result["best_overrides"]
    assert line.startswith("data.num_workers=") and "data.prefetch_factor=" in line
    assert line in proc.stdout

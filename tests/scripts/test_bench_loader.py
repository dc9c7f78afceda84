"""scripts/bench_loader.py end to end in a tiny configuration (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_smoke_writes_table_json_and_png(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_loader.py", "--samples", "64", "--shape", "3", "16", "16",
         "--cost-ms", "1", "--compute-ms", "2", "--epochs", "2", "--workers", "2",
         "--memory-workers", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bound" in proc.stdout and "c_pipeline" in proc.stdout
    result = json.loads(out.read_text())
    names = [r["config"] for r in result["results"]]
    assert names == ["a_sync", "b_workers", "c_pipeline", "c_epoch_restart", "d_compute_only"]
    for r in result["results"]:
        assert r["epoch_s"] > 0 and len(r["epochs_s"]) == 2 and r["vs_bound"] > 0
    assert result["bound_s"] > 0 and result["data_cost_ms_per_sample"] > 0
    mem = result["memory"]
    assert mem["workers"] == 2 and mem["dataset_mb"] > 0 and "extra_frac_of_dataset" in mem
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

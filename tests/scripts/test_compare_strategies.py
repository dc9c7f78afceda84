"""scripts/compare_strategies.py end to end in a tiny configuration (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT


@pytest.mark.slow
def test_smoke_writes_table_and_json(tmp_path):
    out = tmp_path / "cmp.json"
    proc = subprocess.run(
        [sys.executable, "scripts/compare_strategies.py", "--steps", "2", "--repeats", "1",
         "--global-batch", "16", "--out", str(out), "data.num_workers=0", "model=mlp"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "samples_per_s" in proc.stdout
    result = json.loads(out.read_text())
    assert {"machine", "global_batch", "steps", "repeats", "results"} <= result.keys()
    rows = {r["strategy"]: r for r in result["results"]}
    assert set(rows) == {"single", "dp", "ddp"}
    for name in ("single", "ddp"):
        assert rows[name]["runs"] == 1 and rows[name]["samples_per_s"] > 0
        assert 0 <= rows[name]["data_wait_frac"] <= 1 and rows[name]["peak_mem_mb"] > 0
    assert rows["ddp"]["per_rank_batch"] == 8 and rows["ddp"]["ranks"] == 2
    if not torch.cuda.is_available():
        assert rows["dp"]["skipped"] == "DataParallel needs CUDA" and rows["dp"]["runs"] == 0
        assert "skipped dp: DataParallel needs CUDA" in proc.stdout

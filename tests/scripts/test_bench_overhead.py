"""scripts/bench_overhead.py end to end in a tiny configuration (no timing assertions)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_smoke_compares_plain_and_stoker(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, "scripts/bench_overhead.py", "--steps", "3",
                           "--repeats", "1", "--samples", "256", "--batch", "16",
                           "--workers", "0", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["runner"]: r for r in result["results"]}
    assert rows["plain"]["vs_plain"] == 1.0 and rows["plain"]["samples_per_s"] > 0
    assert rows["stoker"]["runs"] == 1 and rows["stoker"]["vs_plain"] > 0
    assert result["target"] == 0.98 and result["workload"]["steps"] == 3
    if not any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning")):
        assert rows["lightning"]["skipped"] == "PyTorch Lightning not installed"
        assert "skipped lightning" in proc.stdout

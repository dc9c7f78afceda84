"""scripts/bench_checkpoint.py end to end on a tiny model (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_smoke_reports_sync_and_async_stalls(tmp_path):
    out = tmp_path / "ckpt.json"
    proc = subprocess.run([sys.executable, "scripts/bench_checkpoint.py", "--width", "64",
                           "--layers", "1", "--repeats", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"sync", "async"}
    for r in rows.values():
        assert r["state_mb"] > 0 and r["stall_s"] > 0 and r["write_s"] >= r["stall_s"]
        assert len(r["runs"]) == 2
    assert rows["sync"]["stall_vs_sync"] == 1.0

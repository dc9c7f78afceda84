"""scripts/bench_loader.py end to end in a tiny configuration (no timing assertions), and its
bound's data cost on a fake clock."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, usage_error

sys.path.insert(0, str(ROOT / "scripts"))  # as the scripts run: benchlib beside them


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


def test_the_data_cost_is_the_least_disturbed_timing(monkeypatch):
    """A timing disturbed by another process's load reads more than the cost; the bound takes
    the least disturbed of its repeats (a fake clock: the dataset advances it)."""
    import bench_loader

    clock = [0.0]

    class Costly:
        calls = 0

        def __len__(self):
            return 100

        def __getitem__(self, i):
            Costly.calls += 1
            clock[0] += 0.010 if Costly.calls <= 1 + 16 else 0.002  # the first timing: loaded

    monkeypatch.setattr(bench_loader.time, "perf_counter", lambda: clock[0])
    assert bench_loader.data_cost_s(Costly(), samples=16, repeats=3) == pytest.approx(0.002)


@pytest.mark.parametrize("args,needle", [
    (["--batch", "0"], "argument --batch: 0: must be >= 1"),
    (["--prefetch-factor", "0"], "argument --prefetch-factor: 0: must be >= 1"),
    (["--memory-workers", "-2"], "argument --memory-workers: -2: must be >= 0"),
    (["--cost-ms", "-5"], "argument --cost-ms: -5: must be >= 0"),
    (["--compute-ms", "-1"], "argument --compute-ms: -1: must be >= 0"),
    (["--shape", "3", "0", "16"], "argument --shape: 0: must be >= 1"),
    (["--png", "{tmp}"], "--png {tmp}: is a directory"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, args, needle):
    import bench_loader

    assert needle.format(tmp=tmp_path) in usage_error(
        capsys, bench_loader.parse,
        [a.format(tmp=tmp_path) for a in args] + ["--out", str(tmp_path / "b.json")])

"""scripts/bench_overhead.py end to end in a tiny configuration (no timing assertions)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_smoke_compares_every_runner_with_its_plain_counterpart(tmp_path):
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, "scripts/bench_overhead.py", "--steps", "6",
                           "--warmup", "2", "--repeats", "1", "--startup-repeats", "1",
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["workload"], r["runner"]): r for r in result["results"]}
    for workload, runner, base in [("tiny", "stoker", "plain"), ("cnn", "stoker", "plain"),
                                   ("tiny", "stoker_device", "plain_indexed")]:
        row = rows[(workload, runner)]
        assert row["counterpart"] == base and row["runs"] == 1
        assert row["vs_plain"] > 0 and row["step_us"] > 0 and row["cpu_us"] > 0
        assert row["overhead_us"] == pytest.approx(
            row["best_step_us"] - rows[(workload, base)]["best_step_us"])
        assert row["best_step_us"] <= row["step_us"] * 1.0001  # the fastest stretch
        # the same initial weights, order and steps as the counterpart: the same final weights
        assert row["weights_diff"] < 1e-6 and "did not take the steps" not in proc.stdout
    for runner in ("lockstep_host", "lockstep_device", "lockstep_null"):  # in one process
        row = rows[("tiny", runner)]
        assert row["runs"] == 1 and row["counterpart"] == (
            "a second plain loop in the same process" if runner == "lockstep_null"
            else "plain steps in the same process")
        assert row["vs_plain"] > 0 and row["plain_best_step_us"] > 0
        assert row["overhead_us"] == pytest.approx(
            row["best_step_us"] - row["plain_best_step_us"])
        assert row["weights_diff"] < 1e-6  # the same steps, side by side
    assert result["target"] == 0.97 and result["workloads"]["tiny"]["steps"] == 6
    # each run is reported as it ends (a run cut off by a time limit shows how far it got),
    # and the finished file is not marked partial
    assert "tiny repeat 1/1 stoker_device: best step" in proc.stderr
    assert "cnn repeat 1/1 stoker: best step" in proc.stderr and "partial" not in result
    assert [r["command"] for r in result["startup"]] == [
        "python -c 'import torch'", "python -c 'import torch; AdamW(...)'",
        "python train.py debug=fdr"]
    if not any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning")):
        assert result["lightning"] is None
        assert rows[("tiny", "lightning")]["skipped"] == "PyTorch Lightning not installed"
        assert "skipped lightning" in proc.stdout
    else:  # the version measured is recorded
        assert result["lightning"].split()[0] in ("lightning", "pytorch-lightning")

"""scripts/bench_speed.py end to end in a tiny configuration (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, usage_error


def run_script(*args, timeout=600):
    return subprocess.run([sys.executable, "scripts/bench_speed.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_smoke_measures_each_switch_against_the_baseline(tmp_path):
    out = tmp_path / "speed.json"
    proc = run_script("--steps", "4", "--log-every", "2", "--samples", "64", "--batch", "8",
                      "--image", "16", "--workers", "0", "--repeats", "1",
                      "--switches", "channels_last,activation_checkpointing,tf32_off",
                      "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("python scripts/bench_speed.py --steps 4")
    assert {"machine", "device", "model", "precision", "workload", "repeats"} <= result.keys()
    rows = {r["switch"]: r for r in result["results"]}
    assert list(rows) == ["baseline", "channels_last", "activation_checkpointing", "tf32_off"]
    assert rows["baseline"]["vs_baseline"] == 1.0
    for name in ("baseline", "channels_last", "activation_checkpointing"):
        r = rows[name]
        assert r["runs"] == 1 and r["samples_per_s"] > 0 and r["peak_mem_mb"] > 0
        assert 0 <= r["data_wait_frac"] <= 1 and r["vs_baseline"] > 0
    if not torch.cuda.is_available():  # a CUDA-only switch gets no number on CPU
        assert rows["tf32_off"]["skipped"] == "needs CUDA"
        assert "samples_per_s" not in rows["tf32_off"]


def test_unknown_switch_is_refused_with_the_valid_ones(tmp_path):
    proc = run_script("--switches", "turbo", "--out", str(tmp_path / "x.json"), timeout=60)
    assert proc.returncode == 2
    assert "--switches: unknown turbo; valid: baseline, compile" in proc.stderr


@pytest.mark.parametrize("args,needle", [
    (["--batch", "0"], "argument --batch: 0: must be >= 1"),
    (["--log-every", "0"], "argument --log-every: 0: must be >= 1"),
    (["--image", "0"], "argument --image: 0: must be >= 1"),
    (["--tokens", "0"], "argument --tokens: 0: must be >= 1"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, args, needle):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_speed

    assert needle in usage_error(capsys, bench_speed.main,
                                 args + ["--out", str(tmp_path / "s.json")])


def test_a_runs_one_line_error_is_relayed_without_a_traceback(tmp_path):
    out = tmp_path / "speed.json"
    proc = run_script("--switches", "baseline", "--repeats", "1", "--extra", "data.bogus=1",
                      "--out", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("stoker: error: Could not override 'data.bogus'")
    assert not out.exists()

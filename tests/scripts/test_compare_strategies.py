"""scripts/compare_strategies.py end to end in a tiny configuration (no timing assertions)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


@pytest.mark.parametrize("value", ["0", "-64"])
def test_a_global_batch_below_one_is_a_usage_error(tmp_path, capsys, value):
    sys.path.insert(0, str(ROOT / "scripts"))
    import compare_strategies

    with pytest.raises(SystemExit) as e:
        compare_strategies.main(["--global-batch", value, "--out", str(tmp_path / "c.json")])
    assert e.value.code == 2
    assert f"argument --global-batch: {value}: must be >= 1" in capsys.readouterr().err


def test_a_bad_override_is_the_runs_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/compare_strategies.py", "--steps", "2", "--repeats", "1",
         "--out", str(tmp_path / "c.json"), "data.batch_size=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "stoker: error: data.batch_size=0: must be >= 1"


def _ours(marker: str) -> list:
    """Processes whose command line holds `marker` (this test's temp dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.slow
def test_sigterm_ends_the_runs_and_removes_their_folder(tmp_path):
    """The train.py run and its loader workers end with the script, and its temp folder goes."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "scripts/compare_strategies.py", "--steps", "100000", "--repeats", "1",
         "--out", str(tmp_path / "c.json"), "data.num_workers=1", "trainer.max_epochs=1000"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("stoker-compare-*/single-0/metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        left = _ours(str(tmp_path))
        for pid in left:  # should it fail: the processes this test started
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 143 and err.strip() == "compare_strategies.py: stopped by SIGTERM"
    assert left == [] and not list(tmp_path.glob("stoker-compare-*"))
    assert not (tmp_path / "c.json").exists()

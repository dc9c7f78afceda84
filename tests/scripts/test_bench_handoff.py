"""scripts/bench_handoff.py end to end in a tiny configuration (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, usage_error


def test_smoke_measures_both_collates_in_alternating_fresh_processes(tmp_path):
    out = tmp_path / "handoff.json"
    proc = subprocess.run([sys.executable, "scripts/bench_handoff.py", "--batch", "8",
                           "--image", "8", "--batches", "4", "--epochs", "1", "--workers", "1",
                           "--repeats", "2", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("python scripts/bench_handoff.py --batch 8")
    rows = {r["collate"]: r for r in result["results"]}
    assert list(rows) == ["pooled", "default"]
    for r in rows.values():
        assert r["runs"] == 2 and r["samples_per_s"] > 0 and r["main_cpu_us_per_batch"] > 0
    assert rows["default"]["vs_default"] == 1.0 and rows["pooled"]["vs_default"] > 0
    # the pooled arm formed its batches in the pool's reused blocks; the default one never
    assert all(r["pool"]["reused"] > 0 for r in rows["pooled"]["all"])
    assert all(r["pool"] == {"reused": 0, "first": 0, "unpooled": 0}
               for r in rows["default"]["all"])
    order = [line.split(": ")[0] for line in proc.stderr.splitlines()
             if line.startswith("repeat ")]
    assert order == ["repeat 1/2 pooled", "repeat 1/2 default", "repeat 2/2 default",
                     "repeat 2/2 pooled"]  # fresh processes, the order flipped per repeat
    assert "pooled" in proc.stdout and f"wrote {out}" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["--batch", "0"], "argument --batch: 0: must be >= 1"),  # was a ZeroDivisionError
    (["--image", "0"], "argument --image: 0: must be >= 1"),
    (["--prefetch-factor", "0"], "argument --prefetch-factor: 0: must be >= 1"),
    (["--workers", "0"], "argument --workers: 0: must be >= 1"),  # no handoff without workers
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, args, needle):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_handoff

    assert needle in usage_error(capsys, bench_handoff.parse,
                                 args + ["--out", str(tmp_path / "h.json")])

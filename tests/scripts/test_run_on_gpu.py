"""scripts/run_on_gpu.sh: valid shell, and an unknown part is refused with the list of parts
(the parts themselves need a CUDA machine: run there, see the README's "On a GPU")."""
from __future__ import annotations

import os
import subprocess

from tests.helpers import ROOT


def test_is_valid_shell_and_refuses_an_unknown_part(tmp_path):
    script = str(ROOT / "scripts" / "run_on_gpu.sh")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    env = {**os.environ, "OUT": str(tmp_path / "out"), "R": str(tmp_path / "results")}
    proc = subprocess.run(["bash", script, "benchmarks"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "usage: run_on_gpu.sh checks | PART..." in proc.stdout
    assert "bench_overhead" in proc.stdout

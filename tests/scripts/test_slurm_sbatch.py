"""scripts/slurm/train.sbatch runs under a stand-in srun that starts the tasks as SLURM does."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, free_port

FAKE_SRUN = """#!/bin/bash
# stand-in for srun: start SLURM_NTASKS copies of the command with SLURM's per-task variables
[[ "$1" == --kill-on-bad-exit=1 ]] && shift
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


@pytest.mark.slow
def test_sbatch_script_trains_with_two_tasks(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "STOKER_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=sys.executable, SLURM_JOB_ID="5151",
               SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
               MASTER_PORT=str(free_port()))
    run = tmp_path / "run"
    proc = subprocess.run(
        ["bash", "scripts/slurm/train.sbatch", f"hydra.run.dir={run}", "trainer.max_steps=3",
         "trainer.progress_bar=false", "data.num_workers=0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3


def test_the_script_outside_a_slurm_job_is_one_line():
    """Run with bash outside SLURM it said `SLURM_JOB_NODELIST: unbound variable`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", "scripts/slurm/train.sbatch", "optim.lr=0.1"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == ("stoker: error: scripts/slurm/train.sbatch runs inside a SLURM job: "
                           "submit it with sbatch scripts/slurm/train.sbatch ARGS (outside "
                           "SLURM: torchrun --standalone --nproc_per_node=N train.py ARGS)\n")

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


def test_a_call_cut_off_by_its_limit_still_leaves_its_archive_and_no_process(tmp_path):
    """The device tool ends a call that runs past its limit; what the steps so far wrote must
    come back (the archive, packed once more on SIGTERM) and the background packer must end
    with the rest. A stand-in python3 passes the import check and then hangs in its step."""
    import signal
    import time

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\ncase "$1" in -c) exit 0 ;; esac\n'
                                  f'echo $$ > {tmp_path}/step.pid\nexec sleep 60\n')
    (fake / "python3").chmod(0o755)
    out, results = tmp_path / "out", tmp_path / "results"
    env = {**os.environ, "OUT": str(out), "R": str(results),
           "PATH": f"{fake}:{os.environ['PATH']}"}
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "run_on_gpu.sh"), "checkpoint"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    pid_file = tmp_path / "step.pid"

    def step_started() -> bool:  # (its log opened and the stand-in's pid written: it hangs)
        return (results / "bench_checkpoint.log").exists() and pid_file.exists() and \
            pid_file.read_text().endswith("\n")

    deadline = time.monotonic() + 30
    while not step_started() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert step_started(), proc.stdout.read() if proc.poll() else ""
    os.killpg(proc.pid, signal.SIGTERM)  # the whole call, as a limit ends it
    assert proc.wait(timeout=30) == 124
    assert (out / "gpu-results.tar.gz").stat().st_size > 0
    assert "bench_checkpoint           rc=124" in (out / "gpu-summary.txt").read_text()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anything left of the call: the packer, a sleep
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("a process of the call outlived it")
    step = int(pid_file.read_text())  # (timeout leads a group of its own)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(step, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the cut step outlived the call")

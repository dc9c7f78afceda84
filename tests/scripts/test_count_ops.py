"""scripts/count_ops.py: operations a training step dispatches, by kind, from the CLI."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT


def count_ops(tmp_path, *args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts/count_ops.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_counts_every_operation_of_a_step_and_sees_the_optimizer_path(tmp_path):
    """The default job's step, with AdamW's per-parameter loop and its multi-tensor path:
    one lerp per parameter tensor against one for all of them."""
    got = {}
    for foreach in ("false", "true"):
        out = tmp_path / f"{foreach}.json"
        proc = count_ops(tmp_path, "--skip", "3", f"optim.foreach={foreach}",  # intermixed
                         "--steps", "5", "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[foreach] = json.loads(out.read_text())
        assert "operations a step:" in proc.stdout and "aten.mm.default" in proc.stdout
    loop, multi = got["false"], got["true"]
    params = 6  # the default MLP (hidden [128, 128]): three linear layers' weights and biases
    assert loop["ops"]["aten.lerp_.Scalar"] == params
    assert multi["ops"]["aten._foreach_lerp_.Scalar"] == 1
    assert "aten.lerp_.Scalar" not in multi["ops"]
    assert multi["per_step"] < loop["per_step"]
    for r in (loop, multi):
        assert r["per_step"] == pytest.approx(r["work"] + r["view"] + r["marker"] + r["read"])
        assert r["kinds"]["aten.mm.default"] == "work" and r["kinds"]["aten.t.default"] == "view"
        assert r["steps"] == 5 and r["skip"] == 3
        # forward and backward of three linear layers: at least one matmul each way per layer
        assert r["ops"]["aten.addmm.default"] + r["ops"]["aten.mm.default"] >= 6


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["trainer.compile.enabled=true"], "trainer.compile.enabled=true: a compiled step runs "
                                       "kernels a dispatch mode does not see"),
    (["--skip", "30", "--steps", "30", "trainer.max_epochs=1"],
     "the run stopped after 23 steps, before step 60"),
    (["model.nope=1"], "model.nope"),
])
def test_what_it_cannot_count_is_one_line_and_exit_2(tmp_path, args, message):
    proc = count_ops(tmp_path, *args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_model_of_ones_own_from_the_directory_it_runs_in(tmp_path):
    """`_target_` finds the user's module where the command runs, as with train.py; one more
    layer, more operations."""
    (tmp_path / "mynet.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Sequential):\n"
        "    def __init__(self, input_shape, num_classes, depth=1):\n"
        "        width = 1\n"
        "        for d in input_shape:\n"
        "            width *= d\n"
        "        layers = [torch.nn.Flatten()]\n"
        "        layers += [torch.nn.Linear(width, width) for _ in range(depth)]\n"
        "        super().__init__(*layers, torch.nn.Linear(width, num_classes))\n")
    per_step = []
    for depth in (1, 3):
        out = tmp_path / f"{depth}.json"
        proc = count_ops(tmp_path, "model=custom", "model._target_=mynet.Net",
                         f"+model.depth={depth}", "--skip", "2", "--steps", "3",
                         "--out", str(out), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        per_step.append(json.loads(out.read_text())["per_step"])
    assert per_step[1] > per_step[0]
    assert not (tmp_path / "outputs").exists()  # nothing written where it ran


@pytest.mark.parametrize("args, message", [
    (["--top", "0"], "argument --top: 0: must be >= 1"),
    (["--skip", "-1"], "argument --skip: -1: must be >= 1"),
    (["--out", "."], "--out .: is a directory"),
])
def test_bad_options_are_refused_before_the_run(tmp_path, args, message):
    proc = count_ops(tmp_path, *args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr and "operations a step" not in proc.stdout


@pytest.mark.slow
def test_a_ctrl_c_while_counting_is_one_line_and_exit_130(tmp_path):
    """Stopped at a step (train.py's preemption handling turns the Ctrl-C into Preempted)."""
    out = tmp_path / "ops.json"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts/count_ops.py"), "--skip", "5", "--steps", "200000",
         "trainer.max_epochs=100000", "--out", str(out)], cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("stoker-ops-*/metrics.jsonl")):  # training has started
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    # the trainer's word at the signal ("stopping at the end of this step"), then one line
    *said, line = err.strip().splitlines()
    assert all(ln.startswith("stoker: stopping at the end of this step") for ln in said), err
    assert line.startswith("count_ops.py: stopped on a Ctrl-C at step ")
    assert line.endswith("; nothing counted or written")
    assert not out.exists() and not list(tmp_path.glob("stoker-ops-*"))

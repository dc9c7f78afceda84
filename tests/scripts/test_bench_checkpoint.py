"""scripts/bench_checkpoint.py end to end on a tiny model (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

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


sys.path.insert(0, str(ROOT / "scripts"))  # as the scripts run: benchlib beside them


@pytest.mark.parametrize("args,needle", [
    (["--width", "0"], "argument --width: 0: must be >= 1"),
    (["--width", "-5"], "argument --width: -5: must be >= 1"),
    (["--layers", "-1"], "argument --layers: -1: must be >= 0"),
    (["--dir", "{file}"], "--dir {file}: is a file, not a folder"),
    (["--dir", "{file}/sub"], "--dir {file}/sub: {file} is a file, not a folder"),
    (["--width", "10000000", "--layers", "100"], "--width 10000000 --layers 100: the state "
     "needs about 260,770,349.6 GiB while saved, and "),
])
def test_bad_arguments_are_one_line_before_the_state_is_built(tmp_path, capsys, args, needle):
    import bench_checkpoint

    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(SystemExit) as e:
        bench_checkpoint.main([a.format(file=file) for a in args]
                              + ["--out", str(tmp_path / "o.json")])
    assert e.value.code == 2 and needle.format(file=file) in capsys.readouterr().err


def test_a_full_disk_is_one_line_naming_the_dir(tmp_path, capsys, monkeypatch):
    import errno

    import bench_checkpoint
    import trainer.checkpoint

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer.checkpoint.torch, "save", full)
    where, out = tmp_path / "ckpts", tmp_path / "o.json"
    with pytest.raises(SystemExit) as e:
        bench_checkpoint.main(["--width", "8", "--layers", "1", "--repeats", "1",
                               "--dir", str(where), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "\n" not in err
    assert f"error: --dir {where}: cannot write the checkpoints: checkpoint {where}/" in err
    assert err.endswith("the write failed (No space left on device)"), err
    assert not out.exists() and list(where.iterdir()) == []  # its temp folder went too


def test_the_memory_the_state_needs_is_its_seven_floats_a_parameter():
    import bench_checkpoint

    state = bench_checkpoint.build_state(64, 2, torch.device("cpu"))
    params = sum(t.numel() for t in state["model"].values())
    assert bench_checkpoint.needed_bytes(64, 2) == params * 4 * 7
    assert bench_checkpoint.state_mb(state) * 2**20 >= params * 4 * 3  # (weights, moments)

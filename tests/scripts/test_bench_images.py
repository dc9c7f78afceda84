"""scripts/bench_images.py end to end on a few small files (no timing assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, usage_error


@pytest.mark.slow
def test_smoke_measures_every_path_and_writes_json(tmp_path):
    out = tmp_path / "images.json"
    proc = subprocess.run(
        [sys.executable, "scripts/bench_images.py", "--count", "40", "--image-size", "48",
         "--size", "32", "--batch", "8", "--workers", "2", "--compute-ms", "1",
         "--epochs", "2", "--repeats", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    names = [r["config"] for r in result["results"]]
    assert names == ["a_0_workers", "b_2_workers", "c_2_workers_uint8", "c_plain_dataloader",
                     "d_memmap", "e_cache_memory", "e_cache_shm", "e_cache_disk", "e_cache_lru",
                     "f_shards", "decode_1_process", "decode_2_processes"]
    for r in result["results"]:
        epochs = 1 if r["config"].startswith("decode_") else 2  # decoding, not a feed's epochs
        assert r["epoch_s"] > 0 and r["runs"] == 1 and len(r["epochs_s"][0]) == epochs
        assert r["samples_per_s"] > 0
    assert result["bound_s"] > 0 and result["decode_s_per_epoch"] > 0
    # the machine's bound: 2 processes decoding together, no loader
    assert result["decode_parallel_s_per_epoch"] > 0 and result["machine_bound_s"] > 0
    assert result["c_vs_machine_bound"] > 0
    assert result["c_vs_bound"] > 0 and result["d_vs_b"] > 0
    assert result["c_vs_bound_paired"] > 0 and result["c_vs_machine_bound_paired"] > 0
    pool = {r["config"]: r["batch_pool"] for r in result["results"]}["c_2_workers_uint8"]
    # (c)'s 2 epochs of 5 batches (and what the workers made ahead), all in the pool's slots
    assert pool["reused"] + pool["first"] >= 5 * 2 and pool["unpooled"] == 0
    assert "(c) vs bound" in proc.stdout and "target" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["--batch", "0"], "argument --batch: 0: must be >= 1"),
    (["--size", "0"], "argument --size: 0: must be >= 1"),
    (["--image-size", "0"], "argument --image-size: 0: must be >= 1"),
    (["--compute-ms", "-1"], "argument --compute-ms: -1: must be >= 0"),
    (["--count", "5"], "argument --count: 5: must be >= 20"),
    (["--workers", "0"], "argument --workers: 0: must be >= 1"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, args, needle):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_images

    assert needle in usage_error(capsys, bench_images.main,
                                 args + ["--out", str(tmp_path / "i.json")])

"""scripts/bench_gpu.py: the CPU smoke mode end to end, and its MFU arithmetic."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_gpu  # noqa: E402


@pytest.mark.slow
def test_smoke_writes_every_configuration(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["command"].endswith("--smoke --out " + str(out))
    assert result["targets"] == {"data_wait_frac_max": 0.01, "prefetcher_vs_plain_min": 0.9}
    assert "partial" not in result  # the finished file replaces the partial one
    assert not (tmp_path / "gpu.partial.json").exists()  # and its side file goes
    rows = result["training"]
    assert [(r["model"], r["precision"], r["prefetch"]) for r in rows] == [
        ("cnn", "bf16", True), ("cnn", "bf16", False), ("transformer", "bf16", True),
        ("cnn", "fp16", True), ("cnn", "fp16", False), ("transformer", "fp16", True),
        ("feed", "bf16", True), ("feed", "bf16", False)]
    cuda = torch.cuda.is_available()
    for r in rows:
        if r["precision"] == "fp16" and not cuda:
            assert r["skipped"] == "fp16 needs CUDA" and "samples_per_s" not in r
            continue
        assert r["samples_per_s"] > 0 and 0 <= r["data_wait_frac"] <= 1 and r["peak_mem_mb"] > 0
        # the GPU's idle time for data: measured on CUDA alone (trainer/devicewait.py)
        assert (r["device_wait_frac"] is None) == (not cuda)
        if r["model"] == "transformer":
            assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 16)
            assert r["flops_per_token"] > 0
            assert (r["mfu"] is None) == (not cuda or result["peak_flops"] is None)
    for c in result["copy"]:
        if cuda:
            assert c["plain_pinned_gbps"] > 0 and c["prefetcher_vs_plain"] > 0
        else:
            assert c["skipped"] == "needs CUDA" and "prefetcher_gbps" not in c


def test_full_run_without_cuda_is_refused_in_one_line(tmp_path):  # (CUDA hidden: conftest)
    proc = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--out", str(tmp_path / "x")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device: the full GPU benchmark needs one" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_the_feed_rows_change_the_model_alone():
    """The feed ceiling is read against the CNN: every data setting must be the CNN's."""
    full = bench_gpu.FULL
    cnn, feed = bench_gpu.cnn_overrides(full), bench_gpu.feed_overrides(full)
    assert [o for o in cnn if not o.startswith("model")] == \
        [o for o in feed if not o.startswith("model")]
    assert "model=cnn" in cnn and "model=mlp" in feed and "model.hidden=[]" in feed


def test_peak_flops_by_device_name_or_given():
    assert bench_gpu.peak_flops("NVIDIA H100 80GB HBM3", None) == 989e12
    assert bench_gpu.peak_flops("NVIDIA H100 PCIe", None) == 756e12
    assert bench_gpu.peak_flops("NVIDIA A100-SXM4-80GB", None) == 312e12
    assert bench_gpu.peak_flops("Mystery GPU", None) is None
    assert bench_gpu.peak_flops("Mystery GPU", 100.0) == 100e12
    assert bench_gpu.peak_flops(None, None) is None


def test_lm_flops_match_the_model():
    from trainer.models import Transformer

    s = bench_gpu.SMOKE
    m = s["lm"]
    model = Transformer([m["tokens"]], m["vocab"], dim=m["dim"], layers=m["layers"],
                        heads=m["heads"])
    assert bench_gpu.lm_flops_per_token(s) == model.flops_per_token()


@pytest.mark.gpu
def test_copy_bandwidth_rows_on_cuda():
    rows = bench_gpu.copy_rows(dict(copy_mb=[1.0, 0.0625], copies=4, copy_total_mb=1),
                               cuda=True, repeats=1)
    assert [r["batches"] for r in rows] == [4, 16]  # small batches: enough of them to time
    for r in rows:
        assert r["plain_pinned_gbps"] > 0 and r["prefetcher_gbps"] > 0
        # the same bytes over the same batches: GB/s and time per batch say the same
        assert r["plain_us"] / r["prefetcher_us"] == pytest.approx(r["prefetcher_vs_plain"])


def test_rows_so_far_are_reported_after_each_repeat_but_the_last(monkeypatch):
    """A run cut off by its time limit keeps the repeats that finished: main writes each
    report as a partial JSON."""
    calls = []

    def fake_measure(args, run_dir):
        calls.append(run_dir.name)
        return {"samples_per_s": 100.0 * len(calls), "data_wait_frac": 0.1, "peak_mem_mb": 1.0}

    monkeypatch.setattr(bench_gpu, "measure", fake_measure)
    reports = []
    s = dict(bench_gpu.SMOKE, repeats=3)
    rows = bench_gpu.train_rows(s, cuda=False, peak=None, report=reports.append)
    configs = bench_gpu.configurations(s)
    cpu_configs = [c for c in configs if c["precision"] != "fp16"]
    assert len(calls) == 3 * len(cpu_configs) and len(reports) == 2
    for n, report in enumerate(reports, 1):
        assert [r["runs"] for r in report] == [n if c["precision"] != "fp16" else 0
                                               for c in configs]
    assert [r["runs"] for r in rows] == [3 if c["precision"] != "fp16" else 0 for c in configs]
    assert all(r["skipped"] == "fp16 needs CUDA" for r in rows if r["precision"] == "fp16")
    never = bench_gpu.summarize(s, configs, [[] for _ in configs], True, None)
    assert all(r["skipped"] == "not run" and r["runs"] == 0 for r in never)


@pytest.mark.parametrize("value,needle", [("-1", "-1: must be > 0"), ("0", "0: must be > 0"),
                                          ("nan", "'nan' is not a finite number")])
def test_a_peak_that_is_no_peak_is_a_usage_error(tmp_path, capsys, value, needle):
    with pytest.raises(SystemExit) as e:
        bench_gpu.main(["--smoke", "--peak-tflops", value, "--out", str(tmp_path / "g.json")])
    assert e.value.code == 2 and f"argument --peak-tflops: {needle}" in capsys.readouterr().err


def test_an_interrupted_run_leaves_out_as_it_was(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the second repeat: --out keeps the good result, the first repeat's rows are
    in the side file beside it (bench_gpu_h100.partial.json, which run_on_gpu.sh collects)."""
    from benchlib import run_main

    calls = []

    def fake_measure(args, run_dir):
        calls.append(run_dir.name)
        if run_dir.name.endswith("-1"):  # the second repeat
            raise KeyboardInterrupt
        return {"samples_per_s": 100.0, "data_wait_frac": 0.1, "peak_mem_mb": 1.0}

    monkeypatch.setattr(bench_gpu, "measure", fake_measure)
    good = tmp_path / "bench_gpu_h100.json"
    good.write_text("the good result\n")
    with pytest.raises(SystemExit) as e:
        run_main(lambda: bench_gpu.main(["--smoke", "--repeats", "2", "--out", str(good)]))
    side = tmp_path / "bench_gpu_h100.partial.json"
    err = capsys.readouterr().err.strip()
    assert e.value.code == 130 and "\n" not in err and "Traceback" not in err
    assert err.endswith(f"interrupted (Ctrl-C); the results so far are in {side} (the output "
                        "file was not written)")
    assert good.read_text() == "the good result\n"
    partial = json.loads(side.read_text())
    assert partial["partial"] is True
    assert {r["runs"] for r in partial["training"] if r["precision"] == "bf16"} == {1}

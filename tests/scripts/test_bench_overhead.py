"""scripts/bench_overhead.py end to end in a tiny configuration (no timing assertions)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT, usage_error

sys.path.insert(0, str(ROOT / "scripts"))  # as the scripts run: benchlib beside them


@pytest.mark.slow
def test_smoke_compares_every_runner_with_its_plain_counterpart(tmp_path):
    """Every runner of both workloads once, with an override (which reaches Stoker's runs)
    and --profile (each profiled run's functions per step)."""
    out, prof = tmp_path / "overhead.json", tmp_path / "prof"
    proc = subprocess.run([sys.executable, "scripts/bench_overhead.py", "--steps", "6",
                           "--warmup", "2", "--repeats", "1", "--startup-repeats", "1",
                           "--override", "trainer.tf32=false", "--profile", str(prof),
                           "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {(r["workload"], r["runner"]): r for r in result["results"]}
    for workload, runner, base in [("tiny", "stoker", "plain"), ("cnn", "stoker", "plain"),
                                   ("tiny", "stoker_device", "plain_indexed")]:
        row = rows[(workload, runner)]
        assert row["counterpart"] == base and row["runs"] == 1
        assert row["vs_plain"] > 0 and row["step_us"] > 0 and row["cpu_us"] > 0
        assert row["overhead_us"] == pytest.approx(
            row["best_step_us"] - rows[(workload, base)]["best_step_us"])
        assert row["best_step_us"] <= row["step_us"] * 1.0001  # the fastest stretch
        # the same initial weights, order and steps as the counterpart: the same final weights
        assert row["weights_diff"] < 1e-6 and "did not take the steps" not in proc.stdout
    for workload, runner in [("tiny", "lockstep_host"), ("tiny", "lockstep_device"),
                             ("tiny", "lockstep_null"), ("cnn", "lockstep_host"),
                             ("cnn", "lockstep_null")]:  # in one process
        row = rows[(workload, runner)]
        assert row["runs"] == 1 and row["counterpart"] == (
            "a second plain loop in the same process" if runner == "lockstep_null"
            else "plain steps in the same process")
        assert row["vs_plain"] > 0 and row["plain_best_step_us"] > 0
        assert row["overhead_us"] == pytest.approx(
            row["best_step_us"] - row["plain_best_step_us"])
        assert row["weights_diff"] < 1e-6  # the same steps, side by side
    assert result["target"] == 0.97 and result["workloads"]["tiny"]["steps"] == 6
    # each run is reported as it ends (a run cut off by a time limit shows how far it got),
    # and the finished file is not marked partial
    assert "tiny repeat 1/1 stoker_device: best step" in proc.stderr
    assert "cnn repeat 1/1 stoker: best step" in proc.stderr and "partial" not in result
    assert not (tmp_path / "overhead.partial.json").exists()  # the side file goes with it
    assert [r["command"] for r in result["startup"]] == [
        "python -c 'import torch'", "python -c 'import torch; AdamW(...)'",
        "python train.py debug=fdr"]
    if not any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning")):
        assert result["lightning"] is None
        assert rows[("tiny", "lightning")]["skipped"] == "PyTorch Lightning not installed"
        assert "skipped lightning" in proc.stdout
    else:  # the version measured is recorded
        assert result["lightning"].split()[0] in ("lightning", "pytorch-lightning")
    assert [result["workloads"][w]["overrides"] for w in ("tiny", "cnn")] == [
        ["trainer.tf32=false"]] * 2
    assert sorted(p.name for p in prof.iterdir()) == [
        "cnn_plain_1.txt", "cnn_stoker_1.txt", "tiny_plain_1.txt", "tiny_plain_indexed_1.txt",
        "tiny_stoker_1.txt", "tiny_stoker_device_1.txt"]  # (the lockstep runners have none)
    lines = (prof / "tiny_stoker_1.txt").read_text().splitlines()
    assert lines[0].startswith("4 steps profiled, ") and lines[1].split()[:4] == [
        "own_us", "share", "cum_us", "calls"]
    assert any(line.endswith("run_backward' of 'torch._C._EngineBase' objects>")
               for line in lines[2:])  # (the step's largest)


@pytest.mark.parametrize("args,needle", [
    (["--warmup", "-1"], "argument --warmup: -1: must be >= 0"),
    (["--startup-repeats", "-1"], "argument --startup-repeats: -1: must be >= 0"),
    (["--steps", "100", "--warmup", "100"], "--warmup 100: must be below the 100 steps of tiny"),
    (["--workload", "cnn", "--warmup", "150"], "--warmup 150: must be below the 150 steps of cnn"),
    (["--workload", "cnn", "--runners", "plain,stoker_device"],
     "--runners plain,stoker_device: stoker_device: not a runner of --workload cnn (valid: "
     "plain, stoker, lightning, lockstep_host, lockstep_null)"),
    (["--runners", ","], "--runners ,: none given: not a runner"),
    (["--override", "data.device_prefetch"],
     "--override data.device_prefetch: give KEY=VALUE, as on train.py's command line"),
    (["--runners", "lockstep_host", "--profile", "p"], "--profile: profiles the plain, stoker, "
     "plain_indexed, stoker_device runners; --runners lockstep_host has none of them"),
    # checked as train.py checks them, before any run (a child's traceback seconds later)
    (["--override", "data.device_prefetc=false"],
     "--override data.device_prefetc=false: Could not override 'data.device_prefetc'"),
    (["--runners", "stoker", "--override", "trainer.no_such_key=1"],
     "--override trainer.no_such_key=1: Could not override 'trainer.no_such_key'"),
    (["--override", "data.num_workers=abc"],
     "--override data.num_workers=abc: data.num_workers=abc: must be auto or an integer >= 0"),
    # the runs ended before --steps, and the table had no final weights to compare (KeyError)
    (["--override", "trainer.max_epochs=1"], "--override trainer.max_epochs=1: sets the run's "
     "length (trainer.max_steps, max_epochs, limit_train_batches, fast_dev_run), which the "
     "benchmark sets itself: use --steps"),
    (["--override", "debug=fdr"], "--override debug=fdr: sets the run's length"),
])
def test_bad_arguments_are_usage_errors(tmp_path, capsys, args, needle):
    import bench_overhead

    assert needle in usage_error(capsys, bench_overhead.main,
                                 args + ["--out", str(tmp_path / "o.json")])


def test_a_ctrl_c_leaves_the_good_result_and_the_repeats_so_far_beside_it(tmp_path, capsys,
                                                                          monkeypatch):
    """Ctrl-C in the second repeat: one line, exit 130, --out as it was, the first repeat in
    the side file (measurements faked: what is tested is where the results go)."""
    import bench_overhead
    from benchlib import run_main

    runs = []
    lightning = any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning"))
    kinds = [k for k in bench_overhead.RUNNERS["tiny"] if k != "lightning" or lightning]

    def fake(kind, w):
        runs.append(kind)
        if len(runs) > len(kinds):  # into the second repeat
            raise KeyboardInterrupt
        return {"samples_per_s": 1.0, "step_us": 2.0, "cpu_us": 2.0, "best_step_us": 1.0,
                "plain_step_us": 2.0, "plain_best_step_us": 1.0, "param_sum": 1.0,
                "plain_param_sum": 1.0}

    monkeypatch.setattr(bench_overhead, "in_subprocess", fake)
    good = tmp_path / "good.json"
    good.write_text('{"the": "good result"}\n')
    with pytest.raises(SystemExit) as e:
        run_main(lambda: bench_overhead.main(["--workload", "tiny", "--repeats", "5",
                                              "--steps", "100", "--warmup", "10",
                                              "--startup-repeats", "0", "--out", str(good)]))
    err = capsys.readouterr().err.strip()
    side = tmp_path / "good.partial.json"
    assert e.value.code == 130 and "Traceback" not in err
    assert err.splitlines()[-1].endswith(
        f"interrupted (Ctrl-C); the results so far are in {side} (the output file was not "
        "written)")
    assert good.read_text() == '{"the": "good result"}\n'
    partial = json.loads(side.read_text())
    assert partial["partial"] is True
    assert {r["runs"] for r in partial["results"] if r["runner"] in kinds} == {1}


def test_a_workload_without_a_chosen_runner_is_left_out_and_overrides_are_its_own(
        tmp_path, monkeypatch, capsys):
    """`--workload all --runners stoker_device` (a runner of tiny alone) raised ValueError at
    cnn's empty repeats; an override only cnn's config has (its synthetic dataset's) was
    refused as misspelt, checked against tiny's."""
    import bench_overhead

    def fake(kind, w):
        return {"samples_per_s": 1.0, "step_us": 2.0, "cpu_us": 2.0, "best_step_us": 1.0,
                "param_sum": 1.0}

    monkeypatch.setattr(bench_overhead, "in_subprocess", fake)
    out = tmp_path / "o.json"
    result = bench_overhead.main(["--runners", "stoker_device", "--repeats", "1", "--steps",
                                  "10", "--warmup", "2", "--startup-repeats", "0",
                                  "--out", str(out)])
    assert [(r["workload"], r["runner"]) for r in result["results"]] == [("tiny",
                                                                          "stoker_device")]
    bench_overhead.main(["--workload", "cnn", "--runners", "stoker", "--repeats", "1",
                         "--steps", "10", "--warmup", "2", "--startup-repeats", "0",
                         "--override", "data.dataset.num_samples=2048",
                         "--out", str(tmp_path / "cnn.json")])
    assert "data.dataset.num_samples" in usage_error(
        capsys, bench_overhead.main, ["--workload", "all", "--override",
                                      "data.dataset.num_samples=2048", "--out",
                                      str(tmp_path / "all.json")])  # (tiny's digits lack it)


def test_a_profile_from_the_first_step_is_written(tmp_path):
    """--warmup 0: the profiler was enabled at a step never ticked, and pstats refused the
    empty profile in the child."""
    import torch

    from overhead_runners import Clock

    out = tmp_path / "p.txt"
    clock = Clock(0, 10, torch.device("cpu"), profile=str(out))
    for step in range(1, 11):
        sum(range(1000))
        clock.tick(step)
    lines = out.read_text().splitlines()
    assert lines[0].endswith(" us of own time per step") and len(lines) > 2

"""What the launcher costs per step: the same steps as a plain PyTorch loop and through Stoker.

    python scripts/bench_overhead.py                           # tiny and CNN workloads, 7 repeats
    python scripts/bench_overhead.py --workload tiny --repeats 11 --steps 600
    python scripts/bench_overhead.py --startup-repeats 0       # skip the start-up timing

Workloads (same model, data, batch, optimizer, lr and steps for every runner):
- `tiny`: the default job's steps with nothing else: digits MLP, batch 64, AdamW, data in
  memory, no loader workers, no validation, no checkpoints, one thread. Its step is about a
  millisecond, so the launcher's per-step Python work shows.
- `cnn`: SmallCNN on synthetic 3x32x32 images through 2 loader workers: compute-bound.

Every runner computes the same steps: the same initial weights (the model built right after
seeding with train.py's seed) and the same order (torch's DistributedSampler, whose epoch
permutation is Stoker's). Two trainings from different weights are not the same work: with
other dead ReLU units, twice as many of AdamW's second moments stayed exactly 0, and the
sqrt's path for zeros cost more instructions per step than the launcher did. Each run
reports its final weights' sum (`param_sum`); `weights_diff`, the largest relative difference
from the counterpart's, is warned about above 1e-4.

Runners (scripts/overhead_runners.py): `plain` (a hand-written loop over a DataLoader),
`stoker` (train.py's `train()` with `data.placement=host`: the same DataLoader path, logging
and the stall meter at their defaults), for `tiny` also `plain_indexed` (a hand-written loop
indexing batches from tensors in memory) and `stoker_device` (`data.placement=device`, its
counterpart), and `lightning` when installed (PyTorch Lightning; `pip install lightning -c
.venv/constraints.txt` keeps the CPU torch).

`lockstep_host` (both workloads) and `lockstep_device` (tiny) run Stoker and its plain
counterpart in one process, one step each in turn (a callback takes the plain step after each
of Stoker's): every step's time is paired with the other's a millisecond away, so the shared
machine's drifts, seconds long, fall on both. On a 2-core shared VM the fresh-process pairs of
the same code spread 0.55-1.6 in one run, the lockstep pairs 0.95-0.97: this is the measure
that resolves a few percent there. On a GPU each paired step ends in a synchronize, so the
host's work is not hidden behind queued steps (a stricter reading than the free-running rows);
the fresh-process CNN pairs there spread 0.91-1.25 over three repeats (an H200, 2026-11-26).
(Both loops' caches are colder than alone: steps are slower than in the other rows, the ratio
is what to read.) `lockstep_null` calibrates them: two plain loops (DataLoader path) in the
same alternation, the first in Stoker's place, so its `vs_plain` is what the harness itself
reads for identical work (its bias and resolution).

Every run is a fresh process; runners alternate within each repeat (and their order flips
every other repeat). Each process times its steps after the first `--warmup` (start-up,
first-epoch and allocator warm-up excluded), wall and CPU time, and the fastest of five equal
stretches of them (`best_step_us`: another process's burst on a shared machine slows some
stretches, rarely all five). The table gives, per runner, medians over repeats: samples/s,
wall and CPU microseconds per step over the whole measured run, `best_step_us`, the overhead
per step against its plain counterpart (difference of the `best_step_us` medians), and
`vs_plain`: the median over repeats of the counterpart's `best_step_us` over the runner's,
measured in the same repeat, which cancels the machine's slow drifts (`vs_plain_whole_run`:
the same from whole-run samples/s). Target: `vs_plain` >= 0.97 on `tiny`.

Start-up: the wall time of `python train.py debug=fdr` (one step, one validation batch, nothing
written) next to `python -c "import torch"` and to importing torch and building an optimizer
(which imports torch._dynamo): the floor any PyTorch training program pays.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (at_least, check_out, default_out, machine, median,  # noqa: E402
                      publish, run_main, table, write_partial)
from overhead_runners import child  # noqa: E402
from processes import run_child  # noqa: E402

COLUMNS = ["workload", "runner", "samples_per_s", "step_us", "cpu_us", "best_step_us",
           "overhead_us", "vs_plain", "vs_plain_whole_run", "weights_diff", "runs", "skipped"]
SAME_STEPS = 1e-4  # the largest relative difference of final weights between the same steps
STARTUP_COLUMNS = ["command", "wall_s", "best_s", "runs"]
COUNTERPART = {"stoker": "plain", "lightning": "plain", "stoker_device": "plain_indexed"}
RUNNERS = {"tiny": ["plain", "stoker", "plain_indexed", "stoker_device", "lightning",
                    "lockstep_host", "lockstep_device", "lockstep_null"],
           "cnn": ["plain", "stoker", "lightning", "lockstep_host", "lockstep_null"]}

PROFILED = ["plain", "stoker", "plain_indexed", "stoker_device"]  # fresh-process runners


def _chosen(p: argparse.ArgumentParser, runners: Optional[str], names: List[str]) -> List[str]:
    """The runners --runners names (all when not given); a name no chosen workload has is a
    usage error naming the valid ones."""
    valid = [k for name in names for k in RUNNERS[name]]
    if runners is None:
        return valid
    chosen = [k.strip() for k in runners.split(",") if k.strip()]
    wrong = [k for k in chosen if k not in valid]
    if wrong or not chosen:
        p.error(f"--runners {runners}: {', '.join(wrong) or 'none given'}: not a runner of "
                f"--workload {'/'.join(names)} (valid: {', '.join(dict.fromkeys(valid))})")
    return chosen


def _workload(name: str, a: argparse.Namespace) -> Dict[str, Any]:
    """What every runner of workload `name` is given (the same steps for each)."""
    return {"name": name, "batch": 64, "warmup": a.warmup,
            "steps": a.steps or (500 if name == "tiny" else 150),
            "workers": 0 if name == "tiny" else 2, "threads": 1 if name == "tiny" else 0,
            "samples": 4096, "overrides": a.override}


def _check_overrides(p: argparse.ArgumentParser, w: Dict[str, Any]) -> None:
    """--override composed and checked as train.py would for workload `w`, before any run:
    a misspelt key or a bad value is one usage error (not a child's traceback seconds later),
    and so is one that changes the run's length, which --steps sets (the runs ended early,
    unmeasured)."""
    from overhead_runners import EPOCHS, _stoker_cfg

    from trainer.checks import resolve
    from trainer.oneline import describe

    overrides = w["overrides"]
    with tempfile.TemporaryDirectory(prefix="stoker-overhead-") as tmp:
        try:
            cfg = _stoker_cfg(w, "host", tmp)
            resolve(cfg)
        except Exception as e:  # noqa: BLE001  (Hydra's, OmegaConf's or the checks' error)
            p.error(f"--override {' '.join(overrides)}: {describe(e)}")
    t = cfg.trainer
    if t.max_steps != w["steps"] or t.max_epochs != EPOCHS or \
            t.limit_train_batches is not None or t.fast_dev_run:
        p.error(f"--override {' '.join(overrides)}: sets the run's length (trainer.max_steps, "
                "max_epochs, limit_train_batches, fast_dev_run), which the benchmark sets "
                "itself: use --steps")


def in_subprocess(kind: str, w: Dict[str, Any]) -> Dict[str, float]:
    out = run_child([sys.executable, __file__, "--child", kind, "--spec", json.dumps(w)],
                    f"the {w['name']} {kind} run", timeout=900)
    return json.loads(out.strip().splitlines()[-1])


def summarise(name: str, runs: Dict[str, List[Dict[str, float]]]) -> List[Dict[str, Any]]:
    rows = []
    for kind, results in runs.items():
        row: Dict[str, Any] = {"workload": name, "runner": kind, "runs": len(results),
                               "all": results}
        if not results:
            row["skipped"] = "PyTorch Lightning not installed"
            rows.append(row)
            continue
        row.update(samples_per_s=median([r["samples_per_s"] for r in results]),
                   best_samples_per_s=max(r["samples_per_s"] for r in results),
                   step_us=median([r["step_us"] for r in results]),
                   cpu_us=median([r["cpu_us"] for r in results if "cpu_us" in r]),
                   best_step_us=median([r["best_step_us"] for r in results]))
        if kind.startswith("lockstep"):
            row.update(_paired(results))
            if kind == "lockstep_null":
                row["counterpart"] = "a second plain loop in the same process"
            rows.append(row)
            continue
        base = runs.get(COUNTERPART.get(kind, ""), [])
        if base:
            row["counterpart"] = COUNTERPART[kind]
            row["overhead_us"] = row["best_step_us"] - median([b["best_step_us"] for b in base])
            row["vs_plain"] = median([b["best_step_us"] / r["best_step_us"]
                                      for r, b in zip(results, base)])
            row["vs_plain_whole_run"] = median([r["samples_per_s"] / b["samples_per_s"]
                                                for r, b in zip(results, base)])
            row["weights_diff"] = max(abs(r["param_sum"] - b["param_sum"]) / abs(b["param_sum"])
                                      for r, b in zip(results, base))
        rows.append(row)
    return rows


def _paired(results: List[Dict[str, float]]) -> Dict[str, Any]:
    """A lockstep runner's row: Stoker against the plain steps taken in the same process."""
    return {"counterpart": "plain steps in the same process",
            "plain_best_step_us": median([r["plain_best_step_us"] for r in results]),
            "overhead_us": median([r["best_step_us"] - r["plain_best_step_us"]
                                   for r in results]),
            "vs_plain": median([r["plain_best_step_us"] / r["best_step_us"] for r in results]),
            "vs_plain_whole_run": median([r["plain_step_us"] / r["step_us"] for r in results]),
            "weights_diff": max(abs(r["param_sum"] - r["plain_param_sum"]) / r["plain_param_sum"]
                                for r in results)}


def startup(repeats: int) -> List[Dict[str, Any]]:
    """Wall time of a one-step run and of importing torch, alternating, fresh processes."""
    floor = "import torch; torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())"
    commands = {"python -c 'import torch'": [sys.executable, "-c", "import torch"],
                "python -c 'import torch; AdamW(...)'": [sys.executable, "-c", floor],
                "python train.py debug=fdr": [sys.executable, "train.py", "debug=fdr",
                                              "trainer.progress_bar=false"]}
    times: Dict[str, List[float]] = {k: [] for k in commands}
    with tempfile.TemporaryDirectory(prefix="stoker-startup-") as tmp:
        for rep in range(repeats):
            for name, cmd in commands.items():
                extra = [f"hydra.run.dir={tmp}/r{rep}"] if "train.py" in cmd else []
                t0 = time.perf_counter()
                run_child(cmd + extra, name)
                times[name].append(time.perf_counter() - t0)
    return [{"command": k, "wall_s": median(v), "best_s": min(v), "runs": len(v), "all": v}
            for k, v in times.items()]


def lightning_version() -> Optional[str]:
    """The installed PyTorch Lightning's version, or None."""
    from importlib import metadata

    for dist in ("lightning", "pytorch-lightning"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            pass
    return None


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=["tiny", "cnn", "all"], default="all")
    p.add_argument("--steps", type=at_least(0), default=0,
                   help="steps per run (0: 500 tiny, 150 cnn)")
    p.add_argument("--warmup", type=at_least(0), default=50,
                   help="steps before the timing starts (fewer than --steps)")
    p.add_argument("--repeats", type=at_least(1), default=7)
    p.add_argument("--startup-repeats", type=at_least(0), default=5)
    p.add_argument("--out", type=Path, default=default_out("bench_overhead"))
    p.add_argument("--runners", help="comma-separated runners to run, of each workload's "
                   f"(default: all; tiny: {','.join(RUNNERS['tiny'])})")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a train.py override for Stoker's runners (repeatable), e.g. "
                   "data.device_prefetch=false: the rows then read what that setting costs")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="run the measured steps of the plain and stoker runners under "
                   "cProfile and write each function's time per step to DIR/<workload>_"
                   "<runner>_<repeat>.txt (slower steps: read the shares)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:  # a child process: one measurement, printed as JSON
        print(json.dumps(child(a.child, json.loads(a.spec))))
        return {}
    check_out(p, a.out)
    names = ["tiny", "cnn"] if a.workload == "all" else [a.workload]
    chosen = _chosen(p, a.runners, names)
    for o in a.override:
        if "=" not in o or o.startswith("="):
            p.error(f"--override {o}: give KEY=VALUE, as on train.py's command line")
    workloads = {name: _workload(name, a) for name in names}
    for name, w in workloads.items():  # the clock needs a timed step after the warm-up
        if a.warmup >= w["steps"]:
            p.error(f"--warmup {a.warmup}: must be below the {w['steps']} steps of {name} "
                    "(--steps)")
    if a.override:
        for w in workloads.values():
            _check_overrides(p, w)
    if a.profile is not None:
        if not any(k in PROFILED for k in chosen):
            p.error(f"--profile: profiles the {', '.join(PROFILED)} runners; --runners "
                    f"{a.runners} has none of them")
        a.profile.mkdir(parents=True, exist_ok=True)
    has_lightning = any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning"))
    result: Dict[str, Any] = {"machine": machine(), "repeats": a.repeats, "target": 0.97,
                              "lightning": lightning_version(), "workloads": {}, "results": []}
    for name, w in workloads.items():
        result["workloads"][name] = w
        listed = [k for k in RUNNERS[name] if k in chosen]
        kinds = [k for k in listed if k != "lightning" or has_lightning]
        runs: Dict[str, List[Dict[str, float]]] = {k: [] for k in listed}
        done = list(result["results"])
        if not kinds:  # (--runners names none of this workload's, or Lightning alone)
            result["results"] = done + summarise(name, runs)
            continue
        for rep in range(a.repeats):
            for kind in (kinds if rep % 2 == 0 else kinds[::-1]):  # alternate the order too
                spec = w
                if a.profile is not None and kind in PROFILED:
                    spec = dict(w, profile=str(a.profile / f"{name}_{kind}_{rep + 1}.txt"))
                runs[kind].append(in_subprocess(kind, spec))
                print(f"{name} repeat {rep + 1}/{a.repeats} {kind}: best step "
                      f"{runs[kind][-1]['best_step_us']:.0f} us", file=sys.stderr, flush=True)
            if min(len(runs[k]) for k in kinds) == rep + 1:  # a run cut short keeps these
                result["results"] = done + summarise(name, runs)
                write_partial(a.out, result)
        result["results"] = done + summarise(name, runs)
    print(table(result["results"], COLUMNS))
    for row in result["results"]:
        if row.get("weights_diff", 0.0) > SAME_STEPS:
            print(f"warning: {row['workload']} {row['runner']} did not take the steps of "
                  f"{row['counterpart']} (final weights differ by {row['weights_diff']:.1e}): "
                  "the ratio compares different computations")
    if not has_lightning:
        print("skipped lightning: PyTorch Lightning not installed "
              "(pip install lightning -c .venv/constraints.txt)")
    if a.startup_repeats:
        result["startup"] = startup(a.startup_repeats)
        print(table(result["startup"], STARTUP_COLUMNS))
    return publish(a.out, result)


if __name__ == "__main__":
    run_main(main)

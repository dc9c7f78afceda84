"""Compare single-process, DataParallel and DDP training on the same model, data and global batch.

    python scripts/compare_strategies.py                       # CPU: single vs 2-rank DDP (gloo)
    python scripts/compare_strategies.py --nproc 4 --global-batch 256 --repeats 3
    python scripts/compare_strategies.py --steps 5 --repeats 1 model=mlp   # extra overrides last

Each configuration runs as its own process(es) through train.py (DDP under torchrun), the
configurations alternate across repeats, and the table shows medians: samples/s, step time,
data-wait fraction and peak memory (rank 0: CUDA allocations on GPU, RSS on CPU). What cannot
run here (DataParallel without CUDA, more ranks than GPUs) is listed as skipped with the reason.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from benchlib import (at_least, check_out, default_out, machine, median, publish, run_main,
                      run_train, table)

COLUMNS = ["strategy", "ranks", "per_rank_batch", "samples_per_s", "step_time_ms",
           "data_wait_frac", "peak_mem_mb", "runs", "skipped"]
WORKLOAD = ["data=synthetic", "model=cnn", "data.dataset.num_samples=4096",
            "trainer.limit_val_batches=1", "trainer.save_checkpoint=false"]


def plan(nproc: int, global_batch: int) -> List[Dict[str, Any]]:
    """The three configurations, each with a reason to skip when it cannot run here."""
    gpus = torch.cuda.device_count()
    configs = [
        {"strategy": "single", "ranks": 1, "per_rank_batch": global_batch, "skipped": None},
        {"strategy": "dp", "ranks": 1, "per_rank_batch": global_batch,
         "skipped": None if gpus >= 1 else "DataParallel needs CUDA"},
        {"strategy": "ddp", "ranks": nproc, "per_rank_batch": global_batch // nproc,
         "skipped": None},
    ]
    ddp = configs[2]
    if global_batch % nproc:
        ddp["skipped"] = f"global batch {global_batch} not divisible by {nproc} ranks"
    elif nproc < 2:
        ddp["skipped"] = "needs --nproc >= 2"
    elif gpus and nproc > gpus:
        ddp["skipped"] = f"{nproc} ranks but {gpus} GPUs"
    return configs


def measure(cfg: Dict[str, Any], steps: int, workdir: Path, rep: int,
            extra: List[str]) -> Dict[str, float]:
    args = [f"trainer.strategy={cfg['strategy']}", f"data.batch_size={cfg['per_rank_batch']}",
            f"trainer.max_steps={steps}", *WORKLOAD, *extra]
    run_dir = workdir / f"{cfg['strategy']}-{rep}"
    s = run_train(args, run_dir, nproc=cfg["ranks"] if cfg["strategy"] == "ddp" else 1)
    return {"samples_per_s": s["run_samples_per_s"],
            "step_time_ms": 1000 * s["global_batch"] / s["run_samples_per_s"],
            "data_wait_frac": s["run_data_wait_frac"], "peak_mem_mb": s["peak_mem_mb"]}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=at_least(1), default=2, help="DDP ranks")
    p.add_argument("--global-batch", type=at_least(1), default=64)
    p.add_argument("--steps", type=at_least(1), default=30, help="optimizer steps per run")
    p.add_argument("--repeats", type=at_least(1), default=3,
                   help="alternating repetitions (median)")
    p.add_argument("--out", type=Path, default=default_out("compare_strategies"))
    p.add_argument("overrides", nargs="*", help="extra train.py overrides for every run")
    a = p.parse_args(argv)
    check_out(p, a.out)
    configs = plan(a.nproc, a.global_batch)
    samples: Dict[str, List[Dict[str, float]]] = {c["strategy"]: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="stoker-compare-") as tmp:
        for rep in range(a.repeats):  # alternate, so drift on a shared machine hits all alike
            for cfg in configs:
                if not cfg["skipped"]:
                    samples[cfg["strategy"]].append(
                        measure(cfg, a.steps, Path(tmp), rep, a.overrides))
    rows = []
    for cfg in configs:
        runs = samples[cfg["strategy"]]
        rows.append({**cfg, "runs": len(runs), **{k: median([r[k] for r in runs])
                                                  for k in COLUMNS[3:7]}})
    print(table(rows, COLUMNS))
    for row in rows:
        if row["skipped"]:
            print(f"skipped {row['strategy']}: {row['skipped']}")
    result = {"machine": machine(), "global_batch": a.global_batch, "steps": a.steps,
              "repeats": a.repeats, "workload": WORKLOAD + a.overrides, "results": rows}
    return publish(a.out, result)


if __name__ == "__main__":
    run_main(main)

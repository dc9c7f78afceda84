"""What each speed switch buys: the same training run with one switch changed at a time.

    python scripts/bench_speed.py                                  # CNN, fp32, every switch
    python scripts/bench_speed.py --precision bf16 --repeats 5
    python scripts/bench_speed.py --switches baseline,compile --model transformer

Every run is train.py in a fresh process on synthetic data; configurations alternate within
each repeat. Samples/s and data-wait are medians over the logging windows after the first
(which holds worker start-up and compilation), then the median over repeats; `vs_baseline` is
the ratio to the baseline's median from the same invocation. Peak memory is CUDA allocations
on a GPU and the process's resident set on CPU. Switches that only act on CUDA (TF32, cuDNN
autotuning) are listed as skipped on a machine without one: no number is written for them.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (UINT8_CNN, at_least, check_out, default_out, machine,  # noqa: E402
                      measure, medians, publish, run_main, table)

COLUMNS = ["switch", "overrides", "samples_per_s", "vs_baseline", "data_wait_frac",
           "peak_mem_mb", "skipped"]

# name -> (overrides against the baseline, needs CUDA); the baseline is the shipped default
SWITCHES: Dict[str, tuple] = {
    "baseline": ([], False),
    "compile": (["trainer.compile.enabled=true"], False),
    "channels_last": (["data.channels_last=true"], False),
    "fused_optimizer": (["optim.fused=true"], False),
    "foreach_off": (["optim.foreach=false"], False),
    "activation_checkpointing": (["model.activation_checkpointing=true"], False),
    "tf32_off": (["trainer.tf32=false"], True),
    "cudnn_benchmark_off": (["trainer.cudnn_benchmark=false"], True),
}

MODELS = {
    "cnn": UINT8_CNN,
    "transformer": ["experiment=tokens_transformer"],
}


def workload(a) -> List[str]:
    shape = {"cnn": f"data.input_shape=[3,{a.image},{a.image}]",
             "transformer": f"data.input_shape=[{a.tokens}]"}[a.model]
    return [*MODELS[a.model], shape, f"data.dataset.num_samples={a.samples}",
            f"data.batch_size={a.batch}", f"data.num_workers={a.workers}",
            f"trainer.precision={a.precision}", f"trainer.max_steps={a.steps}",
            f"trainer.log_every_n_steps={a.log_every}", "sched=constant",
            "trainer.limit_val_batches=1", "trainer.max_epochs=1000"]


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(MODELS), default="cnn")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--switches", default=",".join(SWITCHES),
                   help="comma-separated subset of: " + ", ".join(SWITCHES))
    p.add_argument("--steps", type=at_least(1), default=60)
    p.add_argument("--log-every", type=at_least(1), default=10)
    p.add_argument("--batch", type=at_least(1), default=64)
    p.add_argument("--image", type=at_least(1), default=32, help="CNN image side")
    p.add_argument("--tokens", type=at_least(1), default=128, help="transformer context")
    p.add_argument("--samples", type=at_least(1), default=4096)
    p.add_argument("--workers", type=at_least(0), default=2)
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--extra", nargs="*", default=[], help="overrides added to every run")
    p.add_argument("--out", type=Path, default=default_out("bench_speed"))
    a = p.parse_args(argv)
    check_out(p, a.out)
    names = [n for n in a.switches.split(",") if n]
    unknown = sorted(set(names) - set(SWITCHES))
    if unknown:
        p.error(f"--switches: unknown {', '.join(unknown)}; valid: {', '.join(SWITCHES)}")
    names = ["baseline"] + [n for n in names if n != "baseline"]
    import torch

    cuda = torch.cuda.is_available()
    base = workload(a) + a.extra
    runs: Dict[str, List[Dict[str, Any]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="stoker-speed-") as tmp:
        for rep in range(a.repeats):
            for name in names:
                overrides, cuda_only = SWITCHES[name]
                if cuda_only and not cuda:
                    continue
                runs[name].append(measure(base + overrides, Path(tmp) / f"{name}-{rep}"))
    rows = []
    for name in names:
        overrides, cuda_only = SWITCHES[name]
        got = runs[name]
        row: Dict[str, Any] = {"switch": name, "overrides": " ".join(overrides) or "(defaults)",
                               "runs": len(got), "all": got}
        if not got:
            row["skipped"] = "needs CUDA" if cuda_only and not cuda else "no runs"
        else:
            row.update(medians(got))
        rows.append(row)
    ref = rows[0].get("samples_per_s")
    for row in rows:
        if row.get("samples_per_s") and ref:
            row["vs_baseline"] = row["samples_per_s"] / ref
    print(table(rows, COLUMNS))
    result = {"machine": machine(), "device": "cuda" if cuda else "cpu", "model": a.model,
              "precision": a.precision, "workload": base, "repeats": a.repeats,
              "results": rows}
    return publish(a.out, result)


if __name__ == "__main__":
    run_main(main)

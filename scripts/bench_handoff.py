"""What receiving a loader worker's batch costs: Stoker's pooled batches against PyTorch's.

    python scripts/bench_handoff.py                  # 256 x 3x64x64 uint8 + labels, 2 workers
    python scripts/bench_handoff.py --workers 4 --image 224 --batch 64

A worker hands each batch over in shared memory. PyTorch's default collate puts every tensor
of the batch into a new block, which the worker allocates and zeroes, and for each block the
training process opens a connection to the worker to receive its file descriptor (an
authenticated handshake with the worker's resource sharer). Stoker's training loader stacks
samples that are tensors, or tuples or lists of tensors, into one block of the worker's pool,
reused from batch to batch (`data/batchpool.py`, `pooled_collate`): one block, one handshake.

The same training loader (`build_loader(train=True)`: persistent workers running on into the
next epoch) over tensors in memory (so the samples cost nothing to make: the handoff is what
is measured), once with its own collate and once with `torch.utils.data.default_collate`, each
in a fresh process, alternating (order flipped every other repeat): samples/s the loader
delivers over --epochs epochs after a warm one, the training thread's CPU time per batch, and
the pool's counts (`pool`: batches formed in reused blocks, in a block's first use, and in new
blocks). Nothing is pinned (pin_memory=false, on CUDA too): this is the handoff alone. Of the
pooled arm's gain, the block reuse is the workers' (no block to allocate and zero each batch)
and the single block the receiving side's (`main_cpu_us_per_batch`).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (at_least, check_out, default_out, machine, median, publish,  # noqa: E402
                      run_main, table)
from processes import run_child  # noqa: E402

COLUMNS = ["collate", "samples_per_s", "vs_default", "main_cpu_us_per_batch", "runs"]
COLLATES = ("pooled", "default")


def one(a: argparse.Namespace) -> Dict[str, float]:
    """One measurement in this process (--one)."""
    import torch
    from torch.utils.data import TensorDataset, default_collate

    from data.loader import build_loader
    from trainer.config import DataConfig

    n = a.batch * a.batches
    ds = TensorDataset(torch.randint(0, 256, (n, 3, a.image, a.image), dtype=torch.uint8),
                       torch.arange(n))
    cfg = DataConfig(dataset=None, input_shape=[3, a.image, a.image], num_classes=n,
                     batch_size=a.batch, num_workers=a.workers, persistent_workers=True,
                     prefetch_factor=a.prefetch_factor, shuffle=True, pin_memory=False)
    loader = build_loader(ds, cfg, train=True, device=torch.device("cpu"),
                          collate_fn=None if a.one == "pooled" else default_collate)
    loader.sampler.set_epoch(0)
    sum(1 for _ in loader)  # the workers start; the pool's blocks are made
    wall, cpu, batches = time.perf_counter(), time.thread_time(), 0
    for epoch in range(1, a.epochs + 1):
        loader.sampler.set_epoch(epoch)
        batches += sum(1 for _ in loader)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    pool = loader.pool.stats()  # batches formed in reused, first-used and new blocks
    loader.close()
    return {"samples_per_s": batches * a.batch / wall,
            "main_cpu_us_per_batch": 1e6 * cpu / batches, "pool": pool}


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=at_least(1), default=256)
    p.add_argument("--image", type=at_least(1), default=64,
                   help="images are 3 x image x image uint8")
    p.add_argument("--batches", type=at_least(1), default=64, help="batches an epoch")
    p.add_argument("--epochs", type=at_least(1), default=2, help="timed epochs, after a warm one")
    p.add_argument("--workers", type=at_least(1), default=2,
                   help="loader workers (the handoff is theirs: at least 1)")
    p.add_argument("--prefetch-factor", type=at_least(1), default=2)
    p.add_argument("--repeats", type=at_least(1), default=3)
    p.add_argument("--out", type=Path, default=default_out("bench_handoff"))
    p.add_argument("--one", choices=COLLATES, help=argparse.SUPPRESS)  # a fresh process's run
    a = p.parse_args(argv)
    if not a.one:
        check_out(p, a.out)
    return a


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    a = parse(argv)
    if a.one:
        print(json.dumps(one(a)))
        return {}
    own = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
           if k not in ("one", "out", "repeats")]
    runs: Dict[str, List[Dict[str, float]]] = {c: [] for c in COLLATES}
    for rep in range(a.repeats):
        for collate in (COLLATES if rep % 2 == 0 else COLLATES[::-1]):
            out = run_child([sys.executable, __file__, *own, f"--one={collate}"],
                            f"the {collate} run", timeout=600)
            runs[collate].append(json.loads(out.strip().splitlines()[-1]))
            print(f"repeat {rep + 1}/{a.repeats} {collate}: {runs[collate][-1]}",
                  file=sys.stderr)
    rows = [{"collate": c, "runs": len(runs[c]), "all": runs[c],
             **{k: median([r[k] for r in runs[c]])
                for k in ("samples_per_s", "main_cpu_us_per_batch")}} for c in COLLATES]
    pairs = [p["samples_per_s"] / d["samples_per_s"]
             for p, d in zip(runs["pooled"], runs["default"])]
    rows[0]["vs_default"], rows[1]["vs_default"] = median(pairs), 1.0
    print(table(rows, COLUMNS))
    result = {"machine": machine(), "settings": {k: v for k, v in vars(a).items()
                                                 if k not in ("one", "out")},
              "results": rows}
    return publish(a.out, result)


if __name__ == "__main__":
    run_main(main)

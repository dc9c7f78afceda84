"""What the launcher costs: the same training steps as a plain PyTorch loop and through Stoker.

    python scripts/bench_overhead.py                          # CNN on synthetic images, CPU/GPU
    python scripts/bench_overhead.py --steps 200 --repeats 5 --batch 128

Same model (SmallCNN), data (SyntheticDataset, 3x32x32), batch, loader settings, optimizer
(AdamW, constant lr) and number of steps: (a) a hand-written loop, (b) train.py with logging,
the stall meter and checkpointing at their defaults, (c) PyTorch Lightning when it is
installed (skipped with a message otherwise). Each run is a fresh process; configurations
alternate across repeats; the table shows median samples/s over the training steps (start-up
and validation excluded) and the ratio to the plain loop. Target: Stoker >= 0.98.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import machine, median, run_train, table, write_json  # noqa: E402

COLUMNS = ["runner", "samples_per_s", "vs_plain", "runs", "skipped"]
LR = 0.003


def workload(a) -> Dict[str, Any]:
    return dict(samples=a.samples, batch=a.batch, workers=a.workers, steps=a.steps)


def _parts(w: Dict[str, Any]):
    import torch

    from data.datasets import SyntheticDataset
    from trainer.models import SmallCNN

    torch.manual_seed(0)
    ds = SyntheticDataset("train", num_samples=w["samples"], input_shape=[3, 32, 32])
    loader = torch.utils.data.DataLoader(
        ds, batch_size=w["batch"], shuffle=True, num_workers=w["workers"],
        persistent_workers=w["workers"] > 0, prefetch_factor=2 if w["workers"] else None,
        pin_memory=torch.cuda.is_available())
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = SmallCNN([3, 32, 32], 10).to(device)
    return loader, model, device


def plain_loop(w: Dict[str, Any]) -> float:
    """The hand-written reference: samples/s over `steps` optimizer steps."""
    import torch
    import torch.nn.functional as F

    loader, model, device = _parts(w)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    done, start = 0, time.perf_counter()
    while done < w["steps"]:
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == w["steps"]:
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    return done * w["batch"] / (time.perf_counter() - start)


def lightning_loop(w: Dict[str, Any]) -> float:
    """The same steps through Lightning's Trainer at its defaults (no logger, no checkpoint
    files: comparable outputs); throughput timed from the first to the last batch."""
    try:
        import lightning as L
    except ImportError:
        import pytorch_lightning as L
    import torch
    import torch.nn.functional as F

    loader, model, _ = _parts(w)
    marks: List[float] = []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, i):
            if not marks:
                marks.append(time.perf_counter())
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, *args):
            marks[1:] = [time.perf_counter()]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    trainer = L.Trainer(max_steps=w["steps"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Module(), loader)
    # the first batch's time is spent before the first mark, as for the others' start-up
    return (w["steps"] - 1) * w["batch"] / (marks[1] - marks[0])


def stoker(w: Dict[str, Any], run_dir: Path) -> float:
    s = run_train(["data=synthetic", "model=cnn", f"data.dataset.num_samples={w['samples']}",
                   f"data.batch_size={w['batch']}", f"data.num_workers={w['workers']}",
                   f"trainer.max_steps={w['steps']}", "sched=constant", f"optim.lr={LR}",
                   "trainer.limit_val_batches=1"], run_dir)
    return s["run_samples_per_s"]


def in_subprocess(kind: str, w: Dict[str, Any]) -> float:
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--workload",
                           json.dumps(w)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{proc.stderr[-3000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("bench_overhead.json"))
    p.add_argument("--worker", choices=["plain", "lightning"], help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:  # a child process: one measurement, printed
        w = json.loads(a.workload)
        print(plain_loop(w) if a.worker == "plain" else lightning_loop(w))
        return {}
    w = workload(a)
    has_lightning = any(importlib.util.find_spec(m) for m in ("lightning", "pytorch_lightning"))
    runs: Dict[str, List[float]] = {"plain": [], "stoker": [], "lightning": []}
    with tempfile.TemporaryDirectory(prefix="stoker-overhead-") as tmp:
        for rep in range(a.repeats):
            runs["plain"].append(in_subprocess("plain", w))
            runs["stoker"].append(stoker(w, Path(tmp) / f"run{rep}"))
            if has_lightning:
                runs["lightning"].append(in_subprocess("lightning", w))
    base = median(runs["plain"])
    rows = [{"runner": k, "samples_per_s": median(v), "runs": len(v), "all": v,
             "vs_plain": median(v) / base if v else None,
             "skipped": None if v or k != "lightning" else "PyTorch Lightning not installed"}
            for k, v in runs.items()]
    print(table(rows, COLUMNS))
    if not has_lightning:
        print("skipped lightning: PyTorch Lightning not installed (pip install lightning)")
    result = {"machine": machine(), "workload": w, "repeats": a.repeats, "target": 0.98,
              "results": rows}
    write_json(a.out, result)
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()

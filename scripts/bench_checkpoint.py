"""How long a checkpoint stalls training, written synchronously vs in the background.

    python scripts/bench_checkpoint.py                     # ~50M-parameter MLP + AdamW state
    python scripts/bench_checkpoint.py --width 8192 --repeats 7 --out ckpt.json

The state is a real model's weights plus its AdamW moments (3x the weights), on the GPU when
there is one. `stall` is how long `Checkpointer.save` blocks the training loop: the whole
write and fsync when synchronous, only the device-to-host copy when async (the write then
runs on a background thread; `write` is how long that took). Alternating repetitions, medians.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchlib import (at_least, check_out, default_out, die, machine, median,  # noqa: E402
                      publish, run_main, table, unwritable)
from trainer.checkpoint import CheckpointWriteError, state_bytes  # noqa: E402
from trainer.saver import Checkpointer  # noqa: E402
from trainer.models import MLP  # noqa: E402

COLUMNS = ["mode", "state_mb", "stall_s", "write_s", "stall_vs_sync"]


def build_state(width: int, layers: int, device: torch.device) -> Dict[str, Any]:
    model = MLP([width], num_classes=10, hidden=[width] * layers).to(device)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width, device=device)).sum().backward()
    opt.step()  # creates the moment buffers
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}


def state_mb(state: Dict[str, Any]) -> float:
    return state_bytes(state) / 2**20


def needed_bytes(width: int, layers: int) -> int:
    """The memory the state takes while it is saved: the weights, their gradients and AdamW's
    two moments, and the write's host copy of the weights and moments (7 floats a
    parameter)."""
    params = layers * (width * width + width) + width * 10 + 10
    return params * 4 * 7


def available_bytes(device: torch.device) -> Optional[int]:
    """The memory free for the state: the GPU's, else the host's (MemAvailable); None
    where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def one_save(state, folder: Path, async_save: bool, step: int) -> Dict[str, float]:
    saver = Checkpointer(folder, keep_last=1, async_save=async_save, enabled=True)
    if state["model"] and next(iter(state["model"].values())).is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    saver.save(state, step)
    stall = time.perf_counter() - start
    saver.wait()
    return {"stall_s": stall, "write_s": time.perf_counter() - start}


def saves(state, folder: Optional[Path], repeats: int) -> Dict[str, List[Dict[str, float]]]:
    """Sync and async saves of `state`, alternating, in a temporary folder under `folder`
    (the system's temp dir when None), removed afterwards; a write the disk refuses (full,
    read-only) is one line naming the folder."""
    runs: Dict[str, List[Dict[str, float]]] = {"sync": [], "async": []}
    where = f"--dir {folder}" if folder else f"the temp dir {tempfile.gettempdir()} (--dir)"
    try:
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="stoker-ckpt-", dir=folder) as tmp:
            for rep in range(repeats):  # alternate, so drift on a shared disk hits both alike
                for mode in runs:
                    runs[mode].append(one_save(state, Path(tmp), mode == "async", rep + 1))
    except CheckpointWriteError as e:  # "checkpoint <file>: the write failed (<cause>); ..."
        die(f"{where}: cannot write the checkpoints: {str(e).split('; ')[0]}")
    except OSError as e:
        die(f"{where}: cannot write the checkpoints ({e.strerror or e})")
    return runs


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=at_least(1), default=4096, help="the MLP's width")
    p.add_argument("--layers", type=at_least(0), default=3, help="hidden layers of that width")
    p.add_argument("--repeats", type=at_least(1), default=5)
    p.add_argument("--dir", type=Path, default=None,
                   help="where to write (default: a temp dir); made if missing")
    p.add_argument("--out", type=Path, default=default_out("bench_checkpoint"))
    a = p.parse_args(argv)
    check_out(p, a.out)
    if a.dir is not None:  # a folder the checkpoints can be written in, said before the state
        why = "is a file, not a folder" if a.dir.exists() and not a.dir.is_dir() \
            else unwritable(a.dir / "step-00000001.pt")
        if why:
            p.error(f"--dir {a.dir}: {why}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    need, free = needed_bytes(a.width, a.layers), available_bytes(device)
    if free is not None and need > free:  # (an allocator's traceback, or the OOM killer)
        p.error(f"--width {a.width} --layers {a.layers}: the state needs about "
                f"{need / 2**30:,.1f} GiB while saved, and {free / 2**30:,.1f} GiB of "
                f"{device.type} memory is free; give a smaller --width or --layers")
    state = build_state(a.width, a.layers, device)
    size = state_mb(state)
    runs = saves(state, a.dir, a.repeats)
    sync_stall = median([r["stall_s"] for r in runs["sync"]])
    rows = [{"mode": mode, "state_mb": size,
             "stall_s": median([r["stall_s"] for r in rs]),
             "write_s": median([r["write_s"] for r in rs]),
             "stall_vs_sync": median([r["stall_s"] for r in rs]) / sync_stall,
             "runs": rs} for mode, rs in runs.items()]
    print(table(rows, COLUMNS))
    result = {"machine": machine(), "device": str(device), "width": a.width,
              "layers": a.layers, "repeats": a.repeats, "results": rows}
    return publish(a.out, result)


if __name__ == "__main__":
    run_main(main)

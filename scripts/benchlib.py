"""Helpers shared by the benchmark scripts: machine description, tables, JSON, launching runs."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


def at_least(low: int):
    """An argparse type: an integer >= `low` (a count of repeats, steps, workers...), so that
    a 0 or a negative one is a usage error, not a ZeroDivisionError later."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value}: must be >= {low}")
        return value
    return parse


def machine() -> Dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def table(rows: List[Dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain-text table; floats get 3 significant decimals, missing cells a dash."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def command() -> str:
    """The command line that is running, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return " ".join(["python", str(script), *sys.argv[1:]])


def write_json(path: Path, payload: Dict[str, Any]) -> None:
    """Writes `payload` with the command that produced it (unless it names one already)."""
    payload = {"command": command(), **payload}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")


def default_out(name: str) -> Path:
    """Where a benchmark writes its JSON unless told (--out): outputs/benchmarks/ of the
    directory it runs from (git ignores outputs/ in the project), not the directory itself."""
    return Path("outputs") / "benchmarks" / f"{name}.json"


def publish(path: Path, result: Dict[str, Any]) -> Dict[str, Any]:
    """A benchmark's last step: writes `result` as JSON (write_json), says where, returns it."""
    write_json(path, result)
    print(f"wrote {path}")
    return result


def median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def steady(run_dir: Path) -> Dict[str, Optional[float]]:
    """Median samples/s and data-wait share over a run's training windows (metrics.jsonl),
    leaving out the first window, which holds start-up work (worker start, compilation,
    cuDNN autotuning) when there is more than one; on CUDA also the share the GPU stood idle
    for data (`device_wait_frac`, trainer/devicewait.py; None elsewhere)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["split"] == "train"]
    rows = rows[1:] if len(rows) > 1 else rows
    return {"samples_per_s": median([r["samples_per_s"] for r in rows]),
            "data_wait_frac": median([r["data_wait_frac"] for r in rows]),
            "device_wait_frac": median([r["device_wait_frac"] for r in rows
                                        if "device_wait_frac" in r])}


# the reference CNN on compact uint8 images, normalised on the device by the prefetcher
UINT8_CNN = ["data=synthetic", "model=cnn", "data.dataset.dtype=uint8",
             "data.normalize_mean=[0.5,0.5,0.5]", "data.normalize_std=[0.25,0.25,0.25]"]
MEASURED = ("samples_per_s", "data_wait_frac", "device_wait_frac", "peak_mem_mb")


def measure(args: List[str], run_dir: Path) -> Dict[str, Optional[float]]:
    """One train.py run: its steady samples/s and data-wait, and its peak memory."""
    summary = run_train(args, run_dir)
    return {**steady(run_dir), "peak_mem_mb": summary["peak_mem_mb"]}


def medians(runs: List[Dict[str, Any]]) -> Dict[str, Optional[float]]:
    """The median of each MEASURED value over repeats of one configuration."""
    return {key: median([r[key] for r in runs if r.get(key) is not None]) for key in MEASURED}


def run_train(args: List[str], run_dir: Path, nproc: int = 1,
              timeout: float = 600) -> Dict[str, Any]:
    """Runs train.py (under torchrun when nproc > 1) and returns its summary.json.

    Raises RuntimeError with the tail of the output when the run fails.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "STOKER_"))}
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", "trainer.progress_bar=false",
            *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           + (proc.stderr or proc.stdout)[-3000:])
    return json.loads((run_dir / "summary.json").read_text())

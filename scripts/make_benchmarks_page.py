"""Writes docs/benchmarks.md and its plots from the benchmark JSON files in docs/benchmarks/.

    python scripts/make_benchmarks_page.py            # after committing a new <bench>_<machine>.json
    python scripts/make_benchmarks_page.py --dir other/results --out other/benchmarks.md

Every table on the page comes from one JSON file that a benchmark script wrote, with the
command that produced it, the machine it ran on and the date. Rows a benchmark skipped (fp16 or
TF32 without CUDA, Lightning not installed) are shown as skipped, never as numbers; a benchmark
with no file from a given kind of machine is listed as not measured there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import atomic_path, check_out, die, run_main  # noqa: E402


@dataclass
class Section:
    bench: str  # script name; files are docs/benchmarks/<bench>_<machine>.json
    title: str
    what: str
    rows: str  # key of the row list in the JSON
    columns: Sequence[str]
    label: Callable[[Dict[str, Any]], str]
    throughput: Optional[str] = None  # plotted per row
    wait: Optional[str] = None  # plotted per row
    extra: Optional[str] = None  # a second row list shown as its own table
    extra_title: str = ""
    extra_columns: Sequence[str] = ()


SECTIONS = [
    Section("bench_overhead", "Launcher overhead: plain PyTorch loop vs Stoker (vs Lightning)",
            "Same model, data, batch, optimizer, steps, initial weights and order (`weights_diff`: "
            "the final weights' relative difference from the counterpart's); steady-state "
            "samples/s (steps after the first 50), wall and CPU microseconds per step, the "
            "fastest of five stretches (`best_step_us`), the overhead per step against the plain "
            "counterpart, and `vs_plain`: the median of per-repeat ratios to it. `lockstep_*` "
            "rows take Stoker's and the plain loop's steps in turn in one process (the ratio "
            "that resolves a few percent on a shared machine); `lockstep_null` takes two plain "
            "loops' steps so, the first in Stoker's place: the harness's reading of identical "
            "work. "
            "`tiny` is the default job's step alone (digits MLP, batch 64, one thread); `cnn` "
            "a compute-bound CNN step. Target: `vs_plain` >= 0.97 on `tiny`.",
            "results", ["workload", "runner", "counterpart", "samples_per_s", "step_us",
                        "cpu_us", "best_step_us", "overhead_us", "vs_plain",
                        "vs_plain_whole_run", "weights_diff", "runs", "skipped"],
            lambda r: f"{r.get('workload', '')} {r['runner']}".strip(),
            throughput="samples_per_s", extra="startup",
            extra_title="Start-up: wall seconds from the command to its exit (one step "
                        "and one validation batch for train.py)",
            extra_columns=["command", "wall_s", "best_s", "runs"]),
    Section("bench_speed", "Speed switches, one at a time",
            "The default training run and the same run with one switch changed; samples/s and "
            "data-wait are medians over logging windows after the first, `vs_baseline` the "
            "ratio to the default run measured in the same invocation.",
            "results", ["switch", "overrides", "samples_per_s", "vs_baseline", "data_wait_frac",
                        "peak_mem_mb", "skipped"],
            lambda r: r["switch"], throughput="samples_per_s", wait="data_wait_frac"),
    Section("bench_gpu", "GPU efficiency: throughput, data-wait, copy bandwidth, MFU",
            "Reference CNN on synthetic uint8 images and a small transformer on synthetic "
            "tokens, bf16 and fp16, with and without the side-stream prefetcher; then the "
            "prefetcher's host-to-device bandwidth against a plain pinned copy of the same "
            "bytes. Targets: data-wait < 1% on the CNN with the prefetcher, prefetcher >= 90% "
            "of the plain pinned copy. The settings are in each file (the CNN's samples are made "
            "once into data.cache=memory and batched by loader workers into pinned memory). "
            "`data_wait_frac` is the training thread's time getting batches, "
            "`device_wait_frac` the GPU's idle time across those fetches (files from before "
            "it was measured leave it empty).",
            "training", ["model", "precision", "prefetch", "samples_per_s", "tokens_per_s",
                         "data_wait_frac", "device_wait_frac", "peak_mem_mb", "mfu",
                         "skipped"],
            lambda r: f"{r['model']} {r['precision']}" + ("" if r["prefetch"] else " no-prefetch"),
            throughput="samples_per_s", wait="data_wait_frac", extra="copy",
            extra_title="Host-to-device copies (GB/s; microseconds per batch):",
            extra_columns=["batch_mb", "batches", "plain_pinned_gbps", "prefetcher_gbps",
                           "prefetcher_vs_plain", "plain_us", "prefetcher_us", "pageable_gbps",
                           "skipped"]),
    Section("compare_strategies", "Strategies: single process vs DDP vs DataParallel",
            "The same model and global batch as one process, as DDP ranks and (on CUDA) as "
            "DataParallel.",
            "results", ["strategy", "ranks", "per_rank_batch", "samples_per_s", "step_time_ms",
                        "data_wait_frac", "peak_mem_mb", "skipped"],
            lambda r: r["strategy"], throughput="samples_per_s", wait="data_wait_frac"),
    Section("bench_loader", "Input pipeline: the classic loader comparison",
            "(a) synchronous loading, (b) worker processes, (c) workers + pinned memory + "
            "non_blocking copies, (d) (c) with data cached in memory; epoch time against the "
            "bound max(compute, data / workers).",
            "results", ["config", "epoch_s", "samples_per_s", "speedup", "vs_bound"],
            lambda r: r["config"], throughput="samples_per_s"),
    Section("bench_images", "Real image files: decoding, packing, caches, streaming",
            "JPEG files decoded with Pillow through (a) 0 and (b) W workers (normalised on the "
            "CPU), (c) W workers shipping uint8 normalised on the device, (d) packed memmap "
            "arrays, (e) each data.cache on its second epoch, (f) streamed tar shards; a fixed "
            "wait per step stands for the GPU; decode_1_process and decode_W_processes decode the "
            "set with no loader in 1 and W processes at once. `vs_bound`: epoch time over "
            "max(compute, decode cost / W); `vs_machine`: over max(compute, decode_W_processes), "
            "what W cores decode together here; `vs_b`: speed-up over (b); `one_off_s`: "
            "packing, sharding or filling the cache. In (c) the workers decode each batch "
            "into one tensor, in shared-memory blocks they reuse (the training loader's batch "
            "pool); `c_plain_dataloader` is PyTorch's DataLoader over the same folder (one "
            "tensor a batch, a new block each). Targets: (c) <= 1.15x the bound (also read "
            "paired within each repeat: `c_vs_bound_paired`), (d) >= 5x (b).",
            "results", ["config", "epoch_s", "samples_per_s", "vs_bound", "vs_machine", "vs_b",
                        "one_off_s"],
            lambda r: r["config"], throughput="samples_per_s"),
    Section("bench_handoff", "Receiving a worker's batch: pooled blocks vs PyTorch's collate",
            "The training loader over uint8 images in memory (the samples cost nothing to make), "
            "with Stoker's collate (samples stacked into one reused block of the worker's pool) "
            "and with PyTorch's default collate (a new block per tensor per batch, each block's "
            "file descriptor fetched over a connection to the worker), in fresh processes that "
            "alternate: samples/s delivered, `vs_default` the median of per-repeat ratios, and "
            "the training thread's CPU per batch.",
            "results", ["collate", "samples_per_s", "vs_default", "main_cpu_us_per_batch",
                        "runs"],
            lambda r: r["collate"], throughput="samples_per_s"),
    Section("tune_loader", "Loader tuning sweep",
            "num_workers x prefetch_factor (x pin_memory on CUDA) on the configured dataset.",
            "results", ["num_workers", "prefetch_factor", "pin_memory", "samples_per_s",
                        "first_batch_s"],
            lambda r: f"w{r['num_workers']} pf{r['prefetch_factor']}"
                      + (" pin" if r.get("pin_memory") else ""),
            throughput="samples_per_s"),
    Section("bench_checkpoint", "Checkpoint stall: synchronous vs asynchronous save",
            "How long a save stops training, and how long the write takes.",
            "results", ["mode", "state_mb", "stall_s", "write_s", "stall_vs_sync"],
            lambda r: r["mode"]),
]


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v).replace("|", "\\|")


def md_table(rows: List[Dict[str, Any]], columns: Sequence[str]) -> List[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(cell(r.get(c)) for c in columns) + " |")
    return out


def describe_machine(m: Dict[str, Any]) -> str:
    device = f"{m.get('gpu_count', 1)} x {m['gpu']}" if m.get("cuda") else "no GPU"
    return (f"{device}; {m.get('cpu_count')} CPU cores; {m.get('platform')}; "
            f"torch {m.get('torch')}; Python {m.get('python')}")


def spread(row: Dict[str, Any], key: str) -> Optional[tuple]:
    """(min, max) of `key` over the row's repeats (`all`), when it recorded them."""
    runs = row.get("all")
    if not isinstance(runs, list) or not runs:
        return None
    values = [r.get(key) if isinstance(r, dict) else r for r in runs]
    values = [v for v in values if isinstance(v, (int, float))]
    return (min(values), max(values)) if values else None


def plot(section: Section, rows: List[Dict[str, Any]], title: str, png: Path) -> bool:
    """Bar charts of throughput (and data-wait) per measured row, with the spread over
    repeats where the JSON has it; False if nothing to plot."""
    measured = [r for r in rows if section.throughput and r.get(section.throughput) is not None]
    if not measured:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(section.throughput, "samples/s")]
    if section.wait and any(r.get(section.wait) is not None for r in measured):
        panels.append((section.wait, "data-wait (% of step time)"))
    labels = [section.label(r) for r in measured]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 0.45 * len(labels) + 1.6),
                             squeeze=False)
    for ax, (key, name) in zip(axes[0], panels):
        scale = 100.0 if key == section.wait else 1.0
        values = [scale * (r.get(key) or 0.0) for r in measured]
        ranges = [spread(r, key) for r in measured]
        xerr = None
        if all(ranges):  # whiskers from the slowest to the fastest repeat
            xerr = [[v - scale * lo for v, (lo, _) in zip(values, ranges)],
                    [scale * hi - v for v, (_, hi) in zip(values, ranges)]]
        ax.barh(labels, values, xerr=xerr, capsize=3,
                color="tab:orange" if key == section.wait else "tab:blue")
        ax.invert_yaxis()
        ax.set_xlabel(name)
        for y, v in enumerate(values):
            ax.text(0, y, f" {v:.1f}" if scale > 1 else f" {v:,.0f}", va="center",
                    fontsize=8, color="white", fontweight="bold")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True


class BadFile(ValueError):
    """A file in --dir that is not a benchmark's JSON: one line naming it."""


def load(path: Path) -> Dict[str, Any]:
    """A benchmark's JSON: an object with the machine it ran on."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise BadFile(f"{path}: not valid JSON ({e.msg}: line {e.lineno} column {e.colno}); "
                      "rerun the benchmark that wrote it, or move the file away") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadFile(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("machine"), dict):
        raise BadFile(f"{path}: no \"machine\" object, so not a file a benchmark script wrote "
                      "(each records the machine it ran on); move it out of the folder")
    return data


def link(target: Path, page_dir: Path) -> str:
    """`target` as the page links it: relative to the page's folder, wherever either is (a
    relative --out, a page outside the repository)."""
    return Path(os.path.relpath(os.path.abspath(target), os.path.abspath(page_dir))).as_posix()


def render_file(section: Section, path: Path, page_dir: Path,
                data: Dict[str, Any]) -> List[str]:
    try:
        return _render_file(section, path, page_dir, data)
    except (KeyError, TypeError, AttributeError) as e:
        what = f"no {e}" if isinstance(e, KeyError) else str(e)
        raise BadFile(f"{path}: not what {section.bench}.py writes ({what})") from None


def _render_file(section: Section, path: Path, page_dir: Path,
                 data: Dict[str, Any]) -> List[str]:
    m = data["machine"]
    rows = data.get(section.rows, [])
    lines = [f"### `{path.name}`", "",
             f"- command: `{data.get('command', '(not recorded)')}`",
             f"- machine: {describe_machine(m)}",
             f"- date: {m.get('date')}"]
    if data.get("smoke"):
        lines.append("- **smoke run** (tiny sizes to exercise the code, not a measurement)")
    if data.get("partial"):
        lines.append("- **incomplete**: the run was cut off by its time limit; each row holds "
                     "the repeats that finished (`runs`), and missing workloads were not run")
    lines += [""] + md_table(rows, section.columns)
    if section.extra and data.get(section.extra):
        lines += ["", section.extra_title, ""]
        lines += md_table(data[section.extra], section.extra_columns)
    png = path.with_name(path.stem + "-plot.png")
    if plot(section, rows, f"{path.stem} ({m.get('gpu') or 'CPU'}, {m.get('date', '')[:10]})",
            png):
        lines += ["", f"![{path.stem}]({link(png, page_dir)})"]
    return lines + [""]


HEADER = """# Benchmarks

Generated by `python scripts/make_benchmarks_page.py` from the JSON files in
`docs/benchmarks/` (do not edit by hand). Each table names the command that produced it,
the machine and the date. Numbers are medians of alternating repeats measured side by side in
one invocation; compare ratios within a table, not absolute numbers across machines. A row
marked skipped was not measured there (no number is written for it).
"""


def render(bench_dir: Path, page: Path) -> str:
    lines = [HEADER]
    not_on_gpu = []
    for section in SECTIONS:
        files = {path: load(path) for path in sorted(bench_dir.glob(f"{section.bench}_*.json"))}
        lines += [f"## {section.title}", "", section.what, ""]
        if not files:
            lines += ["Not measured yet.", ""]
        for path, data in files.items():
            lines += render_file(section, path, page.parent, data)
        if not any(data["machine"].get("cuda") for data in files.values()):
            not_on_gpu.append(section.bench)
    lines += ["## Not measured on a GPU yet", "",
              "No JSON from a CUDA machine has been committed for these; run them there "
              "(`--out docs/benchmarks/<name>_<gpu>.json`) and regenerate this page:", ""]
    lines += [f"- `python scripts/{b}.py`" for b in not_on_gpu] or ["- (none)"]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: Optional[List[str]] = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=ROOT / "docs" / "benchmarks")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    a = p.parse_args(argv)
    if not a.dir.is_dir():
        p.error(f"--dir {a.dir}: no such directory of benchmark JSON files")
    check_out(p, a.out)
    try:
        text = render(a.dir, a.out)
    except BadFile as e:
        die(str(e), code=2)
    with atomic_path(a.out) as tmp:  # the page is whole or as it was
        tmp.write_text(text)
    print(f"wrote {a.out}")
    return a.out


if __name__ == "__main__":
    run_main(main)

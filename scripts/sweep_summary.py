"""A sweep's jobs side by side, for a sweep dir (trainer/sweep.py): its table, and sweep.json.

    python scripts/sweep_summary.py multirun/2026-11-26/11-30-42
    python scripts/sweep_summary.py multirun/2026-11-26/11-30-42 --no-write   # print only

A sweep that ran every job prints this itself at its end; this is for one that was stopped,
resumed, or submitted to SLURM (hydra/launcher=slurm) and looked at later. Jobs that did not
finish show their status (failed, preempted, running) and no results; jobs the sweep never
started have no dir and are not listed. A job marked running whose process (on this host) is
gone shows as "stopped (process gone)"; a damaged status.json as "unreadable status.json" and a
damaged summary.json as dashes, each with a warning line on stderr naming the file.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import run_main  # noqa: E402
from trainer.sweep import SUMMARY, summarise, table, write  # noqa: E402


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir", type=Path, help="a sweep's dir (hydra.sweep.dir)")
    p.add_argument("--no-write", action="store_true", help=f"print only, no {SUMMARY}")
    a = p.parse_args(argv)
    if not a.sweep_dir.is_dir():
        p.error(f"{a.sweep_dir}: not a folder (a sweep's dir: multirun/<date>/<time>)")
    if not (a.sweep_dir / "multirun.yaml").is_file():  # (Hydra writes it into every sweep's)
        p.error(f"{a.sweep_dir}: not a sweep's dir (no multirun.yaml, which Hydra writes into "
                "each; a sweep's dir is multirun/<date>/<time>)")
    record = summarise(a.sweep_dir)
    if not record["jobs"]:
        p.error(f"{a.sweep_dir}: no job has started in this sweep yet")
    for line in record["warnings"]:
        print(f"{p.prog}: warning: {line}", file=sys.stderr, flush=True)
    print(table(record), flush=True)
    if not a.no_write:
        try:
            write(a.sweep_dir, record)
        except OSError as e:  # (the table is out: only the file is missing)
            print(f"{p.prog}: error: {e.filename} not written ({e.strerror or e}); the table "
                  f"above is what it would hold (--no-write prints it only)", file=sys.stderr)
            raise SystemExit(1) from None


if __name__ == "__main__":
    run_main(main)

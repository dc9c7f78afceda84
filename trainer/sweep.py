"""A sweep's jobs side by side: what each job changed, how it ended, and its results.

When a sweep (`-m`) has run every job, Hydra calls `SweepSummary.on_multirun_end` (registered
under `hydra.callbacks` in conf/train.yaml) in the launching process: rank 0 writes
`<sweep dir>/sweep.json` and prints a table, one row per job, of the overrides that differ
between the jobs, the job's status, its steps, validation results and samples/s, with the best
job by `trainer.checkpoint.monitor` (val_loss when nothing is monitored) named above it.
`python scripts/sweep_summary.py <sweep dir>` makes the same for a sweep that was stopped,
resumed, or submitted to SLURM and finished later.

Each job's row comes from the files it left: `.hydra/overrides.yaml` (its overrides),
`status.json` (how it ended) and `summary.json` (its results, written when it finished).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

SUMMARY = "sweep.json"
# the results a row shows besides the validation keys, in this order
RESULTS = ("steps", "train_loss")
RATE = "run_samples_per_s"


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _overrides(job_dir: Path) -> List[str]:
    try:
        value = OmegaConf.to_container(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"))
    except Exception:  # noqa: BLE001  (missing or not YAML: a job that never started)
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _job_key(path: Path) -> Tuple[int, int, str]:
    """Job order: numbered dirs (hydra.sweep.subdir's default) by number, then by name."""
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def jobs_of(sweep_dir: Path) -> List[Dict[str, Any]]:
    """One record per job dir under `sweep_dir` (a dir holding a run's status.json or Hydra's
    record: any hydra.sweep.subdir), in job order; a job is named by its dir."""
    jobs = []
    found = [p for p in sweep_dir.iterdir() if p.is_dir() and
             ((p / "status.json").is_file() or (p / ".hydra").is_dir() or p.name.isdigit())]
    for job_dir in sorted(found, key=_job_key):
        status = _read_json(job_dir / "status.json") or {}
        jobs.append({"job": int(job_dir.name) if job_dir.name.isdigit() else job_dir.name,
                     "dir": str(job_dir), "overrides": _overrides(job_dir),
                     "status": status.get("status", "not started"),
                     "summary": _read_json(job_dir / "summary.json") or {}})
    return jobs


def _given(job: Dict[str, Any]) -> Dict[str, str]:
    """A job's overrides as key -> value (`key=value`; `~key` as key -> "")."""
    return dict(o.split("=", 1) if "=" in o else (o, "") for o in job["overrides"])


# how a sweep was launched or resumed, not what its jobs compare
_NOT_COMPARED = ("trainer.resume", "hydra.", "+hydra.")


def varying(jobs: List[Dict[str, Any]]) -> List[str]:
    """The override keys whose values are not the same in every job whose overrides are known,
    in first-seen order (all of them for a sweep of one job)."""
    given = [_given(job) for job in jobs if job["overrides"]]
    order = [key for key in dict.fromkeys(key for g in given for key in g)
             if not key.lstrip("+~").startswith(_NOT_COMPARED)]
    keys = [key for key in order if len({g.get(key) for g in given}) > 1]
    return keys if keys or len(given) != 1 else order


def best_job(jobs: List[Dict[str, Any]]) -> Tuple[Optional[int], str, str]:
    """(the best job's number or None, the key, max|min): by the monitored key each job's
    summary names (trainer.checkpoint.monitor and its mode), else val_loss, lowest."""
    key, mode = "val_loss", "min"
    for job in jobs:
        monitor = job["summary"].get("monitor")
        if isinstance(monitor, dict) and monitor.get("key") and monitor.get("mode"):
            key, mode = monitor["key"], monitor["mode"]
            break
    scored = [(job["summary"][key], job["job"]) for job in jobs
              if job["status"] == "completed" and isinstance(job["summary"].get(key), (int, float))
              and math.isfinite(job["summary"][key])]
    if not scored:
        return None, key, mode
    _, num = (max if mode == "max" else min)(scored, key=lambda s: s[0])
    return num, key, mode


def summarise(sweep_dir: Path) -> Dict[str, Any]:
    """The sweep's record: its jobs (overrides that differ, status, results) and the best."""
    jobs = jobs_of(sweep_dir)
    keys = varying(jobs)
    best, key, mode = best_job(jobs)
    results = list(RESULTS) + sorted({k for j in jobs for k in j["summary"]
                                      if k.startswith("val_")}) + [RATE]
    rows = []
    for job in jobs:
        given = _given(job)
        rows.append({"job": job["job"], "overrides": {k: given.get(k) for k in keys},
                     "status": job["status"], "dir": job["dir"],
                     **{k: job["summary"].get(k) for k in results}})
    return {"sweep_dir": str(sweep_dir), "monitor": key, "mode": mode, "best_job": best,
            "varying": keys, "results": results, "jobs": rows}


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def table(record: Dict[str, Any]) -> str:
    """The record as lines: the best job, then one row per job."""
    short = {RATE: "samples/s"}
    columns = ["job", *record["varying"], "status", *record["results"]]
    rows = [[_cell(r["job"]), *[_cell(r["overrides"][k]) for k in record["varying"]],
             r["status"], *[_cell(r[k]) for k in record["results"]]] for r in record["jobs"]]
    head = [short.get(c, c) for c in columns]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
             for cells in (head, *rows)]
    jobs = record["jobs"]
    best = record["best_job"]
    title = (f"sweep: {len(jobs)} jobs in {record['sweep_dir']}; best by {record['monitor']} "
             f"({record['mode']}): " + (f"job {best}" if best is not None else
                                         "none (no completed job logged it)"))
    return "\n".join([title, *lines])


def write(sweep_dir: Path) -> Dict[str, Any]:
    """Writes `<sweep_dir>/sweep.json` (whole or not at all) and returns its record."""
    record = summarise(sweep_dir)
    tmp = sweep_dir / f".{SUMMARY}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, sweep_dir / SUMMARY)
    return record


class SweepSummary(Callback):
    """Hydra's callback at the end of a sweep that ran every job: sweep.json and the table,
    from rank 0 (every rank of a torchrun sweep runs the jobs alike)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from trainer.distributed import detect

        if not detect().is_main:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir() or not jobs_of(sweep_dir):
            return
        try:
            record = write(sweep_dir)
        except OSError as e:  # a full disk or a read-only dir: the jobs' own files stand
            print(f"stoker: warning: {sweep_dir / SUMMARY} not written ({e.strerror or e})",
                  flush=True)
            return
        print(table(record), flush=True)

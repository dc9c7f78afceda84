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

Hydra writes `<sweep dir>/multirun.yaml` at every launch, before the first job: a relaunch
into a sweep's dir that its first job refuses (another run's checkpoints: "nothing was
changed") would replace the record of the sweep the dir holds. `SweepSummary` keeps a copy at
the launch's start and puts it back at the exit of a launch that changed no job.
"""
from __future__ import annotations

import atexit
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from trainer.overrides import override_key

SUMMARY = "sweep.json"
RECORD = "multirun.yaml"  # Hydra's record of the sweep, which it writes at every launch
# the results a row shows besides the validation keys, in this order
RESULTS = ("steps", "train_loss")
RATE = "run_samples_per_s"


# a job's status where its status.json says nothing it can be judged by
UNREADABLE = "unreadable status.json"
# a job whose status.json says running while the process it names (on this host) is gone:
# killed by SIGKILL or out of memory, where nothing could write how it ended
GONE = "stopped (process gone)"


def runs_jobs_here(launcher_target: str) -> bool:
    """Whether a sweep launcher (its `_target_`) runs the jobs in this process, one after
    another: Hydra's basic launcher (submitit's runs each as a job of its own)."""
    return "basic_launcher" in launcher_target


def in_sweep() -> bool:
    """Whether this process runs a job of a Hydra sweep (`-m`)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _read_json(path: Path) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """(the JSON object in `path`, None); (None, None) where there is no such file; (None,
    what is wrong) where it cannot be read or holds no JSON object (a write cut short)."""
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, e.strerror or str(e)
    except ValueError:
        return None, "not JSON"
    return (value, None) if isinstance(value, dict) else (None, "not a JSON object")


def _status(job_dir: Path, damaged: List[str]) -> str:
    """The job's status as its status.json says it, `GONE` for a running job whose process
    is gone, `UNREADABLE` for a damaged file (said in `damaged`)."""
    path = job_dir / "status.json"
    status, problem = _read_json(path)
    if status is not None and not isinstance(status.get("status"), str):
        problem = "no status in it"
    if problem:
        damaged.append(f"{path}: {problem}; its job shows as \"{UNREADABLE}\"")
        return UNREADABLE
    if status is None:
        return "not started"
    if status["status"] == "running" and _gone(status):
        return GONE
    return status["status"]


def _gone(status: Dict[str, Any]) -> bool:
    """Whether the process a running job's status.json names is certainly gone: on this host
    and no such process (another host's processes cannot be looked at)."""
    host, pid = status.get("host"), status.get("pid")
    if not isinstance(host, str) or not isinstance(pid, int) or isinstance(pid, bool):
        return False
    from trainer.runlock import owner_alive  # (torch comes with it: only where a job runs)

    return not owner_alive({"host": host, "pid": pid})


def _summary(job_dir: Path, damaged: List[str]) -> Dict[str, Any]:
    """The job's summary.json ({} where there is none yet, or it is damaged: said in
    `damaged`)."""
    path = job_dir / "summary.json"
    summary, problem = _read_json(path)
    if problem:
        damaged.append(f"{path}: {problem}; its job's results show as -")
    return summary or {}


def job_overrides(job_dir: Path) -> List[str]:
    try:
        value = OmegaConf.to_container(OmegaConf.load(job_dir / ".hydra" / "overrides.yaml"))
    except Exception:  # noqa: BLE001  (missing or not YAML: a job that never started)
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


def _job_num(job_dir: Path) -> Optional[int]:
    """The job's number as Hydra counted it (`.hydra/hydra.yaml`), where recorded."""
    try:
        num = OmegaConf.load(job_dir / ".hydra" / "hydra.yaml").hydra.job.num
        return int(num)
    except Exception:  # noqa: BLE001  (not recorded: a job dir that holds nothing yet)
        return None


def _job_dirs(sweep_dir: Path, depth: int = 16) -> List[Path]:
    """The dirs under `sweep_dir` (to `depth` levels: hydra.sweep.subdir may nest, as
    runs/${hydra.job.num} does; a job's own dirs are not searched) that hold a run's
    status.json or Hydra's record of a job. (Three levels were searched: a sweep of
    `a/b/c/${hydra.job.num}` had no table, and sweep_summary.py said no job had started.)"""
    found, level = [], [sweep_dir]
    for _ in range(depth):
        level = [p for d in level for p in sorted(d.iterdir())
                 if p.is_dir() and not p.name.startswith(".") and p.name != "checkpoints"]
        found += [p for p in level
                  if (p / "status.json").is_file() or (p / ".hydra" / "overrides.yaml").is_file()]
        level = [p for p in level if p not in found]
    return found


def jobs_of(sweep_dir: Path) -> List[Dict[str, Any]]:
    """One record per job dir under `sweep_dir` (any hydra.sweep.subdir), in the order Hydra
    launched them; a job is named by its dir (its number, with the default subdir). Jobs
    the sweep never started have no dir: they are not listed. A record's `damaged` says,
    one line a file, which of its status.json and summary.json could not be read."""
    jobs = []
    for job_dir in _job_dirs(sweep_dir):
        name = str(job_dir.relative_to(sweep_dir))
        numbered = int(name) if name.isdigit() else None  # (hydra.sweep.subdir's default)
        num = _job_num(job_dir)
        damaged: List[str] = []
        jobs.append({"job": name if numbered is None else numbered,
                     "num": numbered if num is None else num,
                     "dir": str(job_dir), "overrides": job_overrides(job_dir),
                     "status": _status(job_dir, damaged),
                     "summary": _summary(job_dir, damaged), "damaged": damaged})
    jobs.sort(key=lambda j: (j["num"] is None, j["num"] or 0, str(j["job"])))
    return jobs


def given_overrides(job: Dict[str, Any]) -> Dict[str, str]:
    """A job's overrides as key -> value (`key=value`; `~key` as key -> "")."""
    return dict(o.split("=", 1) if "=" in o else (o, "") for o in job["overrides"])


# how a sweep was launched or resumed, not what its jobs compare
_NOT_COMPARED = ("trainer.resume", "hydra.", "+hydra.")


def varying(jobs: List[Dict[str, Any]]) -> List[str]:
    """The override keys whose values are not the same in every job whose overrides are known,
    in first-seen order (all of them for a sweep of one job)."""
    given = [given_overrides(job) for job in jobs if job["overrides"]]
    order = [key for key in dict.fromkeys(key for g in given for key in g)
             if not override_key(key).startswith(_NOT_COMPARED)]
    keys = [key for key in order if len({g.get(key) for g in given}) > 1]
    return keys if keys or len(given) != 1 else order


def best_job(jobs: List[Dict[str, Any]]) -> Tuple[Optional[Any], str, str]:
    """(the best job's name or None, the key, max|min): by the monitored key the first job's
    summary names (trainer.checkpoint.monitor and its mode), else val_loss, lowest; of jobs
    that tie, the first launched."""
    key, mode = "val_loss", "min"
    for job in jobs:
        monitor = job["summary"].get("monitor")
        if isinstance(monitor, dict) and monitor.get("key") and monitor.get("mode"):
            key, mode = monitor["key"], monitor["mode"]
            break
    scored = [(value, job["job"]) for job in jobs if job["status"] == "completed"
              for value in [_score(job["summary"], key)] if value is not None]
    if not scored:
        return None, key, mode
    _, num = (max if mode == "max" else min)(scored, key=lambda s: s[0])
    return num, key, mode


def _kept_best(summary: Dict[str, Any], key: str) -> Optional[Any]:
    """The value a job's best.pt holds for `key` (the best over its validations), where it
    kept one by that key; else None."""
    best = summary.get("best")
    return best.get("value") if isinstance(best, dict) and best.get("monitor") == key else None


def _score(summary: Dict[str, Any], key: str) -> Optional[float]:
    """What a job is ranked by: its best.pt's value for `key` where it kept one, else its
    last validation's; None if not finite."""
    value = _kept_best(summary, key)
    value = summary.get(key) if value is None else value
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def summarise(sweep_dir: Path) -> Dict[str, Any]:
    """The sweep's record: its jobs (overrides that differ, status, results), the best, and
    `warnings`: a line for each job's file that could not be read."""
    jobs = jobs_of(sweep_dir)
    keys = varying(jobs)
    best, key, mode = best_job(jobs)
    results = list(RESULTS) + sorted({k for j in jobs for k in j["summary"]
                                      if k.startswith("val_")}) + [RATE]
    # where the jobs kept a best.pt by the key, its value (the best over the validations,
    # which ranks them) beside the last validation's
    kept = any(_kept_best(j["summary"], key) is not None for j in jobs)
    if kept:
        results.insert(len(RESULTS), f"best_{key}")
    rows = []
    for job in jobs:
        given = given_overrides(job)
        values = {k: job["summary"].get(k) for k in results}
        if kept:
            values[f"best_{key}"] = _kept_best(job["summary"], key)
        rows.append({"job": job["job"], "overrides": {k: given.get(k) for k in keys},
                     "status": job["status"], "dir": job["dir"],
                     "stopped_early": job["summary"].get("stopped_early"), **values})
    return {"sweep_dir": str(sweep_dir), "monitor": key, "mode": mode, "best_job": best,
            "varying": keys, "results": results, "jobs": rows,
            "warnings": [line for job in jobs for line in job["damaged"]]}


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
             r["status"] + (" (stopped early)" if r.get("stopped_early") else ""),
             *[_cell(r[k]) for k in record["results"]]] for r in record["jobs"]]
    head = [short.get(c, c) for c in columns]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
             for cells in (head, *rows)]
    jobs = record["jobs"]
    best = record["best_job"]
    title = (f"sweep: {len(jobs)} job{'s' if len(jobs) != 1 else ''} in "
             f"{record['sweep_dir']}; best by {record['monitor']} ({record['mode']}"
             + (", best.pt's" if f"best_{record['monitor']}" in record["results"] else "")
             + "): " + (f"job {best}" if best is not None else
                        "none (no completed job logged it)"))
    return "\n".join([title, *lines])


def write(sweep_dir: Path, record: Dict[str, Any]) -> None:
    """Writes `record` (`summarise`) to `<sweep_dir>/sweep.json`, whole or not at all: where
    it cannot (a full disk, a read-only dir, a folder of that name), no temporary file is left
    and the OSError raised names `<sweep_dir>/sweep.json`."""
    path = sweep_dir / SUMMARY
    tmp = sweep_dir / f".{SUMMARY}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException as e:  # (a Ctrl-C mid-write too: the old sweep.json, or none, stays)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # (a folder of that name is no file of ours)
        if isinstance(e, OSError):  # the file the user asked for, not our temporary one
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise


def _statuses(sweep_dir: Path) -> Dict[str, Optional[bytes]]:
    """Each job dir's status.json as it is now: a job that did anything wrote it (from its
    first step; a job refused in a dir without one writes one), a refused one left it as it
    was."""
    found: Dict[str, Optional[bytes]] = {}
    for job_dir in _job_dirs(sweep_dir):
        try:
            found[str(job_dir)] = (job_dir / "status.json").read_bytes()
        except OSError:
            found[str(job_dir)] = None
    return found


def kept_record(sweep_dir: Path) -> Path:
    """Where a launch keeps the sweep dir's multirun.yaml as it found it: a name of the launch
    that every rank of it computes alike (trainer/stamp.py)."""
    from trainer.stamp import run_stamp

    launch = re.sub(r"[^\w.-]", "_", run_stamp(fmt="%Y%m%d-%H%M%S"))
    return sweep_dir / f".{RECORD}.{launch}.kept"


def keep_record(sweep_dir: Path, kept: Path) -> None:
    """Copies the sweep dir's multirun.yaml, if any, to `kept` before Hydra writes this
    launch's over it, unless `kept` is there. Under torchrun every rank runs the sweep, and
    Hydra's sweeper in each writes the record right after this: the rank whose copy lands
    first read the file before any rank wrote it, a later rank may have read a peer's."""
    try:
        data = (sweep_dir / RECORD).read_bytes()
    except OSError:
        return  # (a new sweep dir: nothing to keep)
    tmp = sweep_dir / f".{RECORD}.{os.getpid()}.tmp"
    try:
        tmp.write_bytes(data)
        os.link(tmp, kept)  # the whole file or none, never over an earlier rank's copy
    except OSError:
        pass  # a peer's copy is there (or the dir is read-only: so is Hydra's write)
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


class SweepSummary(Callback):
    """Hydra's callback around a sweep: at its end, when it ran every job, sweep.json and the
    table, from rank 0 (every rank of a torchrun sweep runs the jobs alike); at the exit of
    a launch that changed none of its jobs (refused at its first job, say), the sweep dir's
    multirun.yaml as it was before Hydra wrote this launch's over it."""

    def __init__(self) -> None:
        self._ended = False
        self._kept: Optional[Tuple[Path, Path, Dict[str, Optional[bytes]]]] = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from trainer import startsignals
        from trainer.distributed import detect

        if not runs_jobs_here(str(OmegaConf.select(config, "hydra.launcher._target_",
                                                   default=""))):
            # the jobs run elsewhere (submitit's): this process only waits for them, and a
            # signal to it stopped no run "before the first step"
            startsignals.put_back()
        sweep_dir = Path(str(config.hydra.sweep.dir))
        kept = kept_record(sweep_dir)
        keep_record(sweep_dir, kept)
        if detect().is_main and kept.is_file():
            try:
                self._kept = (sweep_dir, kept, _statuses(sweep_dir))
            except OSError:
                return
            atexit.register(self.settle)

    def settle(self) -> None:
        """At the launch's exit (rank 0, which writes the jobs' files): the kept multirun.yaml
        goes back in place where the launch did not reach its end and changed no job's
        status.json, else it is dropped (Hydra's record of this launch stays)."""
        if self._kept is None:
            return
        sweep_dir, kept, before = self._kept
        self._kept = None
        try:
            if not self._ended and _statuses(sweep_dir) == before:
                os.replace(kept, sweep_dir / RECORD)
            else:
                kept.unlink()
        except OSError:
            pass  # (the dir went, or turned read-only: the record there stays as it is)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A job of a sweep run in this process (the second and later ones): the preemption
        signals held again until its run takes over, as train.py held them for the first (a
        signal while the job's ranks met ended a rank at -15 without a word)."""
        from trainer import startsignals

        if startsignals.held_once():
            startsignals.hold()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from trainer import startsignals
        from trainer.distributed import detect

        startsignals.put_back()  # (held for a job that did not come: on_job_start)
        self._ended = True
        if not detect().is_main:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        record = summarise(sweep_dir)
        if not record["jobs"]:
            return
        for line in record["warnings"]:
            print(f"stoker: warning: {line}", flush=True)
        print(table(record), flush=True)
        try:
            write(sweep_dir, record)
        except OSError as e:  # a full disk or a read-only dir: the jobs' own files stand
            print(f"stoker: warning: {e.filename} not written ({e.strerror or e}); the table "
                  "above is what it would hold", flush=True)

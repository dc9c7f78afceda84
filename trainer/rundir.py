"""A run dir belongs to one run: a refusal to start a fresh run over another run's files (the
lock that keeps two runs out of one dir: trainer/runlock.py), its status.json, and Hydra's
record of the run written only once those checks passed.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from trainer import checkpoint, distributed, resumefiles, stamp, startsignals, sweep, sweepdirs
from trainer.checkpoint import CHECKPOINT_DIR, LAST, CheckpointError
from trainer.config import ConfigError
from trainer.overrides import override_key
from trainer.logging import write_whole
from trainer.runlock import LOCK, job_id

# what a run that wrote anything leaves behind (train.log aside: this launch's own warnings
# may be in it before the checks; .hydra/ aside: Hydra writes it before them where
# hydra.output_subdir is set)
OUTPUTS = ("metrics.jsonl", "summary.json", "config.yaml", "status.json")
HYDRA_RECORD = ".hydra/"  # Hydra's record of a launch before this one (another app's, say)
RECORDS = ("config.yaml", "status.json", HYDRA_RECORD)  # an attempt's own: no result in them


def check_fresh_start(run_dir: Path, resume: Optional[str], validating: bool = False) -> None:
    """A launch that does not continue the dir's own run must not write over another run's
    checkpoints or outputs: a fresh run (`resume` null), or a new run from a checkpoint outside
    the dir (`resume=PATH`; one of the dir's own continues its run, rolled back). Nor may a
    `resume=auto` that finds no checkpoint start over where a finished run left its summary
    (one run with trainer.save_checkpoint=false: its metrics would go), or over files that no
    run recorded (a folder of the user's own: no status.json of a run). A validation
    (trainer.validate_only, `validating`) writes a record of its own: into a new dir only."""
    run_dir = Path(run_dir)
    _check_not_a_sweep(run_dir)
    _check_not_a_checkpoints_folder(run_dir)
    sweepdirs.check_subdir_names_the_job(run_dir)
    sweepdirs.check_sweep_resume(run_dir, resume)
    found = resumefiles.candidates(run_dir)
    outputs = _outputs_in(run_dir) + (
        [HYDRA_RECORD] if _earlier_hydra_record(run_dir) else [])
    status = _status(run_dir)
    if not found and set(outputs) <= set(RECORDS) and (_failed(status) or _untrained(status)):
        outputs = []  # an attempt that left no result: this run replaces it
    if validating and (outputs or found):  # (not "continue it with trainer.resume=auto")
        where = f"job dir {run_dir}" if dir_key() == "hydra.sweep.dir" else \
            f"{dir_key()}={run_dir}"
        raise ConfigError(f"trainer.validate_only=true: {where} holds a run's files; validate "
                          f"into a new dir ({dir_key()}=...); nothing was changed")
    if resume == "auto" and not found and status is None:
        _check_not_a_folder_of_runs(run_dir)
    if (not outputs and not found) or _same_job(status):
        return  # (an earlier attempt of this job: the runner chose how to continue it)
    sweepdirs.check_same_sweep(run_dir)
    ours = bool(found) or status is not None  # a run's, which trainer.resume=auto continues
    where = f"start in a new dir ({dir_key()}=...); nothing was changed"
    # a run that saved no checkpoint yet is continued from the one it started from
    again = (f"trainer.resume={status['from']}" if not found and status is not None
             and status.get("from") else "trainer.resume=auto")
    if resume == "auto":
        if found:
            return
        if "summary.json" in outputs:
            raise CheckpointError(
                f"trainer.resume=auto: run dir {run_dir} holds a finished run's summary.json "
                f"and no checkpoint to continue from; {where}")
        if not ours:
            raise CheckpointError(
                f"trainer.resume=auto: run dir {run_dir} holds {', '.join(outputs)}, files a "
                f"run writes, but no checkpoint to continue from nor a run's status.json; "
                f"{where}")
        return  # an attempt killed before its first checkpoint: this run starts it over
    if resume is not None and resumefiles.in_run_dir(Path(resume), run_dir):
        return
    what = f"checkpoints ({found[0].name}...)" if found else ", ".join(outputs)
    held = (f"holds another run's {what}: continue it with {again}, or {where}"
            if ours else f"holds {what}, files a run writes (not a run's: no status.json of "
                         f"one): {where}")
    if resume is None:
        raise CheckpointError(f"run dir {run_dir} {held}")
    rolled_back_to = resumefiles.set_aside_step(Path(resume), run_dir)
    if rolled_back_to is not None:
        raise CheckpointError(
            f"trainer.resume={resume}: a state of this run's that a resume set aside (the "
            f"timeline after step {rolled_back_to} it rolled back), "
            "which this dir's run does not go back to; continue it as a new run in a new dir "
            f"({dir_key()}=... trainer.resume={resume}); nothing was changed")
    raise CheckpointError(f"trainer.resume={resume}: a new run from a checkpoint outside run "
                          f"dir {run_dir}, which {held}")


def _outputs_in(run_dir: Path) -> List[str]:
    """The names of the files a run writes (OUTPUTS) that `run_dir` holds with content."""
    return [name for name in OUTPUTS if _written(run_dir / name)]


_SPECIAL = ((stat.S_ISFIFO, "a pipe"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
            (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def check_plain_files(run_dir: Path) -> None:
    """A file the run opens in its dir (train.log, metrics.jsonl, status.json, its lock) that
    is a pipe, a device, a socket or a folder is refused before the first line is logged:
    opening or reading a pipe blocks until another process opens its other end, a hang no
    single SIGTERM ended; a folder in place of summary.json failed the run after all its
    training."""
    for name in ("train.log", "metrics.jsonl", STATUS, "summary.json", "config.yaml", LOCK):
        try:
            mode = os.stat(Path(run_dir) / name).st_mode
        except OSError:  # (none, or a dangling link: written as usual)
            continue
        kind = next((what for test, what in _SPECIAL if test(mode)), None)
        if kind is not None:
            why = "the run could not write it" if kind == "a folder" else \
                "the run would block on it or write into it"
            raise ConfigError(f"{dir_key()}={run_dir}: its {name} is {kind}, not a regular "
                              f"file: {why}; move it "
                              f"away, or start in a new dir ({dir_key()}=...)")


def check_is_hydras(cfg: DictConfig) -> None:
    """Under train.py, `run_dir` is Hydra's output dir: one set apart split the run, its
    files in one dir and its train.log (and .hydra/) added to whatever the other held. Nor
    may Hydra change the working folder to it (relative paths would name other files)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return  # (composed for the Python API: run_dir names the dir)
    if HydraConfig.get().job.chdir:
        raise ConfigError("hydra.job.chdir=true: not supported; it runs the job in its run dir, "
                          "where the relative paths of the launch (data.dataset.root, "
                          "trainer.resume, trainer.init_from, data.cache_dir) name other files "
                          "or none; leave it out (the run's files go to its run dir anyway)")
    hydras = str(HydraConfig.get().runtime.output_dir)
    if os.path.abspath(str(cfg.run_dir)) != os.path.abspath(hydras):
        raise ConfigError(f"run_dir={cfg.run_dir}: differs from the dir Hydra writes this "
                          f"launch's train.log in ({hydras}); under train.py name the run's dir "
                          f"with {dir_key()}={cfg.run_dir} and leave run_dir out (it is "
                          "for configs composed outside train.py)")


def check_dev_run_dir(run_dir: Path) -> None:
    """A fast dev run saves nothing but the lines of its train.log: refused where they would
    go into another run's log (a dir holding a run's checkpoints or files)."""
    run_dir = Path(run_dir)
    held = [p.name for p in resumefiles.candidates(run_dir)[:1]] + _outputs_in(run_dir)
    if held:
        raise ConfigError(f"trainer.fast_dev_run=true (debug=fdr): run dir {run_dir} holds "
                          f"another run's {held[0]}{'...' if len(held) > 1 else ''}, whose "
                          "train.log it would add to; "
                          f"start it in a new dir ({dir_key()}=..., or leave the key out)")


def _check_not_a_sweep(run_dir: Path) -> None:
    """One run (no `-m`) pointed at a sweep's dir is refused: it started beside the sweep's
    jobs, its files mixed with theirs (with trainer.resume=auto, as a fresh start)."""
    if dir_key() == "hydra.sweep.dir" or not (run_dir / sweep.RECORD).is_file():
        return
    jobs = sorted((p.name for p in run_dir.iterdir() if (p / STATUS).is_file()),
                  key=lambda name: (len(name), name))
    held = f", jobs {', '.join(jobs[:3])}{'...' if len(jobs) > 3 else ''}" if jobs else ""
    raise CheckpointError(
        f"run dir {run_dir} is a sweep's dir ({sweep.RECORD}{held}), not one run's: continue "
        f"the sweep with its own -m command and trainer.resume=auto hydra.sweep.dir={run_dir}, "
        f"or one job with its overrides (<job>/.hydra/overrides.yaml) and trainer.resume=auto "
        f"{dir_key()}={run_dir}/<job>; nothing was changed")


def _check_not_a_checkpoints_folder(run_dir: Path) -> None:
    """A run dir that is a run's checkpoints folder (`checkpoints/`, or a folder beside a
    run's status.json, that holds last.pt or step files itself) is refused: a run started
    there, with trainer.resume=auto too (which looks in <run dir>/checkpoints/), began afresh
    inside the other run's folder."""
    if run_dir.name != CHECKPOINT_DIR and _status(run_dir.parent) is None:
        return
    held = [run_dir / LAST] if (run_dir / LAST).is_file() else checkpoint.step_files(run_dir)
    if held:
        raise CheckpointError(
            f"run dir {run_dir} is a run's checkpoints folder (it holds {held[-1].name}), not "
            f"a run's dir: to continue that run, trainer.resume=auto {dir_key()}="
            f"{run_dir.parent}; to start a new one from it, trainer.resume={held[-1]} in a new "
            "dir; nothing was changed")


def _check_not_a_folder_of_runs(run_dir: Path, most: int = 3) -> None:
    """trainer.resume=auto in a folder that holds runs (the folder of all runs, `outputs/`, or
    a day's, `outputs/2026-11-29/`) but is none itself is refused: it started a fresh run
    among them instead of continuing one."""
    runs = []
    for pattern in ("*/" + STATUS, "*/*/" + STATUS):
        runs += sorted(p.parent for p in run_dir.glob(pattern) if _status(p.parent))
        if runs:
            break
    if runs:
        named = ", ".join(str(p.relative_to(run_dir)) for p in runs[:most])
        raise CheckpointError(
            f"trainer.resume=auto: run dir {run_dir} holds runs ({named}"
            f"{'...' if len(runs) > most else ''}), not a run of its own: to continue one, "
            f"trainer.resume=auto {dir_key()}={runs[-1]}; nothing was changed")


def _status(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The dir's status.json, if it is a run's record (`write_status`, `write_running`)."""
    try:
        status = json.loads((run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return None
    if isinstance(status, dict) and isinstance(status.get("status"), str) \
            and "exit_code" in status:
        return status
    return None


def _failed(status: Optional[Dict[str, Any]]) -> bool:
    """Whether `status` records an attempt that failed."""
    return status is not None and status["status"].startswith(("failed", "exited", "stopped")) \
        and isinstance(status["exit_code"], int) and not isinstance(status["exit_code"], bool)


def _untrained(status: Optional[Dict[str, Any]]) -> bool:
    """Whether `status` records an attempt that a preemption signal or a Ctrl-C stopped
    before its first step (its line says that the same command starts it again)."""
    return status is not None and startsignals.BEFORE_FIRST_STEP in str(status.get("error"))


def _earlier_hydra_record(run_dir: Path) -> bool:
    """Whether `run_dir/.hydra/config.yaml` was written before this process started: Hydra's
    record of an earlier launch (of this app, or of another Hydra app whose outputs the dir
    holds), not the one Hydra writes for this launch where hydra.output_subdir is set."""
    record = run_dir / ".hydra" / "config.yaml"
    try:
        if record.stat().st_mtime >= stamp.process_start(os.getpid()) - 1.0:
            return False
    except OSError:  # (none; or no /proc to tell: not judged)
        return False
    try:  # a launch of ours refused before its first step, with hydra.output_subdir set: its
        # record is all it left (a run's would have a status.json), and it is no one's output
        cfg = OmegaConf.load(record)
        return not (isinstance(cfg, DictConfig) and "trainer" in cfg and "run_dir" in cfg)
    except Exception:  # noqa: BLE001  (not YAML: not ours)
        return True


def _written(path: Path) -> bool:
    """A non-empty file."""
    return path.is_file() and path.stat().st_size > 0


def dir_key() -> str:
    """The key that names the run dir: Hydra's on the command line (a sweep's: each job's
    dir is found under it), run_dir from Python."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "run_dir"
    from hydra.types import RunMode

    return "hydra.sweep.dir" if HydraConfig.get().mode == RunMode.MULTIRUN else "hydra.run.dir"


def unused_dir_key() -> List[str]:
    """A warning where the command line names the dir key of the other mode: Hydra ignores
    `hydra.run.dir` in a sweep (-m), whose jobs go under `hydra.sweep.dir`, and
    `hydra.sweep.dir` in a run without -m (with trainer.resume=auto that was a fresh start in
    a new dated dir, the named sweep's job untouched)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    h = HydraConfig.get()
    given = {override_key(a): a for a in list(h.overrides.hydra)}
    if dir_key() == "hydra.sweep.dir" and "hydra.run.dir" in given:
        return [f"{given['hydra.run.dir']}: not used in a sweep (-m), whose jobs go under "
                f"hydra.sweep.dir ({h.sweep.dir})"]
    if dir_key() == "hydra.run.dir" and "hydra.sweep.dir" in given:
        return [f"{given['hydra.sweep.dir']}: not used without -m; this run's dir is "
                f"hydra.run.dir ({h.run.dir}); a sweep's job is continued with "
                "hydra.run.dir=<sweep dir>/<job>"]
    return []


def record_hydra(run_dir: Path, cfg: Optional[DictConfig]) -> None:
    """Hydra's record of the run (`.hydra/config.yaml`, `hydra.yaml`, `overrides.yaml`),
    written by rank 0 once the run dir is known to be this run's (Hydra's own writing of it,
    before any check, is turned off in conf/train.yaml); without `cfg` (a sweep job refused
    before it was built: what the sweep's table shows of it) no config.yaml."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return  # called from Python, not through train.py
    hydra_cfg = HydraConfig.get()
    folder = Path(run_dir) / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    if cfg is not None:
        write_whole(folder / "config.yaml", OmegaConf.to_yaml(cfg))
    write_whole(folder / "hydra.yaml", OmegaConf.to_yaml({"hydra": hydra_cfg}))
    # as typed: an override's ${...} unresolved (read through the config, it was resolved,
    # to None where a dataset gives the value later: a resume then took that None)
    write_whole(folder / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(
        OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False))))


def agreed(check, env) -> None:
    """Runs `check()` on rank 0 and raises its error on every rank (so no rank goes on into
    a collective its peers never enter)."""
    error: Optional[BaseException] = None
    if env.is_main:
        try:
            check()
        except (ConfigError, CheckpointError, OSError) as e:
            error = e
    error = distributed.broadcast_object(error)
    if error is not None:
        raise error


STATUS = "status.json"
_STATUS_WORDS = {0: "completed", 2: "failed: configuration, data or checkpoint",
                 75: "preempted", 130: "interrupted",
                 # a second SIGTERM, SIGUSR1 or SIGHUP while the first waited for a step that
                 # never ended
                 143: "stopped at once", 138: "stopped at once", 129: "stopped at once"}


def write_running(run_dir: Path, source: Optional[str]) -> None:
    """`<run dir>/status.json` while the run trains (from its first optimizer step, when its
    files are opened): a run's record in the dir even if it is killed before any checkpoint,
    so that `trainer.resume=auto` starts it over and a fresh run is told to continue it; with
    the job's id (a restarted attempt of the same job continues it) and the checkpoint it
    started from (`source`: `trainer.resume=PATH`), which continues it while it saved none."""
    _write(run_dir, {"status": "running", "exit_code": None, "error": None,
                     "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                     "host": socket.gethostname(), "pid": os.getpid(), "job": job_id(),
                     "from": source})


def this_jobs(run_dir: Path) -> bool:
    """Whether the dir's run is this job's (an earlier attempt of it: a torchrun restart)."""
    return _same_job(_status(Path(run_dir)))


def _same_job(status: Optional[Dict[str, Any]]) -> bool:
    job = job_id()
    return job is not None and status is not None and status.get("job") == job


def _write(run_dir: Path, status: Dict[str, Any]) -> None:
    try:
        write_whole(Path(run_dir) / STATUS, json.dumps(status, indent=2) + "\n")
    except OSError:
        pass  # the dir itself may be the problem (full disk): the exit code still tells


def write_status(run_dir: Path, code: int, error: str, word: Optional[str] = None) -> None:
    """`<run dir>/status.json`: how the run ended and the exit code its ranks returned (under
    torchrun the job as a whole exits 1 for any failed rank, 75 included, so this file is where
    a preemption is told from a failure)."""
    earlier = _status(Path(run_dir)) or {}  # (the attempt's running record)
    status = {"status": word or _STATUS_WORDS.get(code, "failed"), "exit_code": code,
              "error": error or None, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "job": job_id(), "from": earlier.get("from")}
    if code in (75, 130, 138, 143) and resumefiles.candidates(run_dir):
        status["resume"] = resumefiles.resume_args(run_dir)
        sweep = resumefiles.sweep_resume_args()
        if sweep:
            status["resume_sweep"] = sweep
    _write(run_dir, status)

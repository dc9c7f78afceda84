"""A sweep's job dirs checked before a job writes into one: jobs of one launch that would share
a dir, a resume of one checkpoint in every job of a sweep of what its state keeps, and a job dir
that holds another sweep's job (trainer/rundir.py:check_fresh_start calls them)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from trainer import resumefiles, sweep
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError
from trainer.overrides import override_key


class AnotherSweep(CheckpointError):
    """A sweep job's dir holds a job of another sweep: the fix is another sweep dir, not a
    resume of this one."""


_STAMP = re.compile(r"\$\{stoker_stamp:[^}]*\}")  # (the launch's: one for every job)
_JOB_DIRS: Dict[str, int] = {}  # this process's sweep jobs' dirs: job number by dir


def check_subdir_names_the_job(run_dir: Path) -> None:
    """A sweep whose jobs would share one dir is refused: at its first job where
    `hydra.sweep.subdir` names no part of the job and the sweep dir none either (no
    interpolation but the launch's stamp: `hydra.sweep.subdir=same`), else at a job whose dir
    an earlier job of this launch had (a swept key left out of the dir's name). A relaunch
    with trainer.resume=auto, as the second job's refusal advised, had every job continue the
    first one's run (the other values never trained, exit 0)."""
    if not sweep.in_sweep():
        return
    from hydra.core.hydra_config import HydraConfig

    h = HydraConfig.get()
    raw = OmegaConf.to_container(h.sweep, resolve=False)
    subdir, num = raw.get("subdir"), h.job.num
    fix = "name the job in it: ${hydra.job.num} (the default) or ${hydra.job.override_dirname}"
    if "${" not in str(subdir) and "${" not in _STAMP.sub("", str(raw.get("dir"))) and \
            swept(Path(h.sweep.dir) / sweep.RECORD):
        raise ConfigError(f"hydra.sweep.subdir={subdir}: names one dir for every job of the "
                          f"sweep ({Path(h.sweep.dir) / str(subdir)}), where each job would "
                          f"continue the one before; {fix}")
    earlier = _JOB_DIRS.setdefault(str(Path(run_dir).resolve()), num)
    if earlier != num:
        if "override_dirname" in str(subdir):
            fix = ("hydra.job.override_dirname leaves out the keys of "
                   "hydra.job.config.override_dirname.exclude_keys (trainer.resume, so that a "
                   "relaunch finds its jobs): a sweep of one needs ${hydra.job.num} in it")
        raise ConfigError(f"hydra.sweep.subdir={subdir}: job {num} has the dir of job {earlier} "
                          f"({run_dir}), where it would continue that job's run; {fix}")


def check_sweep_resume(run_dir: Path, resume: Optional[str]) -> None:
    """`trainer.resume=PATH` in a sweep of keys the resumed state keeps (the optimizer's and
    the scheduler's settings, the seed: its RNG states), of a file outside the job's dir, is
    refused: every job would continue that one run as it was (a swept optim.lr gave the same
    result in every job, a table of a comparison that was none). A sweep of the paths, or of
    what a resume applies (trainer.max_epochs), continues as asked."""
    if not sweep.in_sweep() or resume in (None, "auto"):
        return
    if resumefiles.in_run_dir(Path(resume), run_dir):
        return  # (the job's own checkpoint: its run, rolled back)
    from hydra.core.hydra_config import HydraConfig

    from trainer.resumechanges import IMPLEMENTATION_KEYS

    keys = [override_key(k) for k in swept(Path(HydraConfig.get().sweep.dir) / sweep.RECORD)
            or []]
    kept = [k for k in keys if k == "seed" or (k.startswith(("optim.", "sched."))
                                               and k not in IMPLEMENTATION_KEYS)]
    if "trainer.resume" in keys or not kept:
        return
    them = "them" if len(kept) > 1 else "it"
    raise ConfigError(f"trainer.resume={resume}: every job of this sweep of {', '.join(kept)} "
                      f"would continue that one run, whose state keeps {them} (its optimizer's "
                      "settings, its RNG states): the jobs would not differ; "
                      f"trainer.init_from={resume} starts each job from its weights, or "
                      "trainer.resume=auto continues each job's own run")


def check_same_sweep(run_dir: Path) -> None:
    """A sweep job whose dir holds a run of another sweep's job (the same number, other
    values of the keys that sweep varied) is refused, whatever trainer.resume says: resumed,
    it would continue that job's run under this job's settings (its optimizer state keeping
    its lr), and train nothing of this sweep."""
    if not sweep.in_sweep():
        return
    from hydra.core.hydra_config import HydraConfig

    h = HydraConfig.get()
    differ = other_sweeps_job(run_dir, Path(h.sweep.dir), list(h.overrides.task))
    if differ:
        raise AnotherSweep(f"hydra.sweep.dir={h.sweep.dir}: job dir {run_dir} holds a run of "
                           f"another sweep's job ({differ}): launch this sweep in a new "
                           "hydra.sweep.dir, or continue that one with its own values; "
                           "nothing was changed")


# a sweep relaunched to train on: its lengths may change, as one run's may on a resume
_LENGTHS = ("trainer.max_epochs", "trainer.max_steps")


def other_sweeps_job(job_dir: Path, sweep_dir: Path, overrides: List[str]) -> Optional[str]:
    """Where `job_dir` holds a job of another sweep than the one that gives it `overrides`
    (a relaunch into the dir with other values of the keys its sweep varied: Hydra numbers
    the new jobs alike), those keys as `key=<recorded> there, <new> in this job`; None where they
    agree, or the dir holds no job's record. The keys a sweep varied are its record's sweeps
    (the multirun.yaml this launch kept: `optim.lr=1e-3,3e-3`), else told from its jobs'
    records (of a sweep of one job, none: it resumes as one run does, its changes said)."""
    recorded = sweep.job_overrides(job_dir)
    if not recorded:
        return None
    keys = swept(sweep.kept_record(sweep_dir))
    if keys is None:
        jobs = [job for job in sweep.jobs_of(sweep_dir) if job["overrides"]]
        keys = sweep.varying(jobs) if len(jobs) > 1 else []
    keys = [k for k in keys if override_key(k) not in _LENGTHS]
    old = sweep.given_overrides({"overrides": recorded})
    new = sweep.given_overrides({"overrides": overrides})

    def value(v: Optional[str]) -> Any:  # (1e-3 and 0.001 are one value)
        try:
            return float(v) if v is not None else None
        except ValueError:
            return v

    differ = [k for k in keys if value(old.get(k)) != value(new.get(k))]
    return ", ".join(f"{k}={old.get(k, '(not set)')} there, {new.get(k, '(not set)')} in this "
                     "job" for k in differ) or None


def swept(record: Path) -> Optional[List[str]]:
    """The keys a sweep's multirun.yaml sweeps, on its command line (`key=a,b`,
    `key=range(...)`) or in its config (`hydra.sweeper.params`, an experiment's sweep), as its
    jobs' overrides name them; None where it cannot be read, or names none (then its jobs'
    records tell: a sweep of the config's params alone compared its jobs on nothing, and a
    relaunch of another one continued job 0's run under its own lr)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        hydra = OmegaConf.load(record).hydra
        typed = list(hydra.overrides.task)
        parsed = OverridesParser.create().parse_overrides([str(o) for o in typed])
        params = OmegaConf.select(hydra, "sweeper.params")
        params = list(params) if isinstance(params, DictConfig) else []
    except Exception:  # noqa: BLE001  (no record kept, or not one Hydra wrote)
        return None
    keys = [o.get_key_element() for o in parsed if o.is_sweep_override()]
    keys += [str(k) for k in params if str(k) not in keys]
    return keys or None

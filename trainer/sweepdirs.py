"""A sweep's job dirs checked before a job writes into one: jobs of one launch that would share
a dir, a resume of one checkpoint in every job of a sweep of what its state keeps, and a job dir
that holds another sweep's job (trainer/rundir.py:check_fresh_start calls them)."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Optional

from omegaconf import OmegaConf

from trainer import sweep
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError


def _in_sweep() -> bool:
    """Whether this is a job of a Hydra sweep (-m)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return False
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


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
    if not _in_sweep():
        return
    from hydra.core.hydra_config import HydraConfig

    h = HydraConfig.get()
    raw = OmegaConf.to_container(h.sweep, resolve=False)
    subdir, num = raw.get("subdir"), h.job.num
    fix = "name the job in it: ${hydra.job.num} (the default) or ${hydra.job.override_dirname}"
    if "${" not in str(subdir) and "${" not in _STAMP.sub("", str(raw.get("dir"))) and \
            sweep.swept(Path(h.sweep.dir) / sweep.RECORD):
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
    if not _in_sweep() or resume in (None, "auto"):
        return
    if Path(run_dir).resolve() in Path(resume).resolve().parents:
        return  # (the job's own checkpoint: its run, rolled back)
    from hydra.core.hydra_config import HydraConfig

    from trainer.resumechanges import IMPLEMENTATION_KEYS

    keys = [k.lstrip("+") for k in sweep.swept(Path(HydraConfig.get().sweep.dir) / sweep.RECORD)
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
    if not _in_sweep():
        return
    from hydra.core.hydra_config import HydraConfig

    h = HydraConfig.get()
    differ = sweep.other_sweeps_job(run_dir, Path(h.sweep.dir), list(h.overrides.task))
    if differ:
        raise AnotherSweep(f"hydra.sweep.dir={h.sweep.dir}: job dir {run_dir} holds a run of "
                           f"another sweep's job ({differ}): launch this sweep in a new "
                           "hydra.sweep.dir, or continue that one with its own values; "
                           "nothing was changed")

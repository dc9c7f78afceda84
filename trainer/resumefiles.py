"""Which checkpoint a run resumes from (`find_resume`: null, auto or a path), what a resume
from an earlier step of the run's own leaves behind (`abandoned`, `set_aside`), and the command
that resumes a run (`resume_args`, `sweep_resume_args`: the launch's own overrides, quoted).

The files themselves (atomic writes, checked loads, retention) are trainer/checkpoint.py's.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from trainer.checkpoint import (BEST, CHECKPOINT_DIR, LAST, NOT_REGULAR, STEP_FILE,
                                CheckpointError, load, nearby, resumable, step_files)
from trainer.overrides import override_key


def candidates(run_dir: Path) -> List[Path]:
    """This run's checkpoints, newest first: last.pt, then step-*.pt by step."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    steps = step_files(folder)[::-1]
    last = folder / LAST
    return ([last] if last.is_file() else []) + steps


def in_run_dir(path: Path, run_dir: Path) -> bool:
    """Whether `path` is one of `run_dir`'s own checkpoints (not another run's state)."""
    return Path(path).resolve().parent == (Path(run_dir) / CHECKPOINT_DIR).resolve()


def _step_of(path: Path, steps: List[Path]) -> float:
    """The step a checkpoint holds: from its name (step-NNNNNNNN.pt), the step file it is a
    link of, or the file; a file that does not load counts as the newest."""
    match = STEP_FILE.fullmatch(path.name)
    if match:
        return int(match.group(1))
    for other in steps:
        if os.path.samefile(path, other):
            return _step_of(other, [])
    try:
        return int(torch.load(path, map_location="cpu", mmap=True, weights_only=True)["step"])
    except Exception:  # noqa: BLE001  (damaged: resume=auto would skip it anyway)
        return float("inf")


def abandoned(run_dir: Path, resumed: Path, step: int) -> List[Path]:
    """What a resume from one of the run dir's own checkpoints, at `step`, leaves behind: the
    states saved after it (step files, and last.pt and best.pt where they hold one), which
    belong to the timeline it rolls back."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    steps = step_files(folder)
    later = [p for p in steps if _step_of(p, []) > step]
    if not later:
        return []
    links = [folder / name for name in (LAST, BEST) if (folder / name).is_file()
             and not os.path.samefile(folder / name, resumed)]
    return later + [p for p in links if _step_of(p, steps) > step]


SET_ASIDE = "abandoned-after-step-"  # + the step rolled back to (+ "-N" for a later one)
_SET_ASIDE = re.compile(re.escape(SET_ASIDE) + r"(\d+)(?:-\d+)?")


def set_aside_step(path: Path, run_dir: Path) -> Optional[int]:
    """The step whose roll-back set `path` aside, where it is in one of `run_dir`'s folders
    of set-aside states (see `set_aside`); None for any other path."""
    folder = Path(path).resolve().parent
    match = _SET_ASIDE.fullmatch(folder.name)
    if match is None or folder.parent != (Path(run_dir) / CHECKPOINT_DIR).resolve():
        return None
    return int(match.group(1))


def set_aside(paths: List[Path], step: int) -> Optional[Path]:
    """Moves `paths` (see `abandoned`) into `checkpoints/abandoned-after-step-NNNNNNNN/`, out of
    the way of `trainer.resume=auto` and `keep_last` (which would have kept them, the newest
    by name, over the new timeline's), and returns that folder; nothing is deleted."""
    if not paths:
        return None
    base = paths[0].parent / f"{SET_ASIDE}{step:08d}"
    folder, n = base, 1
    while folder.exists():
        n += 1
        folder = base.with_name(f"{base.name}-{n}")
    folder.mkdir()
    for path in paths:
        os.replace(path, folder / path.name)
    return folder


def find_resume(resume: Optional[str], run_dir: Path
                ) -> Optional[Tuple[Path, Dict[str, Any], List[str]]]:
    """The checkpoint to resume from, loaded, with the reasons newer ones were skipped:
    null -> none; 'auto' -> the newest one in this run dir that loads (a damaged one is
    skipped for the previous one; no checkpoint at all is a fresh start, but checkpoints none
    of which loads are refused, files untouched); anything else -> that file, which must load.
    """
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        if not str(resume).strip():  # (Path("") is the working directory)
            raise CheckpointError("trainer.resume='': is empty (give a path to a .pt file, "
                                  "auto, or null)")
        if not path.is_file():
            what = ("a directory, not a checkpoint file" if path.is_dir() else
                    NOT_REGULAR if path.exists() else
                    "no such checkpoint file")
            run = path.parent if path.name == CHECKPOINT_DIR and path.is_dir() else path
            if (run / CHECKPOINT_DIR).is_dir():  # a run dir (or its checkpoints/): what
                # continuing it takes
                raise CheckpointError(
                    f"trainer.resume={resume}: {what}; to continue the run in it: "
                    f"trainer.resume=auto hydra.run.dir={run}, or start a new run from one "
                    f"of its checkpoints: trainer.resume={run / CHECKPOINT_DIR / LAST}")
            raise CheckpointError(f"trainer.resume={resume}: {what} (give a path to a .pt "
                                  f"file, auto, or null){nearby(path)}")
        return path, resumable(load(path), path), []
    found, skipped, failed = candidates(run_dir), [], []
    for path in found:
        same = next((i for i, other in enumerate(failed) if os.path.samefile(path, other)), None)
        if same is not None:  # last.pt is a link of the newest step file: said once
            skipped[same] += f" (so is {path.name}, the same file)"
            continue
        try:
            return path, resumable(load(path), path), skipped
        except CheckpointError as e:
            skipped.append(str(e))
            failed.append(path)
    if found:
        raise CheckpointError(
            f"trainer.resume=auto: none of the {len(found)} checkpoints in "
            f"{Path(run_dir) / CHECKPOINT_DIR} loads ({skipped[0]}); nothing was changed: "
            "move them away to start over, or resume from a copy by path")
    return None


def resume_args(run_dir: Path) -> str:
    """The overrides that resume the run in `run_dir`, quoted for a shell: the launch's own
    (the same model, data and settings; its config dirs and config name; its Hydra settings but
    the run and sweep dirs, mode, launcher and sweeper) with `trainer.resume=auto
    hydra.run.dir=<run dir>` (the default run dir is a new one per launch: trainer.resume=auto
    alone would start afresh elsewhere)."""
    args = ([*_launch_args(), "trainer.resume=auto", f"hydra.run.dir={_hydra_quoted(run_dir)}"]
            if _launched() else _composed_overrides(run_dir))
    return " ".join(shlex.quote(a) for a in args)


def resume_said(run_dir: Path) -> str:
    """How to resume the run in `run_dir`, for its last line: the command, where it can be
    told, and its arguments; from Python, the overrides to add to the config it was composed
    from."""
    if not _launched():
        return ("the config this run was composed from and the overrides "
                f"{_composed_overrides(run_dir)}")
    command = launch_command()
    if command is None:  # (several nodes, SLURM: flags this process cannot see)
        return f"this launch's command and the arguments {resume_args(run_dir)}"
    return f"{command} {resume_args(run_dir)}"


def launch_command(environ=os.environ) -> Optional[str]:
    """The command that started this run, before its arguments, where this process can tell
    it: `python train.py`, or `torchrun --standalone --nproc_per_node=N train.py` for a
    torchrun launch on one node (a pasted resume line lacked it under torchrun); None for a
    launch on several nodes or by SLURM, whose other flags it cannot see."""
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else None
    if script is None:
        return None
    from trainer.distributed import detect

    env, script = detect(environ), shlex.quote(script)
    if env.launcher == "none":
        return f"{_on_path('python', environ)} {script}"
    if env.launcher != "torchrun" or env.local_world_size != env.world_size:
        return None
    return (f"{_on_path('torchrun', environ)} --standalone "
            f"--nproc_per_node={env.world_size} {script}")


def _on_path(name: str, environ) -> str:
    """`python` or `torchrun` as a shell finds it where that is this interpreter's (an
    activated environment), else by its path beside this interpreter (a bare `python` was
    one without torch where the run was started as `.venv/bin/python train.py`), else, for
    torchrun, this interpreter running its module."""
    here = os.path.dirname(sys.executable)

    def ours(path: str) -> bool:  # (beside this interpreter; a python, this one: a
        return os.path.dirname(os.path.abspath(path)) == here and (  # /usr/bin/python
            name != "python" or os.path.realpath(path) == os.path.realpath(sys.executable))

    found = shutil.which(name, path=environ.get("PATH", ""))  # beside python3 may be another)
    if found is not None and ours(found):
        return name
    beside = os.path.join(here, name)
    if name == "python":
        return shlex.quote(beside if os.path.exists(beside) and ours(beside) else
                           sys.executable)
    return shlex.quote(beside) if os.path.exists(beside) else \
        f"{shlex.quote(sys.executable)} -m torch.distributed.run"


def _launched() -> bool:
    """Whether this run was launched through Hydra (train.py), not composed in Python."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized()


def _composed_overrides(run_dir: Path) -> List[str]:
    """What resumes a run composed in Python: its config, with these (no Hydra run dir)."""
    return ["trainer.resume=auto", f"run_dir={_hydra_quoted(run_dir)}"]


def sweep_resume_args() -> Optional[str]:
    """In a sweep (`-m`), the arguments that continue the whole sweep, quoted for a shell:
    the launch's own as typed with `trainer.resume=auto hydra.sweep.dir=<sweep dir>` (its
    finished jobs are kept as they are, the stopped one resumes, the rest run); None outside
    a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    args = [a for a in sys.argv[1:]
            if override_key(a) not in ("trainer.resume", "hydra.sweep.dir")]
    args += ["trainer.resume=auto", f"hydra.sweep.dir={_hydra_quoted(HydraConfig.get().sweep.dir)}"]
    return " ".join(shlex.quote(a) for a in args)


# Hydra overrides of where and how a launch ran, not of what it trains: a resume names its own
_NOT_CARRIED = ("hydra.mode", "hydra.run.", "hydra.sweep.", "hydra.launcher.", "hydra.sweeper.",
                "hydra/launcher", "hydra/sweeper", "hydra.job.num", "hydra.job.id")
_PLAIN = re.compile(r"[\w/.\-+:@%]+")


def config_flags(hydra: Any) -> List[str]:
    """The flags that say where a launch's config came from, as its `hydra` node records
    them (a running job's `HydraConfig`, or a run's `.hydra/hydra.yaml`): `--config-name`
    other than train.py's own, `--config-dir`, and `--config-path` other than conf/."""
    name = hydra.job.config_name
    args = [] if name in (None, "train") else ["--config-name", str(name)]
    for source in hydra.runtime.config_sources:
        if source.schema == "file" and source.provider == "command-line":
            args += ["--config-dir", str(source.path)]
        elif source.schema == "file" and source.provider == "main" and \
                Path(source.path).resolve() != (Path(__file__).parents[1] / "conf").resolve():
            args += ["--config-path", str(source.path)]
    return args


def _launch_args() -> List[str]:
    from hydra.core.hydra_config import HydraConfig

    h = HydraConfig.get()  # (launched: a config composed in Python has its own overrides)
    args = config_flags(h)
    args += [a for a in h.overrides.hydra if not override_key(a).startswith(_NOT_CARRIED)]
    return args + [a for a in h.overrides.task
                   if override_key(a) != "trainer.resume"]


def _hydra_quoted(value: Any) -> str:
    """`value` as a Hydra override reads it back: quoted where it holds `=`, `,`, spaces,
    brackets or quotes (a sweep's `optim.lr=0.1,seed=1` job dir)."""
    text = str(value)
    if _PLAIN.fullmatch(text):
        return text
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)  # a quote, escaped
    return "'" + re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text) + "'"  # a final backslash

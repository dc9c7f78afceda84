"""The launch's run dir: `outputs/<stamp>`, a name every rank of a job computes alike without
talking (the torchrun agent's start time, the rendezvous id, SLURM's job id), claimed
atomically by a plain process, and removed at exit when the launch wrote nothing into it."""
from __future__ import annotations

import atexit
import os
import re
import time
from pathlib import Path
from typing import Dict, List, Mapping, Tuple

from trainer.distributed import attempt


def process_ticks(pid: int) -> int:
    """When process `pid` started, in clock ticks after boot (Linux /proc: a clock that the
    wall clock's steps leave alone); raises OSError elsewhere."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[19])  # field 22, starttime


def process_start(pid: int) -> float:
    """Wall-clock start time of process `pid` (Linux /proc); raises OSError elsewhere."""
    ticks = process_ticks(pid)
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


_claimed: Dict[Tuple[str, str], str] = {}  # (parent, stamp) -> the run dir named for it
_made: List[str] = []  # the run dirs this process made, absolute (removed at exit if empty)


def claim_run_dir(parent: str, environ: Mapping[str, str] = os.environ) -> str:
    """`parent/<run_stamp>`, the default run (or sweep) dir. A plain process makes it here,
    atomically, and takes `<stamp>-1`, `-2`... where another launch made it in the same
    second: launches from one script never share a dir. The ranks of a torchrun or SLURM job
    must name one dir alike without talking, so theirs is the job's stamp as it is (two jobs
    started in the same second share it, and the second is refused as in use). The dirs the
    launch made (rank 0's, as far as it can tell) are removed at exit if nothing was written
    into them: a refused launch, `--cfg hydra --resolve`. Hydra may resolve the key more
    than once: the same stamp gives the same dir."""
    stamp, shared = _stamp(environ, "%Y-%m-%d/%H-%M-%S")
    if (parent, stamp) in _claimed:
        return _claimed[(parent, stamp)]
    base = os.path.join(parent, stamp)
    missing = [d for d in Path(base).parents if not d.is_dir()]  # innermost first
    if shared:  # (a peer rank's Hydra may have made them first: the day's folder, outputs/)
        missing = [d for d in Path(base).parents if d == Path(parent)
                   or Path(parent) in d.parents or d in missing]
    # a shared stamp's dir that is there already: a peer rank's Hydra made it (this attempt's,
    # whichever rank came first), or, in a restarted job, its first attempt (with its log)
    earlier = shared and os.path.isdir(base) and attempt(environ) > 0
    path, ours = (base, True) if shared else _claim(base)
    if ours and environ.get("RANK", environ.get("SLURM_PROCID", "0")) == "0":
        atexit.register(_remove_empty, [os.path.abspath(d) for d in [path, *missing]])
        if not earlier:
            _made.append(os.path.abspath(path))
    _claimed[(parent, stamp)] = path
    return path


def _claim(base: str, tries: int = 1000) -> Tuple[str, bool]:
    """`base`, or `base-N`, made here by this process alone (mkdir fails where one exists),
    and True; `base` and False where none could be made."""
    try:
        os.makedirs(os.path.dirname(base), exist_ok=True)
    except OSError:
        return base, False  # unwritable, a file in the way: Hydra's making of it says so
    for n in range(tries):
        path = f"{base}-{n}" if n else base
        try:
            os.mkdir(path)
            return path, True
        except FileExistsError:
            continue
        except OSError:
            break
    return base, False  # (every name taken: the run dir lock then refuses in one line)


def made_here(path: str) -> bool:
    """Whether `path` is a run dir this process made (a dated one it claimed), which its exit
    removes when nothing is left in it."""
    return os.path.abspath(path) in _made


def is_launch_stamp(path: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether `path` is (or is inside) the dated dir this launch's config named for itself
    (hydra.run.dir or hydra.sweep.dir left at its default) and no other attempt of its job
    names too, so never one to resume. Attempts share a stamp where it is their job's id (a
    SLURM job's, which its requeues keep; a rendezvous id), or its torchrun agent's start
    (its --max-restarts restarts)."""
    name, shared = _stamp(environ, "%Y-%m-%d/%H-%M-%S")
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip()
    if attempt(environ) > 0 or shared and (name.startswith(("slurm-", "rdzv-")) or (
            restarts.isdigit() and int(restarts) > 0)):
        return False
    path = os.path.abspath(path)
    return any(path == d or path.startswith(d + os.sep)
               for d in (os.path.abspath(v) for v in _claimed.values()))


def nothing_launched(records: Tuple[str, ...] = ("multirun.yaml",)) -> None:
    """A sweep refused before its first job (hydra/launcher=slurm without SLURM): Hydra's
    record of it goes from the dirs this process made, where nothing else is, so that the
    exit removes them as it removes any dir a refused launch made."""
    for path in _made:
        try:
            names = os.listdir(path)
            if names and set(names) <= set(records):
                for name in names:
                    os.remove(os.path.join(path, name))
        except OSError:
            continue


def _remove_empty(folders: List[str]) -> None:
    """Removes each of `folders` (innermost first) that is empty; one that is gone is skipped,
    one that holds anything ends it (its parents hold it)."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            continue
        except OSError:
            return


def run_stamp(environ: Mapping[str, str] = os.environ, fmt: str = "%Y-%m-%d/%H-%M-%S") -> str:
    """A name for this run's directory that every rank of the job computes alike.

    Ranks start a moment apart, so each one's own clock could split the run dir. Under
    torchrun on one node the stamp is the start time of the torchrun agent (every rank's
    parent, which also survives --max-restarts, so a restarted job finds its checkpoints);
    across nodes it is the rendezvous id (`--rdzv-id`); under SLURM the job id.
    """
    return _stamp(environ, fmt)[0]


def _stamp(environ: Mapping[str, str], fmt: str) -> Tuple[str, bool]:
    """run_stamp, and whether the ranks of a job share it."""
    if "TORCHELASTIC_RUN_ID" in environ and "RANK" in environ:
        run_id = environ["TORCHELASTIC_RUN_ID"]
        if _count(environ, "GROUP_WORLD_SIZE") > 1 and run_id not in ("", "none"):
            return f"rdzv-{run_id}", True
        try:
            return time.strftime(fmt, time.localtime(process_start(os.getppid()))), True
        except (OSError, ValueError, IndexError, StopIteration):  # no /proc: each rank's clock
            return time.strftime(fmt), True
    elif "SLURM_JOB_ID" in environ and _count(environ, "SLURM_NTASKS") > 1:
        return f"slurm-{environ['SLURM_JOB_ID']}", True
    return time.strftime(fmt), False


def _count(environ: Mapping[str, str], key: str) -> int:
    """A launcher's count, 1 where it is missing or not a number (which the run then refuses
    in one line, launchvars.check_launch: the stamp must not fail before it can)."""
    raw = environ.get(key, "1").strip()
    return int(raw) if re.fullmatch(r"[0-9]+", raw) else 1

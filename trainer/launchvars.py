"""The launcher's variables checked before they are read (trainer.distributed.detect): a
torchrun or SLURM job whose variables cannot describe a job is one line naming the variable,
not a traceback from the process group's start."""
from __future__ import annotations

import os
import re
from typing import List, Mapping


class LaunchError(ValueError):
    """A launcher's variables that cannot describe a job (a rank past the world size, a count
    that is not a number): one line naming the variable, exit code 2."""


# (variable, lowest value) of each launcher, and the (rank, world size) pair among them
_LAUNCH_VARS = {"torchrun": ([("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0),
                              ("LOCAL_WORLD_SIZE", 1)], ("RANK", "WORLD_SIZE")),
                "slurm": ([("SLURM_PROCID", 0), ("SLURM_NTASKS", 1), ("SLURM_LOCALID", 0),
                           ("SLURM_JOB_ID", 0), ("MASTER_PORT", 1)],
                          ("SLURM_PROCID", "SLURM_NTASKS"))}


def check_launch(environ: Mapping[str, str] = os.environ, meeting: bool = True) -> None:
    """LaunchError for launcher variables `detect` would read that cannot describe a job: a
    value that is not a whole number, or below its least, or a rank at or past the world
    size (a job script that sets them by hand, or an srun outside its allocation); with
    `meeting`, also a torchrun-style job without the address its ranks meet at, and a port
    that is no port (the process group's start raised them, a 68-line traceback)."""
    launcher = ("torchrun" if "RANK" in environ and "WORLD_SIZE" in environ else
                "slurm" if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ else None)
    if launcher is None:
        _check_half_set(environ)
        return
    names, (rank, world) = _LAUNCH_VARS[launcher]
    for name, low in names:
        raw = environ.get(name)
        if raw is None:
            continue
        if not re.fullmatch(r"[0-9]+", raw.strip()) or int(raw) < low:  # (ASCII: not "²")
            raise LaunchError(f"{name}={raw}: must be a whole number >= {low} ({launcher} sets "
                              "it; a job script that sets it by hand?)")
    if int(environ[rank]) >= int(environ[world]):
        raise LaunchError(f"{rank}={environ[rank]}: must be below {world}={environ[world]} "
                          "(the job's ranks are 0 to one less than its size)")
    if launcher == "slurm":
        tasks_on_this_node(environ)  # (its own one line: `4,3`, `abc` raised int()'s error)
    if meeting:
        _check_meeting_point(environ, launcher, environ[rank], environ[world])


def _check_half_set(environ: Mapping[str, str]) -> None:
    """RANK or WORLD_SIZE set alone, to a value that means a job of several processes
    (RANK=1, WORLD_SIZE=2): the process trained alone as rank 0 of 1, writing as rank 0."""
    for name, other, alone in (("RANK", "WORLD_SIZE", "0"), ("WORLD_SIZE", "RANK", "1")):
        value = environ.get(name)
        if value is not None and other not in environ and value.strip() != alone:
            raise LaunchError(f"{name}={value} is set but {other} is not: a job's processes "
                              "get both (and MASTER_ADDR, MASTER_PORT) from torchrun; launch "
                              f"with torchrun, or unset {name} to run one process")


_TASKS_PER_NODE = re.compile(r"[0-9]+(\(x[0-9]+\))?(,[0-9]+(\(x[0-9]+\))?)*")


def tasks_on_this_node(environ: Mapping[str, str]) -> int:
    """SLURM_NTASKS_PER_NODE's count for this node (SLURM_NODEID's entry): SLURM writes `4`,
    `4(x2)` (two nodes of 4) or `4,3` (nodes of 4 and 3 tasks); LaunchError for anything
    else."""
    raw = environ.get("SLURM_NTASKS_PER_NODE", "1").strip()
    if not _TASKS_PER_NODE.fullmatch(raw):
        raise LaunchError(f"SLURM_NTASKS_PER_NODE={raw}: must be tasks per node as SLURM "
                          "writes them (4, 4(x2), 4,3); a job script that sets it by hand?")
    counts: List[int] = []
    for part in raw.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * int(times.rstrip(")") or 1)
    node = environ.get("SLURM_NODEID", "0").strip()
    return counts[int(node)] if node.isdigit() and int(node) < len(counts) else counts[0]


def _check_meeting_point(environ: Mapping[str, str], launcher: str, rank: str,
                         world: str) -> None:
    if int(world) == 1:
        return  # (one process meets no one)
    if launcher == "torchrun":  # (SLURM's has defaults)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not environ.get(name, "").strip():
                raise LaunchError(
                    f"RANK={rank} and WORLD_SIZE={world} are set but {name} "
                    "is not: the job's processes meet at MASTER_ADDR:MASTER_PORT (torchrun "
                    "sets all four; launch with torchrun, or unset RANK and WORLD_SIZE to run "
                    "one process)")
    port = environ.get("MASTER_PORT", "").strip()
    if port and (not re.fullmatch(r"[0-9]+", port) or not 1 <= int(port) <= 65535):
        raise LaunchError(f"MASTER_PORT={environ['MASTER_PORT']}: must be a port number, 1 to "
                          "65535")

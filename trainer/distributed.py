"""Who am I: rank, world and device from the launcher's environment; process-group lifetime.

    python train.py                                   # one process, no process group
    torchrun --standalone --nproc_per_node=4 train.py # RANK/WORLD_SIZE/LOCAL_RANK set by torchrun
    srun python train.py                              # SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID

NCCL is the backend on CUDA devices, gloo on CPU, so every multi-process path runs (and is
tested) on a CPU-only machine.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, as the launcher described it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "none"  # "torchrun" | "slurm" | "none"
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def launched(self) -> bool:
        return self.launcher != "none"


def _slurm_master(environ: Mapping[str, str]) -> str:
    """First host of the SLURM node list ("node[01-04],gpu7" -> "node01")."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    first = nodelist.split(",")[0].strip() if nodelist else ""
    if "[" in first:
        prefix, rest = first.split("[", 1)
        first = prefix + rest.rstrip("]").split(",")[0].split("-")[0]
    return first or "127.0.0.1"


def detect(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Reads torchrun's variables, else SLURM's (`srun python train.py`), else one process."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return DistEnv(rank=int(environ["RANK"]), local_rank=int(environ.get("LOCAL_RANK", 0)),
                       world_size=int(environ["WORLD_SIZE"]),
                       local_world_size=int(environ.get("LOCAL_WORLD_SIZE", 1)),
                       launcher="torchrun")
    if "SLURM_PROCID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        job = int(environ.get("SLURM_JOB_ID", "0"))
        return DistEnv(rank=int(environ["SLURM_PROCID"]),
                       local_rank=int(environ.get("SLURM_LOCALID", 0)),
                       world_size=int(environ["SLURM_NTASKS"]),
                       local_world_size=int(environ.get("SLURM_NTASKS_PER_NODE", "1")
                                            .split("(")[0]),
                       launcher="slurm",
                       master_addr=environ.get("MASTER_ADDR") or _slurm_master(environ),
                       # a port derived from the job id keeps concurrent jobs on a node apart
                       master_port=int(environ.get("MASTER_PORT", 15000 + job % 20000)))
    return DistEnv()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device, timeout_s: float) -> Iterator[None]:
    """Initialises the default process group for a multi-process job; destroys it on any exit.

    A single process gets no group, so collectives below become no-ops through `is_active`.
    """
    if env.world_size <= 1:
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {}
    if env.launcher == "slurm":
        kwargs["init_method"] = f"tcp://{env.master_addr}:{env.master_port}"
    dist.init_process_group(backend=backend_for(device), rank=env.rank,
                            world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


def is_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_active() else 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sums a tensor across ranks in place (no-op in a single process) and returns it."""
    if is_active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if is_active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def barrier() -> None:
    if is_active():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s Python object on every rank (identity in a single process)."""
    if not is_active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def warn(env: DistEnv, msg: str, *args) -> None:
    """Warnings are the one thing every rank may say; non-zero ranks prefix their rank."""
    prefix = "" if env.is_main else f"[rank {env.rank}] "
    log.warning(prefix + msg, *args)

"""Who am I: rank, world and device from the launcher's environment; process-group lifetime.

    python train.py                                   # one process, no process group
    torchrun --standalone --nproc_per_node=4 train.py # RANK/WORLD_SIZE/LOCAL_RANK set by torchrun
    srun python train.py                              # SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID

NCCL is the backend on CUDA devices, gloo on CPU, so every multi-process path runs (and is
tested) on a CPU-only machine.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from trainer.launchvars import LaunchError, check_launch, tasks_on_this_node

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


class JoinFailed(RuntimeError):
    """The job's ranks did not all join its process group in time: one line, exit code 1."""


def detect(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """Reads torchrun's variables, else SLURM's (`srun python train.py`), else one process;
    variables `check_launch` refuses read as one process, so that the refusal can be said."""
    try:
        check_launch(environ, meeting=False)
    except LaunchError:
        return DistEnv()
    return _detect(environ)


def _detect(environ: Mapping[str, str]) -> DistEnv:
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
                       local_world_size=tasks_on_this_node(environ),
                       launcher="slurm",
                       master_addr=environ.get("MASTER_ADDR") or _slurm_master(environ),
                       # a port derived from the job id keeps concurrent jobs on a node apart
                       master_port=int(environ.get("MASTER_PORT", 15000 + job % 20000)))
    return DistEnv()


PR_SET_PDEATHSIG = 1  # <sys/prctl.h>


def end_with_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """Under torchrun, asks Linux to send this rank SIGTERM when torchrun's agent dies
    (killed with SIGKILL, out of memory): the rank then saves and stops as for a preemption
    (exit 75), instead of training on under init, since torchrun starts each rank in a
    session of its own that signals to torchrun's process group miss. True when armed."""
    if "TORCHELASTIC_RUN_ID" not in environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no prctl: nothing armed, as on other systems
        return False
    if os.getppid() == 1:  # the agent died before the call: the signal it would have sent
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def bound_to_task() -> bool:
    """Whether srun bound this task to CPUs of its own (`--cpus-per-task` with task binding):
    its affinity is then its share already, not the node's that its ranks share (torchrun's
    ranks all inherit the launcher's)."""
    return detect().launcher == "slurm" and _affinity() < (os.cpu_count() or _affinity())


def cpus_per_rank(local_world_size: int) -> int:
    """This process's CPUs shared among the ranks on the node (at least 1); under srun's
    binding of each task to its own CPUs, those (divided again, 4 tasks of 8 CPUs each
    counted 2)."""
    if bound_to_task():
        return max(1, _affinity())
    return max(1, _affinity() // max(1, local_world_size))


def auto_num_workers(local_world_size: int) -> int:
    """Loader workers per rank for `data.num_workers=auto`: this process's CPUs shared among
    the ranks on the node, at least 1 and at most 16."""
    return min(16, cpus_per_rank(local_world_size))


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device, timeout_s: float,
                  ddp: bool = False) -> Iterator[None]:
    """Joins the default process group for a multi-process job, or for `ddp` in a launched
    job of one process (`torchrun --nproc_per_node=1 train.py trainer.strategy=ddp`: DDP's
    wrapper and collectives with a world of one); a no-op otherwise.

    The group lives as long as the process: the jobs of a Hydra sweep (`-m`) run one after
    another in the same processes and reuse it, since re-creating a group on torchrun's
    store deadlocks on the previous group's keys. It is destroyed at exit, or at once when
    the job raises, so a failing rank never leaves a live group behind.
    """
    backend = backend_for(device)
    if is_active() and dist.get_backend() != backend:  # an earlier job of a sweep joined it
        raise RuntimeError(f"this process already joined a {dist.get_backend()} group; "
                           f"a sweep cannot switch to {backend} between jobs")
    if env.world_size <= 1 and not ddp:
        yield
        return
    if not is_active():
        _init(env, device, backend, timeout_s)
    try:
        yield
    except BaseException:
        _destroy(failed=True)
        raise


# NCCL's collectives wait this much longer than gloo's: a rank left waiting for a stuck peer
# then fails first in the host-side gloo check of its step, whose error names the peer
# (trainer/liveness.py), instead of NCCL's watchdog aborting the process with no such line.
NCCL_GRACE_S = 60.0
_TIMEOUT: Optional[datetime.timedelta] = None  # trainer.ddp.timeout_s of the joined group


def attempt(environ=os.environ) -> int:
    """Which attempt of its job this process belongs to: 0, then one more per restart
    (torchrun's --max-restarts, SLURM's requeue)."""
    for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = environ.get(key, "")
        if value.isdigit():
            return int(value)
    return 0


def agent_store(env: DistEnv) -> bool:
    """Whether the job's store is torchrun's agent's (shared with the workers, outliving every
    rank), not one a rank hosts (SLURM's: rank 0's process)."""
    return env.launcher != "slurm" and \
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def attempt_store(timeout: datetime.timedelta, world_size: Optional[int] = None) -> Any:
    """A client of torchrun's agent store (MASTER_ADDR:MASTER_PORT) under this attempt's
    prefix: the process group's store, and the ranks' records outside the group
    (trainer/liveness.py)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"stoker/attempt-{attempt()}", store)


def _init(env: DistEnv, device: torch.device, backend: str, timeout_s: float) -> None:
    global _TIMEOUT
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = _TIMEOUT = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if env.launcher == "slurm":
        kwargs["init_method"] = f"tcp://{env.master_addr}:{env.master_port}"
    if backend == "nccl":
        timeout += datetime.timedelta(seconds=NCCL_GRACE_S)
    try:  # (the store's failure too is said as the group's)
        # torchrun shares its rendezvous store with the workers and keeps it across
        # --max-restarts; the group's keys from the previous attempt would then hand the new
        # ranks stale peer addresses (pytorch/pytorch#135712). A prefix per attempt avoids it.
        if agent_store(env):
            kwargs["store"] = attempt_store(timeout, env.world_size)
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, **kwargs)
    except dist.DistError as e:  # a peer that never came, an address nobody listens on
        where = (f"{env.master_addr}:{env.master_port}" if env.launcher == "slurm" else
                 f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
        from trainer.config import first_line  # (trainer.config imports this module)
        reason = first_line(e)[:200]
        if "address already in use" in str(e).lower():  # (rank 0's port: at once, no wait)
            raise JoinFailed(f"rank {env.rank} of {env.world_size} could not open the job's "
                             f"meeting point {where}: another process on this machine uses "
                             "that port (address already in use); choose a free MASTER_PORT "
                             "(or torchrun --master-port, or --standalone)") from None
        raise JoinFailed(f"rank {env.rank} of {env.world_size} could not join the job's "
                         f"process group at {where} within trainer.ddp.timeout_s="
                         f"{timeout_s:g} s ({type(e).__name__}: {reason}); did every rank "
                         "start, with the same MASTER_ADDR and MASTER_PORT?") from None
    atexit.register(_destroy)


def _destroy(failed: bool = False) -> None:
    """Leaves the process group. A failing rank's NCCL work may wait for a peer that never
    joins it, and destroying an NCCL group first lets its queued work finish (a hang until
    the watchdog kills the process, before the rank's error is said): a failing rank aborts
    an NCCL group instead, which ends that work at once."""
    global _CPU_GROUP, _WRITE_GROUP
    _CPU_GROUP = _WRITE_GROUP = None
    if not is_active():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.5
    if failed and abort is not None and dist.get_backend() == "nccl":
        try:
            abort()
            return
        except Exception as e:  # (a private call: if it changed, destroy as before)
            log.debug("aborting the NCCL group failed (%s); destroying it", e)
    dist.destroy_process_group()
    # what still refers to the group from a reference cycle (gloo's pending work and its
    # tensors) is freed now, while the interpreter lives: freed in its finalization, gloo's
    # threads aborted the process ('terminate called without an active exception', SIGABRT)
    # in about 1 run in 3 of ranks refused at start-up
    gc.collect()


# how many collectives this process's threads wait in now (the heartbeat publishes it: a rank
# stuck in its own code, a dataset read that never returns, is told from peers waiting for it)
WAITING = [0]


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Marks a block where this rank waits for its peers (a collective)."""
    WAITING[0] += 1
    try:
        yield
    finally:
        WAITING[0] -= 1


def is_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_active() else 1


def rank() -> int:
    return dist.get_rank() if is_active() else 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sums a tensor across ranks in place (no-op in a single process) and returns it."""
    if is_active():
        with waiting():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum over ranks, in place (no-op in a single process)."""
    if is_active():
        with waiting():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def spread(values: List[float], device: torch.device) -> Tuple[List[float], List[float]]:
    """(smallest, largest) of each value over the ranks, in one all-reduce (of the values and
    their negatives): where they differ, the ranks disagree."""
    both = torch.tensor([*values, *(-v for v in values)], dtype=torch.float64, device=device)
    high, low = all_reduce_max(both).view(2, -1).tolist()
    return [-v for v in low], high


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    if is_active():
        with waiting():
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Copies rank 0's buffers (e.g. BatchNorm running stats) to every rank.

    DDP broadcasts buffers at the start of each training forward, and that forward then
    updates them locally, so after training the ranks' buffers differ slightly: evaluation
    and checkpoints use rank 0's.
    """
    if is_active():
        for buf in module.buffers():
            dist.broadcast(buf, src=0)


def broadcast_weights(module: torch.nn.Module) -> None:
    """Copies rank 0's parameters and buffers to every rank: weights each rank loaded after
    DDP's own broadcast at its start (trainer.init_from), where a file rewritten between the
    ranks' reads would leave them training different models."""
    if is_active():
        with torch.no_grad():
            for param in module.parameters():
                dist.broadcast(param, src=0)
        broadcast_buffers(module)


_CPU_GROUP = None


def cpu_group():
    """A gloo group over all ranks for host-side agreement (the default group when it is
    gloo already): created once, by every rank at the same point, with the job's
    `trainer.ddp.timeout_s` (torch's own default for a new group is 30 minutes)."""
    global _CPU_GROUP
    if _CPU_GROUP is None:
        _CPU_GROUP = (dist.group.WORLD if dist.get_backend() == "gloo"
                      else dist.new_group(backend="gloo", timeout=_TIMEOUT))
    return _CPU_GROUP


_WRITE_GROUP: Optional[Tuple[float, Any]] = None  # (its timeout, the group)


def write_group(timeout_s: Optional[float] = None):
    """The gloo group the ranks wait in for rank 0's checkpoint write (liveness.writer_barrier):
    created with `timeout_s` (trainer.checkpoint.timeout_s), by every rank at the same point
    (the checkpointing's construction), and again where a later job of a sweep, in the same
    process group, gives another; the host-side group until then. A rank other than 0 in a
    monitored barrier waits for rank 0 as long as its group's timeout says (the barrier's own
    is rank 0's alone): on the host-side group that was trainer.ddp.timeout_s, and a write
    longer than it failed the job as a lost peer."""
    global _WRITE_GROUP
    if timeout_s is not None and is_active() and (
            _WRITE_GROUP is None or _WRITE_GROUP[0] != timeout_s):
        _WRITE_GROUP = (timeout_s, dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
    return _WRITE_GROUP[1] if _WRITE_GROUP is not None else cpu_group()


def barrier() -> None:
    if is_active():
        with waiting():
            dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s Python object on every rank (identity in a single process)."""
    if not is_active():
        return obj
    box = [obj]
    with waiting():
        dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's Python object, in rank order ([obj] in a single process)."""
    if not is_active():
        return [obj]
    box = [None] * dist.get_world_size()
    with waiting():
        dist.all_gather_object(box, obj)
    return box


def warn(env: DistEnv, msg: str, *args) -> None:
    """Warnings are the one thing every rank may say; non-zero ranks prefix their rank."""
    prefix = "" if env.is_main else f"[rank {env.rank}] "
    log.warning(prefix + msg, *args)

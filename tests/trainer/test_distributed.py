"""Rank/world detection from torchrun and SLURM environments (faked), no-op collectives, and
the process group of a one-process DDP job."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import ROOT, summary_of, torchrun
from trainer import distributed
from trainer.distributed import detect
from trainer.launchvars import check_launch


def test_plain_process_is_rank_0_of_1():
    env = detect({})
    assert (env.rank, env.world_size, env.launcher, env.is_main) == (0, 1, "none", True)


def test_torchrun_variables():
    env = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 8, 1, 2)
    assert env.launcher == "torchrun" and env.launched and not env.is_main


def test_slurm_variables_when_torchrun_is_absent():
    env = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                  "SLURM_NTASKS_PER_NODE": "4(x2)", "SLURM_JOB_ID": "4242",
                  "SLURM_JOB_NODELIST": "gpu[07-08],cpu1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.launcher == "slurm" and env.master_addr == "gpu07"
    assert env.master_port == 15000 + 4242
    # nodes of 4 and 3 tasks, and of 2, 2 and 5: this node's count (SLURM_NODEID)
    for per_node, node, local in (("4,3", "1", 3), ("2(x2),5", "2", 5), ("4,3", None, 4)):
        uneven = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_NTASKS_PER_NODE": per_node,
                  **({"SLURM_NODEID": node} if node else {})}
        check_launch(uneven, meeting=False)
        assert detect(uneven).local_world_size == local, per_node


def test_torchrun_wins_over_slurm_and_single_task_slurm_is_one_process():
    both = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}
    assert detect(both).launcher == "torchrun"
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).launcher == "none"


def test_collectives_are_identity_without_a_group():
    t = torch.tensor([1.0, 2.0])
    assert torch.equal(distributed.all_reduce_sum(t.clone()), t)
    assert distributed.world_size() == 1 and distributed.broadcast_object(5) == 5


@pytest.mark.slow
def test_ddp_in_a_torchrun_job_of_one_process_joins_a_group_of_one(tmp_path):
    """`torchrun --nproc_per_node=1 train.py trainer.strategy=ddp`: the DDP wrapper needs a
    process group even for a world of one (one GPU running NCCL, or gloo here)."""
    proc = torchrun(1, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.strategy=ddp",
                        "trainer.max_epochs=1"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "strategy ddp" in proc.stdout and "world size 1" in proc.stdout
    assert summary_of(tmp_path / "run")["strategy"] == "ddp"


def test_nccl_waits_longer_than_the_host_side_gloo_group_which_keeps_the_jobs_timeout(
        monkeypatch):
    """Under NCCL the host-side checks run on a gloo group of their own: it gets
    trainer.ddp.timeout_s (torch's default for a new group is 30 minutes), and NCCL a grace
    on top, so the gloo check that names a stuck peer fails first. No NCCL here: the calls
    into torch.distributed are recorded instead of made."""
    calls = {}
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(distributed.dist, "new_group",
                        lambda **kw: calls.setdefault("new_group", kw))
    monkeypatch.setattr(distributed.dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(distributed, "_CPU_GROUP", None)
    monkeypatch.setattr(distributed, "_TIMEOUT", None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    distributed._init(detect({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}),
                      torch.device("cuda", 0), "nccl", timeout_s=42)
    assert calls["init"]["backend"] == "nccl"
    assert calls["init"]["timeout"].total_seconds() == 42 + distributed.NCCL_GRACE_S
    distributed.cpu_group()
    assert calls["new_group"]["backend"] == "gloo"
    assert calls["new_group"]["timeout"].total_seconds() == 42


@pytest.mark.parametrize("backend,failed,call", [
    ("nccl", True, "abort"), ("nccl", False, "destroy"), ("gloo", True, "destroy")])
def test_a_failing_rank_aborts_an_nccl_group_rather_than_flushing_it(monkeypatch, backend,
                                                                    failed, call):
    """Destroying an NCCL group lets its queued collectives finish first, which never happens
    when a peer is gone: a failing rank aborts it (recorded calls, no NCCL here)."""
    calls = []
    monkeypatch.setattr(distributed, "is_active", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda *a: backend)
    monkeypatch.setattr(distributed.dist.distributed_c10d, "_abort_process_group",
                        lambda: calls.append("abort"))
    monkeypatch.setattr(distributed.dist, "destroy_process_group",
                        lambda: calls.append("destroy"))
    distributed._destroy(failed=failed)
    assert calls == [call]


def test_a_rank_whose_peers_never_join_says_so_in_one_line(make_cfg, monkeypatch, tmp_path):
    """The first of two SLURM tasks, alone: torch's DistStoreError with C++ frames before."""
    from tests.helpers import free_port
    from trainer.runner import train

    for key, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7",
                       "SLURM_JOB_NODELIST": "localhost", "MASTER_PORT": str(free_port())
                       }.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(distributed.JoinFailed, match=r"^rank 0 of 2 could not join the job's "
                                                     r"process group at localhost:\d+ within "
                                                     r"trainer.ddp.timeout_s=3 s \(Dist"):
        train(make_cfg("trainer.ddp.timeout_s=3", run_dir=tmp_path / "run"))
    assert not distributed.is_active()


def test_a_task_srun_bound_to_its_own_cpus_counts_them_as_its_share(monkeypatch):
    """srun --cpus-per-task=8, 4 tasks a node: each task's affinity is its 8 CPUs, which were
    divided again by the 4 ranks (2 each: data.num_workers=auto gave 2, and the workers
    warning named `the node's 8`); torchrun's ranks share the launcher's CPUs."""
    import os

    from trainer import distributed

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert distributed.bound_to_task() and distributed.cpus_per_rank(4) == 8
    for key in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert not distributed.bound_to_task() and distributed.cpus_per_rank(4) == 2


def test_rank_0_whose_port_is_taken_says_so_not_that_its_peers_never_came(tmp_path):
    """EADDRINUSE fails at once, yet the line asked whether every rank had started."""
    import socket

    from tests.helpers import run_cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", "trainer.ddp.timeout_s=15"],
                       env_extra={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                       timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"stoker: error: rank 0 of 2 could not open the job's meeting point 127.0.0.1:{port}: "
        "another process on this machine uses that port (address already in use); choose a "
        "free MASTER_PORT (or torchrun --master-port, or --standalone)")

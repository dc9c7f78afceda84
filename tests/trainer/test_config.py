"""The typed schema rejects bad keys and types at compose time; the values it derives."""
from __future__ import annotations

import pytest
import torch
from hydra.errors import ConfigCompositionException

from trainer.checks import resolve
from trainer.config import ConfigError, Precision, RunSpec, Strategy


@pytest.mark.parametrize("override,key", [
    ("data.num_worker=8", "data.num_worker"),
    ("trainer.precision=fp8", "trainer.precision"),
    ("trainer.strategy=fsdp", "trainer.strategy"),
    ("trainer.max_epochs=1.5", "trainer.max_epochs"),
    ("sed=1", "sed"),
])
def test_schema_rejects_at_compose_time(make_cfg, override, key):
    with pytest.raises(ConfigCompositionException) as info:
        make_cfg(override)
    cause = info.value.__cause__
    assert getattr(cause, "full_key", None) == key


def test_async_checkpoints_auto_is_async_on_cuda_and_for_large_states_on_cpu():
    import torch

    from trainer.config import ASYNC_MIN_CPU_BYTES, CheckpointConfig, async_checkpoints

    auto, cpu, cuda = CheckpointConfig(), torch.device("cpu"), torch.device("cuda", 0)
    assert async_checkpoints(auto, cuda, 1000)
    assert not async_checkpoints(auto, cpu, 1000)
    assert async_checkpoints(auto, cpu, ASYNC_MIN_CPU_BYTES + 1)
    assert not async_checkpoints(CheckpointConfig(async_save=False), cuda, 1000)
    assert async_checkpoints(CheckpointConfig(async_save=True), cpu, 1000)


def test_values_from_interpolations_arrive_as_strings_and_are_accepted(make_cfg):
    from trainer.config import CheckpointConfig, async_checkpoints, cpu_workers

    cfg = make_cfg("data.num_workers=${oc.env:STOKER_TEST_WORKERS,3}",
                   "trainer.checkpoint.async_save=${oc.env:STOKER_TEST_ASYNC,false}")
    resolve(cfg)
    assert cpu_workers(cfg.data, 1) == 3
    assert async_checkpoints(CheckpointConfig(async_save="false"), __import__("torch").device(
        "cuda", 0), 0) is False
    with pytest.raises(ConfigError, match="trainer.checkpoint.async_save=1: must be auto"):
        resolve(make_cfg("trainer.checkpoint.async_save=1"))


def test_a_runs_gpus_are_the_ranks_own_or_all_of_data_parallels(monkeypatch):
    """Whose random states a checkpoint keeps and whose peak memory a run reports."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    def gpus(strategy, device):
        return RunSpec(device=device, strategy=strategy, precision=Precision.fp32,
                       world_size=1, global_batch=1).gpus

    cuda1 = torch.device("cuda", 1)
    assert gpus(Strategy.ddp, cuda1) == gpus(Strategy.single, cuda1) == [cuda1]
    assert gpus(Strategy.dp, torch.device("cuda", 0)) == [
        torch.device("cuda", i) for i in range(4)]
    assert gpus(Strategy.single, torch.device("cpu")) == []


def test_the_rank_prefix_reads_torchruns_rank_or_slurms(monkeypatch):
    """srun's rank 1 said its warnings with no prefix (RANK alone was read)."""
    from trainer.config import rank_prefix

    for name in ("RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert rank_prefix() == ""
    monkeypatch.setenv("SLURM_PROCID", "1")
    assert rank_prefix() == ""  # (one task: no job of several)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    assert rank_prefix() == "[rank 1] "
    monkeypatch.setenv("RANK", "0")  # torchrun's wins
    assert rank_prefix() == ""

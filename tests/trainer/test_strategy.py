"""DDP wrapping in real gloo processes: accumulation skips the all-reduce, replicas agree."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from tests.helpers import free_port
from trainer.config import DDPConfig, Strategy
from trainer.strategy import unwrap, wrap


def _ddp_worker(rank: int, world: int, port: int, out: str, steps: int, accumulate: int):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import trainer.runner as runner
    from tests.helpers import compose_cfg

    calls, wrapped = [], []
    real_wrap = runner.wrap

    def counting_wrap(*args, **kwargs):
        model = real_wrap(*args, **kwargs)
        model.register_comm_hook(None, lambda _, bucket: (calls.append(1),
                                                          allreduce_hook(None, bucket))[1])
        wrapped.append(model)
        return model

    runner.wrap = counting_wrap
    cfg = compose_cfg(os.path.join(out, "run"), "data.batch_size=8",
                      f"trainer.accumulate_grad_batches={accumulate}",
                      f"trainer.max_steps={steps}", "trainer.log_every_n_steps=100",
                      "trainer.ddp.bucket_cap_mb=2", "trainer.ddp.find_unused_parameters=true")
    summary = runner.train(cfg)
    ddp = wrapped[0]
    torch.save({"calls": len(calls), "steps": summary["steps"],
                "knobs": (ddp.bucket_bytes_cap, ddp.find_unused_parameters,
                          ddp.gradient_as_bucket_view),
                "params": unwrap(wrapped[0]).state_dict()}, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_ddp_all_reduces_once_per_optimizer_step_and_replicas_agree(tmp_path):
    steps, accumulate = 5, 4
    mp.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path), steps, accumulate), nprocs=2)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for res in results:
        assert res["knobs"] == (2 * 1024 * 1024, True, True)  # trainer.ddp.* reached DDP
        assert res["steps"] == steps
        # the MLP's gradients fit in one bucket: one all-reduce per optimizer step, not one
        # per micro-batch (which would be steps * accumulate = 20)
        assert res["calls"] == steps
    for k, v in results[0]["params"].items():
        assert torch.equal(v, results[1]["params"][k]), f"{k} differs between ranks"


def test_unwrap_and_single_wrap():
    model = nn.Linear(2, 2)
    wrapped = wrap(model, Strategy.single, torch.device("cpu"), DDPConfig())
    assert unwrap(wrapped) is model and unwrap(nn.DataParallel(model)) is model


@pytest.mark.gpu
def test_data_parallel_wraps_on_cuda():
    wrapped = wrap(nn.Linear(2, 2), Strategy.dp, torch.device("cuda", 0), DDPConfig())
    assert isinstance(wrapped, nn.DataParallel)
    assert wrapped(torch.randn(4, 2, device="cuda")).shape == (4, 2)


def test_ranks_that_build_different_models_are_one_line_not_ddps_traceback(tmp_path):
    """DDP compares the ranks' parameters as it wraps the model; the rank that finds them
    different says why in one line, through rank 0's report of losing it."""
    from tests.helpers import ROOT, torchrun

    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress_bar=false",
                        "data.num_workers=0", "trainer.ddp.timeout_s=60",
                        "model._target_=tests.helpers.RankShapedMLP"], cwd=ROOT, timeout=150)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert lines and all("model: the ranks built different models (" in ln and
                         "build the same model on every rank" in ln for ln in lines), \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("stoker: error:")[0]  # (torchrun's own follows)

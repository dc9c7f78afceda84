"""Autocast per precision, GradScaler only for fp16, clipping after unscaling."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config import Precision
from trainer.precision import MixedPrecision
from trainer.runner import train

CPU = torch.device("cpu")


def test_fp32_has_no_autocast_and_no_scaler():
    mp = MixedPrecision(Precision.fp32, CPU)
    assert mp.scaler is None
    with mp.autocast():
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


def test_bf16_autocasts_matmuls_on_cpu():
    mp = MixedPrecision(Precision.bf16, CPU)
    assert mp.scaler is None
    with mp.autocast():
        assert nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.bfloat16


def test_step_clips_and_reports_the_pre_clip_norm():
    model = nn.Linear(3, 1, bias=False)
    model.weight.grad = torch.tensor([[3.0, 4.0, 0.0]])  # norm 5
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    norm = MixedPrecision(Precision.fp32, CPU).step(opt, model.parameters(), 1.0, False)
    assert float(norm) == pytest.approx(5.0)
    assert model.weight.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert MixedPrecision(Precision.fp32, CPU).step(opt, model.parameters(), None, False) is None


@pytest.mark.gpu
def test_fp16_scaler_unscales_before_clipping():
    """The scaled gradient (65536x) is unscaled before the norm is taken and clipped: the
    reported norm and the clipped gradient are in the loss's own units."""
    dev = torch.device("cuda")
    model = nn.Linear(3, 1, bias=False).to(dev)
    mp = MixedPrecision(Precision.fp16, dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with mp.autocast():  # a small loss: the scaled gradient stays finite in fp16 (max 65504)
        loss = model(torch.tensor([[3.0, 4.0, 0.0]], device=dev)).float().sum() * 1e-3
    mp.backward(loss)
    assert model.weight.grad.norm().item() > 100  # scaled by 65536: about 328
    norm = mp.step(opt, model.parameters(), 1e-3, True)
    assert float(norm) == pytest.approx(5e-3, rel=1e-2)  # 1e-3 * |(3, 4, 0)|
    assert model.weight.grad.norm().item() == pytest.approx(1e-3, rel=1e-2)
    assert mp.state_dict()["scale"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("job", [[], ["experiment=digits_cnn", "trainer.max_epochs=8"]],
                         ids=["default", "digits_cnn"])
def test_bf16_and_fp16_reach_fp32_accuracy_on_cuda(make_cfg, tmp_path, job):
    """The default job and the CNN job, same seed, in each precision: the mixed-precision runs
    end within 1.5 points (5 of 359 validation digits) of fp32's validation accuracy."""
    runs = {p: train(make_cfg("trainer.accelerator=cuda", *job, f"trainer.precision={p}",
                              "trainer.save_checkpoint=false", "trainer.tensorboard=false",
                              run_dir=tmp_path / p))
            for p in ("fp32", "bf16", "fp16")}
    assert {p: r["precision"] for p, r in runs.items()} == {p: p for p in runs}
    acc = {p: r["val_acc"] for p, r in runs.items()}
    assert acc["fp32"] > 0.9, acc
    assert acc["bf16"] >= acc["fp32"] - 0.015 and acc["fp16"] >= acc["fp32"] - 0.015, acc

"""Autocast per precision, GradScaler only for fp16, clipping after unscaling."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config import Precision
from trainer.precision import MixedPrecision

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
    dev = torch.device("cuda")
    model = nn.Linear(3, 1, bias=False).to(dev)
    mp = MixedPrecision(Precision.fp16, dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with mp.autocast():
        loss = model(torch.tensor([[3.0, 4.0, 0.0]], device=dev)).sum()
    mp.backward(loss)  # scaled gradient: huge
    norm = mp.step(opt, model.parameters(), 1.0, True)
    assert float(norm) == pytest.approx(5.0, rel=1e-2)
    assert mp.state_dict()["scale"] > 0

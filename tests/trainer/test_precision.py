"""Autocast per precision, GradScaler only for fp16, clipping after unscaling."""
from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from trainer.config import Precision
from trainer.precision import MixedPrecision, optimizer_choice
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


class MyAdamW(torch.optim.AdamW):
    pass


CUDA_DEVICE = torch.device("cuda", 0)  # a device object: nothing runs on it


@pytest.mark.parametrize("factory, precision, device, want", [
    (functools.partial(torch.optim.AdamW, lr=1e-3, fused=None, foreach=None), Precision.fp16,
     CUDA_DEVICE, {"fused": True}),
    (functools.partial(torch.optim.AdamW, differentiable=True), Precision.fp16, CUDA_DEVICE,
     {}),  # which fused refuses
    # fused SGD keeps a skipped first step's uninitialised momentum (test_config)
    (functools.partial(torch.optim.SGD, fused=None, foreach=None), Precision.fp16, CUDA_DEVICE,
     {}),
    (functools.partial(torch.optim.Adam), Precision.fp16, CUDA_DEVICE, {"fused": True}),
    # the user's choice stands
    (functools.partial(torch.optim.AdamW, fused=False), Precision.fp16, CUDA_DEVICE, {}),
    (functools.partial(torch.optim.AdamW, foreach=True), Precision.fp16, CUDA_DEVICE, {}),
    (functools.partial(torch.optim.AdamW, foreach=False), Precision.fp16, CUDA_DEVICE, {}),
    # no scaler, or no fused CUDA step that takes the scaler's flag: nothing added
    (functools.partial(torch.optim.AdamW), Precision.bf16, CUDA_DEVICE, {}),
    (functools.partial(torch.optim.AdamW), Precision.fp32, CUDA_DEVICE, {}),
    (functools.partial(torch.optim.AdamW), Precision.fp16, torch.device("cpu"), {}),
    (functools.partial(torch.optim.Adagrad), Precision.fp16, CUDA_DEVICE, {}),
    (functools.partial(MyAdamW), Precision.fp16, CUDA_DEVICE, {}),
])
def test_fp16_on_cuda_fuses_torchs_optimizers_when_the_config_leaves_it_open(
        factory, precision, device, want):
    assert optimizer_choice(factory, precision, device) == want
    floats = [torch.zeros(2), torch.zeros(3, dtype=torch.float16)]
    assert optimizer_choice(factory, precision, device, floats) == want
    # a parameter the fused step cannot take (complex, integer): PyTorch's choice stands
    assert optimizer_choice(factory, precision, device, [*floats, torch.zeros(2).cfloat()]) == {}


@pytest.mark.gpu
def test_fp16_run_on_cuda_steps_a_fused_optimizer_and_skips_on_inf(make_cfg, tmp_path):
    """The default job in fp16 on CUDA builds a fused AdamW; a step whose gradients overflow
    is skipped by the fused kernel itself (the weights stay, the scaler lowers its scale)."""
    from trainer.loop import Callback

    seen = {}

    class Look(Callback):
        def after_step(self, loop) -> None:
            if loop.state.step == 1:
                seen["fused"] = loop.optimizer.param_groups[0]["fused"]
                seen["supports"] = getattr(loop.optimizer, "_step_supports_amp_scaling", False)

    summary = train(make_cfg("trainer.accelerator=cuda", "trainer.precision=fp16",
                             "trainer.max_steps=4", "trainer.save_checkpoint=false",
                             run_dir=tmp_path / "run"), callbacks=[Look()])
    assert seen == {"fused": True, "supports": True} and summary["steps"] == 4
    dev = torch.device("cuda")
    model = nn.Linear(3, 1).to(dev)
    mp = MixedPrecision(Precision.fp16, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    before = [p.detach().clone() for p in model.parameters()]
    mp.backward(model(torch.full((1, 3), float("inf"), device=dev)).sum())
    mp.step(opt, model.parameters(), None, False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert int(mp.skipped_steps) == 1

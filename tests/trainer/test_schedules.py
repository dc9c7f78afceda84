from __future__ import annotations

import pytest
import torch

from trainer import schedules


def lrs(sched, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_cosine_shape():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    seq = lrs(schedules.warmup_cosine(opt, total_steps=12, warmup_steps=2), opt, 13)
    assert seq[:2] == pytest.approx([0.5, 1.0])
    assert seq[2] == pytest.approx(1.0) and seq[-1] == pytest.approx(0.0)
    assert all(a >= b for a, b in zip(seq[2:], seq[3:]))


def test_build_passes_total_steps_only_when_accepted():
    from functools import partial

    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    s = schedules.build(partial(schedules.warmup_cosine, warmup_steps=0), opt, 10)
    assert isinstance(s, torch.optim.lr_scheduler.LambdaLR)
    s = schedules.build(partial(torch.optim.lr_scheduler.StepLR, step_size=3), opt, 10)
    assert isinstance(s, torch.optim.lr_scheduler.StepLR)

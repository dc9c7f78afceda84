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


def test_constant_steps_like_lambda_lr_and_takes_its_warmup_from_the_config_on_resume():
    from trainer.schedules import constant

    def after_steps(sched, opt, n):
        out = []
        for _ in range(n):
            opt.step()
            sched.step()
            out.append(opt.param_groups[0]["lr"])
        return out

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    assert after_steps(constant(opt, 10, warmup_steps=4), opt, 6) == [0.5, 0.75, 1.0, 1.0, 1.0, 1.0]
    saved = constant(opt, 10, warmup_steps=0)
    after_steps(saved, opt, 3)
    assert "warmup_steps" not in saved.state_dict()
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    resumed = constant(opt2, 10, warmup_steps=10)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.warmup_steps == 10 and resumed.last_epoch == 3
    assert after_steps(resumed, opt2, 1) == [0.5]  # step 4 of a 10-step warmup: the new config's shape

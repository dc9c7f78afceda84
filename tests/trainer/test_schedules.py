from __future__ import annotations

import math

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


def test_move_to_puts_a_schedule_of_the_step_at_another_step_with_its_lr():
    """A LambdaLR (the warmup_cosine) and a torch schedule with a formula of the step take
    the lr they have at the new step, and step on from there; one chained step to step
    (MultiplicativeLR) cannot be moved and is left as it was. Only a schedule `build` gave
    the run's step count spans the run."""
    def fresh():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)

    opt = fresh()
    cosine = schedules.build(lambda o, total_steps: schedules.warmup_cosine(o, total_steps),
                             opt, 10)
    assert schedules.spans_the_run(cosine)
    assert schedules.move_to(cosine, 5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    ref_opt = fresh()
    ref = schedules.warmup_cosine(ref_opt, 10)
    lrs(ref, ref_opt, 5)
    assert lrs(cosine, opt, 5) == pytest.approx(lrs(ref, ref_opt, 5))
    step_opt = fresh()
    step = schedules.build(lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.1),
                           step_opt, 10)
    assert not schedules.spans_the_run(step)  # (its step_size is a count of one's own)
    assert schedules.move_to(step, 7) and step_opt.param_groups[0]["lr"] == pytest.approx(0.01)
    chained_opt = fresh()
    chained = torch.optim.lr_scheduler.MultiplicativeLR(chained_opt, lambda s: 0.5)
    lrs(chained, chained_opt, 2)
    assert not schedules.move_to(chained, 7)
    assert chained.last_epoch == 2 and chained_opt.param_groups[0]["lr"] == 0.25

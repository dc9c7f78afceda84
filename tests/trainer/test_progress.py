"""trainer/progress.py: an epoch's micro-batches grouped into optimizer steps, and the run's
optimizer steps with the warnings for settings that do not fit them."""
from __future__ import annotations

from trainer.progress import window_plan


def test_window_plan_groups_micro_batches_into_optimizer_steps():
    # 50 samples, batch 16 -> 16, 16, 16, 2; accumulation 3 -> windows [16,16,16] and [2]
    assert window_plan(50, 16, drop_last=False, limit=None, accumulate=3) == [3, 1]
    assert window_plan(40, 16, drop_last=False, limit=None, accumulate=2) == [2, 1]
    assert window_plan(40, 16, drop_last=True, limit=None, accumulate=2) == [2]
    assert window_plan(1000, 16, drop_last=False, limit=3, accumulate=2) == [2, 1]


def test_total_steps_says_a_warmup_as_long_as_the_run(make_cfg):
    from torch.utils.data import DataLoader

    from trainer.progress import total_steps

    loader = DataLoader(list(range(230)), batch_size=10)  # 23 steps an epoch
    total, said = total_steps(make_cfg("trainer.max_epochs=2", "sched.warmup_steps=100"),
                              loader, None)
    assert total == 46 and said == [
        "sched.warmup_steps=100 is not fewer than the run's 46 optimizer steps: the lr rises "
        "for the whole run (its last step's is 46% of optim.lr) and never decays"]
    assert total_steps(make_cfg("trainer.max_epochs=2", "sched.warmup_steps=45"), loader,
                       None) == (46, [])
    assert total_steps(make_cfg("trainer.max_steps=1", "trainer.fast_dev_run=true"), loader,
                       None) == (1, [])  # (its one step checks the run, not its schedule)
    assert total_steps(make_cfg("sched=step", "trainer.max_steps=5"), loader, None) == (5, [])


def test_steps_left_counts_the_current_epochs_rest_and_the_epochs_after_it():
    """230 samples over 2 ranks at batch 10: 12 batches a rank an epoch, 6 steps with
    accumulation 2. From 80 global samples into epoch 1 (4 global batches in: 8 batches in
    4 windows left) of a 4-epoch run, 4 + 2 x 6 steps; max_steps cuts that where it comes
    first; the sampler keeps its own start (the loop sets it when the epoch begins)."""
    from torch.utils.data import DataLoader

    from data.sampler import ResumableDistributedSampler
    from trainer.progress import FitState, steps_left

    sampler = ResumableDistributedSampler(230, num_replicas=2, rank=0)
    loader = DataLoader(list(range(230)), batch_size=10, sampler=sampler)
    state = FitState(epoch=1, step=8, position=80)
    assert steps_left(loader, None, 2, state, max_epochs=4, max_steps=-1) == 4 + 2 * 6
    assert steps_left(loader, None, 2, state, max_epochs=4, max_steps=20) == 12
    assert steps_left(loader, None, 2, state, max_epochs=-1, max_steps=20) == 12
    assert steps_left(loader, None, 2, FitState(epoch=2, step=12), max_epochs=4,
                      max_steps=-1) == 12
    assert sampler.start == 0
    plain = DataLoader(list(range(230)), batch_size=10)  # a sampler that cannot start mid-epoch
    assert steps_left(plain, None, 1, state, max_epochs=4, max_steps=-1) is None
    assert steps_left(plain, None, 1, FitState(epoch=2, step=46), 4, -1) == 46


def test_a_share_is_rounded_down_without_a_float_error():
    from trainer.progress import batches_of

    assert batches_of(0.3, range(10), "k", "epoch") == 3  # (0.3 * 10 = 2.9999999999999996)
    assert batches_of(0.999, range(10), "k", "epoch") == 9
    assert batches_of(7, range(10), "k", "epoch") == 7 and batches_of(None, None, "k", "x") is None
    assert batches_of(0.0, None, "k", "split") == 0  # (no validation: no split to count)

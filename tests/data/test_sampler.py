"""The resumable sampler: torch's DistributedSampler order, and exact mid-epoch starts."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from data.sampler import ResumableDistributedSampler as RDS


@pytest.mark.parametrize("n,world,drop_last", [(10, 3, False), (10, 3, True), (16, 2, False),
                                               (2, 4, False)])
def test_same_order_as_torch_distributed_sampler(n, world, drop_last):
    for rank in range(world):
        ours = RDS(n, world, rank, seed=5, drop_last=drop_last)
        theirs = DistributedSampler(range(n), world, rank, seed=5, drop_last=drop_last)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("drop_last", [False, True])
def test_start_skips_exactly_the_consumed_positions(drop_last):
    n, world, batch, done = 23, 2, 3, 2  # 2 batches of 3 on each of 2 ranks: 12 positions
    full = [RDS(n, world, r, seed=1, drop_last=drop_last) for r in range(world)]
    rest = [RDS(n, world, r, seed=1, drop_last=drop_last) for r in range(world)]
    for s in rest:
        s.set_start(done * batch * world)
    for f, s in zip(full, rest):
        assert list(s) == list(f)[done * batch:] and len(s) == len(list(s))


def test_other_world_size_continues_with_the_unseen_samples():
    n = 20
    two = [list(RDS(n, 2, r, seed=0)) for r in range(2)]
    seen = {i for shard in two for i in shard[:3]}  # 3 batches of 1 on each of 2 ranks
    one = RDS(n, 1, 0, seed=0)
    one.set_start(6)
    assert set(one) == set(range(n)) - seen and len(one) == 14


def test_set_epoch_resets_the_start():
    s = RDS(8, 1, 0, seed=0)
    s.set_start(4)
    assert len(s) == 4
    s.set_epoch(1)
    assert len(s) == 8 and sorted(s) == list(range(8))
    assert list(RDS(8, 1, 0, shuffle=False)) == list(range(8))
    torch.manual_seed(0)  # the sampler never draws from the global generator
    before = torch.rand(1)
    torch.manual_seed(0)
    list(RDS(8, 1, 0, seed=3))
    assert torch.equal(torch.rand(1), before)


def test_epoch_batches_and_what_a_limit_leaves_after_a_resume():
    from data.sampler import epoch_batches, limit_left

    assert epoch_batches(50, 16, drop_last=False) == 4
    assert epoch_batches(50, 16, drop_last=True) == 3
    assert epoch_batches(48, 16, drop_last=False) == 3 and epoch_batches(0, 16, False) == 0
    assert epoch_batches(50, 16, drop_last=False, limit=2) == 2
    assert limit_left(None, 64, 32) is None
    assert limit_left(3, 64, 32) == 1 and limit_left(3, 160, 32) == 0

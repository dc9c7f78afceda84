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


@pytest.mark.parametrize("n,world,batch", [(203, 2, 8), (17, 2, 8), (10, 4, 2), (1437, 2, 16),
                                           (23, 3, 4), (9, 2, 1), (5, 4, 3), (2, 4, 8)])
def test_a_training_epoch_counts_each_sample_once_where_a_rank_can_leave_its_repeat_out(
        n, world, batch):
    """Padding repeats samples to give every rank as many; given the batch size, a rank whose
    last batch keeps a sample of its own without its repeat leaves it out. Every rank still
    takes as many batches (the collectives meet), mid-epoch starts too, and the ranks'
    batches together are the epoch's samples once each, but for the repeats that were a
    rank's whole last batch (`repeats_left`)."""
    from data.sampler import repeats_left

    for done in (0, 1, 2):  # batches already taken on every rank: a resume part-way
        shards = []
        for rank in range(world):
            s = RDS(n, world, rank, seed=4, batch_size=batch)
            s.set_epoch(1)
            s.set_start(done * batch * world)
            shards.append(list(s))
            assert len(s) == len(shards[-1])
        counts = {-(-len(shard) // batch) for shard in shards}
        assert len(counts) == 1, (n, world, batch, done, [len(x) for x in shards])
        order = RDS(n, 1, 0, seed=4)
        order.set_epoch(1)
        taken = sorted(i for shard in shards for i in shard)
        start = done * batch * world
        if start < n:  # (a repeat is one of the epoch's first samples, taken again)
            assert set(list(order)[start:]) <= set(taken)
            assert len(taken) == n - start + repeats_left(n, world, batch)
    assert repeats_left(n, world, batch, drop_last=True) == repeats_left(n, 1, batch) == 0
    padded = [list(RDS(n, world, r, seed=4)) for r in range(world)]  # no batch size: torch's
    assert sum(map(len, padded)) == -(-n // world) * world

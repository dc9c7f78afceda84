"""How a shard stream's epoch is cut: rank ranges, worker blocks, the DataLoader's turn order.
Reading the shards in that order: tests/data/test_shards.py."""
from __future__ import annotations

from data.shardplan import ShardPlan, turn_order, worker_blocks


def test_worker_blocks_and_turns_follow_the_dataloader():
    assert worker_blocks(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert turn_order(worker_blocks(5, 2)) == [(0, 0), (1, 3), (0, 1), (1, 4), (0, 2)]


def test_validation_covers_every_sample_once_and_training_gives_every_rank_as_many():
    n, world = 103, 4
    val = [ShardPlan(n, world, r, train=False, shuffle=False, drop_last=False, seed=0,
                     batch_size=8).rank_range() for r in range(world)]
    assert [p for lo, hi in val for p in range(lo, hi)] == list(range(n))
    for drop_last, per in ((False, 26), (True, 25)):  # padded up, or cut down
        plans = [ShardPlan(n, world, r, train=True, shuffle=True, drop_last=drop_last, seed=0,
                           batch_size=8) for r in range(world)]
        assert {hi - lo for lo, hi in (p.rank_range() for p in plans)} == {per}
        assert {len(p) for p in plans} == {per if not drop_last else 3 * 8}


def test_the_samples_left_after_a_resume_follow_the_turn_order():
    plan = ShardPlan(64, 2, 0, train=True, shuffle=False, drop_last=False, seed=0, batch_size=5)
    plan.workers = 2  # 32 samples: 7 batches, the last one short (2), in worker 1's block
    assert plan.blocks() == [(0, 4), (4, 7)] and len(plan) == 32
    plan.set_start(5 * 2 * 5)  # 5 batches of each rank taken: turns (0,0) (1,4) (0,1) (1,5) (0,2)
    assert plan.turns()[5:] == [(1, 6), (0, 3)] and len(plan) == 2 + 5  # (the short one left)
    plan.set_epoch(1)
    assert len(plan) == 32

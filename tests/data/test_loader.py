from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from data.loader import EvalShardSampler, build_loader
from trainer.config import DataConfig


def cfg(**kw) -> DataConfig:
    base = dict(dataset=None, input_shape=[1], num_classes=2, batch_size=4, num_workers=0)
    return DataConfig(**{**base, **kw})


def test_eval_shards_cover_every_sample_once():
    n, world = 10, 3
    seen = sorted(i for r in range(world) for i in EvalShardSampler(n, r, world))
    assert seen == list(range(n))
    assert [len(EvalShardSampler(n, r, world)) for r in range(world)] == [4, 3, 3]


def test_train_shards_are_disjoint_and_reshuffle_per_epoch():
    ds = TensorDataset(torch.arange(16))
    loaders = [build_loader(ds, cfg(), train=True, rank=r, world_size=2, seed=1) for r in (0, 1)]
    epoch0 = [torch.cat([b[0] for b in ld]).tolist() for ld in loaders]
    assert sorted(epoch0[0] + epoch0[1]) == list(range(16))
    for ld in loaders:
        ld.sampler.set_epoch(1)
    epoch1 = [torch.cat([b[0] for b in ld]).tolist() for ld in loaders]
    assert epoch1 != epoch0


def test_worker_settings_only_with_workers_and_no_pinning_on_cpu():
    ds = TensorDataset(torch.arange(8))
    ld = build_loader(ds, cfg(num_workers=0, prefetch_factor=4, persistent_workers=True),
                      train=True)
    assert ld.prefetch_factor is None and not ld.persistent_workers and not ld.pin_memory
    assert len(list(ld)) == 2
    ld = build_loader(ds, cfg(num_workers=1, prefetch_factor=3), train=False)
    assert ld.prefetch_factor == 3 and ld.persistent_workers
    assert torch.cat([b[0] for b in ld]).tolist() == list(range(8))

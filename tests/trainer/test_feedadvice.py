"""What a run says of its training feed: too many workers, and the stall advice for the feed
as it was built."""
from __future__ import annotations

import numpy as np
import torch


class BusyPairs(torch.utils.data.Dataset):
    """(input, target) pairs that take 1 ms of CPU each to make: a decode, in the small."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        from data.datasets import burn_cpu

        burn_cpu(1.0)
        return torch.zeros(3), 0


def test_the_advice_for_a_cpu_bound_image_folder_does_not_ask_for_uint8(tmp_path):
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from data.images import ImageFolder
    from data.prefetch import DevicePrefetcher
    from scripts.make_images import write_images
    from trainer import distributed
    from trainer.config import DataConfig
    from trainer.feedadvice import feed_advice

    write_images(tmp_path, count=8, size=16, classes=2, val_fraction=0.0)
    cores = distributed.cpus_per_rank(1)
    d = OmegaConf.structured(DataConfig(num_workers=cores))
    for ds, uint8 in [(ImageFolder("train", str(tmp_path), size=8), True),
                      (BusyPairs(), False)]:  # pairs, not images
        feed = DevicePrefetcher(DataLoader(ds, num_workers=cores), torch.device("cpu"))
        line = feed_advice(d, feed, torch.device("cpu"), 0.4, 1)
        assert "cannot decode faster" in line and ("ship uint8" in line) != uint8, line


def test_the_advice_offers_data_cache_only_for_samples_it_can_hold():
    from omegaconf import OmegaConf
    from torch.utils.data import DataLoader

    from data.prefetch import DevicePrefetcher
    from trainer import distributed
    from trainer.config import DataConfig
    from trainer.feedadvice import feed_advice

    class Dicts(torch.utils.data.Dataset):  # a Hugging Face-style sample
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": torch.arange(4), "labels": torch.arange(4)}

    cores = distributed.cpus_per_rank(1)
    d = OmegaConf.structured(DataConfig(num_workers=cores))
    pairs = [(torch.zeros(3), np.int64(1))] * 8  # a tensor and a numpy label: a pair
    for ds, cacheable in [(Dicts(), False), (pairs, True)]:
        feed = DevicePrefetcher(DataLoader(ds, num_workers=cores), torch.device("cpu"))
        line = feed_advice(d, feed, torch.device("cpu"), 0.4, 1)
        assert ("data.cache=memory" in line) == cacheable, line


def test_workers_past_the_ranks_share_of_cpus_name_the_share(monkeypatch):
    """Under torchrun the node's CPUs are shared by its ranks: 4 ranks of 24 workers on 16
    CPUs are past 4 per CPU of a rank's 4 (16, as 8 at least is not more)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from trainer import distributed
    from trainer.feedadvice import too_many_workers

    monkeypatch.setattr(distributed, "cpus_per_rank", lambda ranks: max(1, 16 // ranks))
    d = OmegaConf.create({"num_workers": 24})
    feed = SimpleNamespace(loader=SimpleNamespace(num_workers=24))
    assert too_many_workers(d, feed, 4) == [
        "data.num_workers=24: 24 loader workers per rank for its 4 CPUs (the node's 16 shared "
        "by 4 ranks): more than 4 per CPU (8 at least), past what even samples that wait on "
        "storage use, and each holds its copy of the dataset and batches in flight; "
        "data.num_workers=auto gives 4 (scripts/tune_loader.py measures others)"]
    assert too_many_workers(d, feed, 1) == []  # 24 for 16 CPUs: waiting samples may use them
    assert too_many_workers(d, SimpleNamespace(loader=SimpleNamespace(num_workers=0)), 4) == []

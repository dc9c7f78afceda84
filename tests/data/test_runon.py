"""data/runon.py: the training loader whose workers run on into the next epoch."""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from data.loader import build_loader
from data.runon import RunOnLoader
from data.sampler import ResumableDistributedSampler
from trainer.config import DataConfig
from tests.helpers import children_left


def run_on(n: int, batch: int, drop_last: bool = False, rank: int = 0, world: int = 1,
           dataset: Dataset | None = None, workers: int = 2) -> RunOnLoader:
    sampler = ResumableDistributedSampler(n, world, rank, seed=3, drop_last=drop_last)
    return RunOnLoader(dataset or TensorDataset(torch.arange(n)), sampler, batch, drop_last,
                       torch.Generator().manual_seed(0), num_workers=workers, prefetch_factor=2)


def plain_epoch(n, batch, drop_last, rank, world, epoch, start=0):
    sampler = ResumableDistributedSampler(n, world, rank, seed=3, drop_last=drop_last)
    sampler.set_epoch(epoch)
    sampler.set_start(start)
    return [b[0].tolist() for b in DataLoader(TensorDataset(torch.arange(n)), batch_size=batch,
                                              sampler=sampler, drop_last=drop_last)]


@pytest.mark.parametrize("n,batch,drop_last,rank,world", [
    (23, 4, False, 0, 1), (23, 4, True, 0, 1), (23, 4, False, 1, 2), (23, 5, True, 1, 3)])
def test_epochs_are_the_dataloaders_batches_from_one_iterator(n, batch, drop_last, rank, world):
    loader = run_on(n, batch, drop_last, rank, world)
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        got = [b[0].tolist() for b in loader]
        assert got == plain_epoch(n, batch, drop_last, rank, world, epoch)
        assert len(loader) == len(got)
    assert loader.restarts == 1  # the workers ran on from epoch to epoch
    loader.close()


def test_a_pass_that_does_not_start_where_the_batches_stand_starts_anew():
    loader = run_on(23, 4)
    loader.sampler.set_epoch(0)
    for i, _ in enumerate(loader):  # left after 2 batches (max_steps, limit_train_batches)
        if i == 1:
            break
    loader.sampler.set_epoch(1)
    assert [b[0].tolist() for b in loader] == plain_epoch(23, 4, False, 0, 1, 1)
    assert loader.restarts == 2
    loader.sampler.set_epoch(2)
    loader.sampler.set_start(8)  # a resume mid-epoch
    assert [b[0].tolist() for b in loader] == plain_epoch(23, 4, False, 0, 1, 2, start=8)
    assert loader.restarts == 3
    loader.sampler.set_epoch(3)
    assert [b[0].tolist() for b in loader] == plain_epoch(23, 4, False, 0, 1, 3)
    assert loader.restarts == 3
    loader.close()


def test_a_limit_takes_each_epochs_first_batches_without_restarting():
    loader = run_on(23, 4, rank=1, world=2)
    loader.limit = 2
    loader.sampler.set_epoch(0)
    assert [b[0].tolist() for b in loader] == plain_epoch(23, 4, False, 1, 2, 0)[:2]
    loader.sampler.set_epoch(1)
    loader.sampler.set_start(8)  # resumed one batch (of 4 on each of 2 ranks) in: one left
    assert [b[0].tolist() for b in loader] == plain_epoch(23, 4, False, 1, 2, 1, start=8)[:1]
    assert loader.restarts == 2
    for epoch in (2, 3):
        loader.sampler.set_epoch(epoch)
        assert [b[0].tolist() for b in loader] == plain_epoch(23, 4, False, 1, 2, epoch)[:2]
    assert loader.restarts == 2
    loader.close()


def test_epochs_without_a_batch_end_instead_of_hanging():
    loader = run_on(3, 4, drop_last=True)
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        assert list(loader) == [] and len(loader) == 0
    loader.close()


class Logged(Dataset):
    """Appends each index a worker fetches to a file (one line per index)."""

    def __init__(self, n: int, log: Path):
        self.n, self.log = n, str(log)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with open(self.log, "a") as f:
            f.write(f"{i}\n")
        return torch.tensor(i)


def fetched(log: Path) -> list:
    return [int(v) for v in log.read_text().split()] if log.exists() else []


def test_workers_make_the_next_epochs_first_batch_before_it_is_asked_for(tmp_path):
    """After an epoch's last batch, the next epoch's first batch is being made already; a
    plain DataLoader's workers wait for the next pass (what prefetch_next_epoch=false keeps)."""
    cfg = DataConfig(batch_size=4, num_workers=1, prefetch_factor=2)
    for run_on_, log in ((True, tmp_path / "run_on.log"), (False, tmp_path / "plain.log")):
        cfg.prefetch_next_epoch = run_on_
        loader = build_loader(Logged(12, log), cfg, train=True, seed=3)
        assert isinstance(loader, RunOnLoader) == run_on_
        loader.sampler.set_epoch(0)
        epoch0 = [i for b in loader for i in b.tolist()]
        first_next = ResumableDistributedSampler(12, seed=3)
        first_next.set_epoch(1)
        want = first_next.epoch_indices()[:4]
        deadline = time.monotonic() + 30
        while run_on_ and fetched(log)[12:16] != want and time.monotonic() < deadline:
            time.sleep(0.05)
        if run_on_:
            assert fetched(log)[12:16] == want
            loader.close()
        else:
            time.sleep(0.5)
            assert sorted(fetched(log)) == sorted(epoch0)  # nothing of epoch 1 yet
        del loader


def test_close_ends_the_workers():
    before = set(multiprocessing.active_children())
    loader = run_on(16, 4)
    loader.sampler.set_epoch(0)
    list(loader)
    assert len(children_left(before, timeout=0)) == 2  # its two workers
    loader.close()
    assert not children_left(before)


def test_dropping_it_ends_the_workers_without_the_garbage_collector():
    """No reference cycle keeps the workers alive after the last reference goes."""
    import gc

    gc.disable()
    try:
        before = set(multiprocessing.active_children())
        loader = run_on(16, 4)
        loader.sampler.set_epoch(0)
        list(loader)
        assert len(children_left(before, timeout=0)) == 2
        del loader
        assert not children_left(before)
    finally:
        gc.enable()


def test_build_loader_uses_it_for_training_with_persistent_workers_only():
    ds = TensorDataset(torch.arange(8))
    assert isinstance(build_loader(ds, DataConfig(num_workers=1), train=True), RunOnLoader)
    for cfg, train in ((DataConfig(num_workers=1), False), (DataConfig(num_workers=0), True),
                       (DataConfig(num_workers=1, persistent_workers=False), True),
                       (DataConfig(num_workers=1, prefetch_next_epoch=False), True)):
        assert isinstance(build_loader(ds, cfg, train=train), DataLoader)

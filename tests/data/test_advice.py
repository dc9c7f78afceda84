"""data/advice.py: the advice a run that waited for data ends with, and what it measures of a
sample (its cost in wall time, CPU time and time blocked)."""
from __future__ import annotations

import time

import pytest
import torch

from data.advice import SampleCost, count_of, sample_cost, stall_advice
from data.datasets import burn_cpu
from trainer.config import DataConfig


def cfg(**kw) -> DataConfig:
    base = dict(dataset=None, input_shape=[1], num_classes=2, batch_size=4, num_workers=0)
    return DataConfig(**{**base, **kw})


@pytest.mark.parametrize("overrides,kw,device,expected", [
    (dict(), dict(workers=0, in_memory=True), "cpu", "data.placement=device"),
    (dict(), dict(workers=2, in_memory=True), "cpu", "or data.num_workers=0"),
    (dict(), dict(workers=0, in_memory=True, placement="device"), "cpu", "raise data.batch_size"),
    (dict(), dict(workers=0, in_memory=True, placement="device", whole_set=True), "cpu",
     "the indexing itself; data.batch_size holds the whole training set already"),
    (dict(), dict(workers=2, in_memory=True, why_not_device="data.collate_fn is set"), "cpu",
     "cannot stay on the device (data.collate_fn is set): set data.num_workers=0"),
    (dict(), dict(workers=0), "cpu", "raise data.num_workers from 0 to 4 (the CPU cores this "
     "rank has; scripts/tune_loader.py with your overrides measures which is faster"),
    (dict(), dict(workers=0), "cpu", "; on a CPU the workers share the cores with the training "
     "itself, so compare whole runs too)"),
    (dict(), dict(workers=1, in_memory=True), "cpu", "(the one worker only copies them)"),
    (dict(), dict(workers=8), "cpu", "more than the 4 CPU cores this rank has"),
    (dict(persistent_workers=False), dict(workers=4), "cpu", "data.persistent_workers=true"),
    (dict(pin_memory=False), dict(workers=4), "cuda", "data.pin_memory=true"),
    (dict(device_prefetch=False), dict(workers=4), "cuda", "data.device_prefetch=true"),
    (dict(), dict(workers=4), "cpu", "data.cache=memory or shm if the decoded data fits"),
    (dict(), dict(workers=4), "cpu", "if samples are images, ship uint8"),
    (dict(), dict(workers=4, uint8_images=True), "cpu",
     "data=memmap); or store the images smaller: their shorter side at what decoding resizes "
     "them to (data.dataset.resize)"),
    (dict(dataset={"size": 32, "resize": None}), dict(workers=4, uint8_images=True), "cpu",
     "store the images smaller: their shorter side at 37 px, what decoding resizes them to "
     "(data.dataset.resize) before the crop"),
    (dict(dataset={"size": 32, "resize": 32}), dict(workers=4, uint8_images=True), "cpu",
     "their shorter side at 32 px"),
    (dict(), dict(workers=0, in_memory=True, placement="device", converted=True), "cpu",
     "the wait is their conversion to normalised floats (and augmentation), which on a CPU is "
     "compute like the step itself: neither workers nor a larger batch hide it"),
    (dict(), dict(workers=0, in_memory=True, placement="device", converted=True), "cuda",
     "the indexing itself; raise data.batch_size"),
    (dict(), dict(workers=0), "cuda", "measures which is faster, since a cheap sample can cost "
     "more to hand over from a worker than to make)"),
    (dict(cache="shm"), dict(workers=4), "cpu", "CPU-bound reading data.cache=shm: 4 workers"),
    (dict(), dict(workers=4, streamed=True), "cpu", "cannot decode the streamed shards faster"),
    (dict(), dict(workers=1, cores=1, streamed=True), "cpu", ": 1 worker on 1 core cannot"),
    (dict(), dict(workers=4, pairs=False), "cpu", "4 workers on 4 cores cannot prepare samples "
     "faster; if making a sample is cheap (indexing tensors), handing it over from a worker "
     "costs more: compare data.num_workers=0 (scripts/tune_loader.py measures both); else pay "
     "per-sample work once: compute what the dataset's __getitem__ computes"),
    (dict(cache="disk"), dict(workers=2, mapped=True, why_not_device="its arrays take 300.0 MB "
                              "> data.device_budget_mb"), "cpu",
     "read by loader workers because its arrays take 300.0 MB > data.device_budget_mb: raise "
     "data.device_budget_mb above their size"),
    (dict(), dict(workers=2, mapped=True), "cpu", "set data.placement=auto (or device)"),
    (dict(), dict(workers=4, mapped=True, why_not_device="its arrays take 900.0 MB (1800.0 MB "
                  "with an epoch's copy), more than half of the 1000 MB free on cuda:0"), "cuda",
     "CPU-bound reading memory-mapped arrays: 4 workers on 4 cores"),  # not the budget
    # what making a sample took (data.loader.sample_cost) tells waiting from computing
    (dict(), dict(workers=2, sample=SampleCost(2e-3, 3e-5, 1.9e-3)), "cpu",
     "making a sample mostly waits (1.9 ms a sample, 98% of it neither on a CPU nor queued for "
     "one: storage, a network, a lock?): workers overlap such waits without competing for the "
     "cores, so raise data.num_workers from 2 to about 4 (scripts/tune_loader.py --workers 2 4 "
     "measures; PyTorch's warning that suggests no more workers than cores is for workers that "
     "compute), or pay the wait once: data.cache=memory (or shm, disk) if the samples fit"),
    # (a loaded machine: 50 ms of the sample's 52 queued for a CPU, which is not computing)
    (dict(), dict(workers=2, sample=SampleCost(52e-3, 3e-5, 1.9e-3)), "cpu",
     "making a sample mostly waits (1.9 ms a sample, 98% of it neither on a CPU nor queued"),
    (dict(), dict(workers=32, sample=SampleCost(2e-3, 3e-5, 1.9e-3)), "cpu",  # (at the cap)
     "32 workers overlap such waits already; pay the wait once: data.cache=memory"),
    (dict(), dict(workers=0, sample=SampleCost(2e-3, 3e-5, 1.9e-3), pairs=False), "cpu",
     "raise data.num_workers from 0 to about 2 (scripts/tune_loader.py --workers 0 2 "
     "measures;"),
    (dict(), dict(workers=0, sample=SampleCost(2e-3, 3e-5, 1.9e-3), pairs=False), "cpu",
     "or pay the wait once: fetch what __getitem__ reads ahead of the run, to local storage"),
    (dict(), dict(workers=2, sample=SampleCost(2e-3, 2e-3, 0.0)), "cpu",
     "raise data.num_workers from 2 to 4 (the CPU cores"),  # computing: as before
    (dict(), dict(workers=2, sample=SampleCost(6e-6, 5e-6, 0.0), batch_size=32), "cpu",
     "making a batch costs 160 µs of CPU here, less than handing it over from a worker: "
     "data.cache=memory keeps the samples as arrays in this process (with data.placement=auto, "
     "batched by indexing on the training device), or data.num_workers=0"),
    (dict(), dict(workers=0, sample=SampleCost(6e-6, 5e-6, 0.0), batch_size=32), "cpu",
     "batched by indexing on the training device)"),
    (dict(), dict(workers=2, sample=SampleCost(6e-6, 5e-6, 0.0), batch_size=32, pairs=False),
     "cpu", "making a batch costs 160 µs of CPU here; the wait is the loader's per-sample Python "
     "work and a worker's hand-over: compare data.num_workers=0, and give the dataset a "
     "__getitems__(indices) that makes a batch's samples at once (the DataLoader calls it when "
     "it has one, and collates the list it returns; one that returns its batch made already "
     "wants data.loader.as_is as data.collate_fn)"),
    # (without workers: no hand-over to compare, and the sentence holds together)
    (dict(), dict(workers=0, sample=SampleCost(6e-6, 5e-6, 0.0), batch_size=32, pairs=False),
     "cpu", "making a batch costs 160 µs of CPU here; the wait is the loader's per-sample Python "
     "work: give the dataset a __getitems__(indices)"),
    (dict(), dict(workers=2, sample=SampleCost(2e-3, 3e-5, None), batch_size=64), "cpu",
     # (no schedstat: whether it waited is unknown)
     "raise data.num_workers from 2 to 4 (the CPU cores"),
    (dict(cache="memory"), dict(workers=4, sample=SampleCost(2e-3, 3e-5, 1.9e-3)), "cpu",
     "CPU-bound reading data.cache=memory"),  # the cache's reads, not the sample's making
])
def test_stall_advice_names_the_fix(overrides, kw, device, expected):
    line = stall_advice(cfg(**overrides), torch.device(device), 0.37,
                        **{"cores": 4, "in_memory": False, **kw})
    assert "prefetch_factor" not in line  # a deeper queue never fixes a steady shortfall
    assert line.startswith("steps waited for data 37% of the time: ") and expected in line
    if kw.get("uint8_images"):  # an image folder ships uint8 already
        assert "ship uint8" not in line
    if kw.get("pairs") is False:  # data.cache refuses samples that are not pairs
        assert "data.cache" not in line and "prepare_data" not in line
    if kw.get("whole_set") or (kw.get("converted") and device == "cpu"):
        assert "raise data.batch_size" not in line


class Sleepy(torch.utils.data.Dataset):
    """Each sample waits 2 ms and computes nothing (storage or a network, in the small)."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.zeros(2), i


class Busy(Sleepy):
    """Each sample computes for 2 ms of this thread's CPU time (a decode, in the small)."""

    def __getitem__(self, i):
        burn_cpu(2.0)
        return torch.zeros(2), i


def test_sample_cost_tells_a_sample_that_waits_from_one_that_computes():
    """Relations that hold on a loaded machine too: time queued for a CPU is not waiting."""
    waits, computes, cheap = sample_cost(Sleepy()), sample_cost(Busy()), sample_cost([1] * 9)
    assert computes.cpu_s >= 2e-3
    assert cheap.cpu_s < 50e-6 and waits.cpu_s < 1e-3
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    assert sample_cost(Stream()) is None
    assert sample_cost([]) is None
    if waits.blocked_s is None:
        pytest.skip("no /proc/thread-self/schedstat: the time queued for a CPU is unknown")
    assert waits.waits() and waits.blocked_s >= 1.5e-3
    assert not computes.waits() and not cheap.waits()


def test_sample_cost_stops_at_its_budget_and_says_nothing_of_a_failing_sample():
    calls = []

    class Slow(Sleepy):
        def __init__(self, first_s):
            self.first_s = first_s

        def __getitem__(self, i):
            calls.append(i)
            time.sleep(self.first_s if len(calls) == 1 else 0.05)
            return i

    # one sample over the budget is enough; else two, spread over the dataset
    assert sample_cost(Slow(0.05), samples=16, budget_s=0.01) is not None and calls == [0]
    calls.clear()
    assert sample_cost(Slow(0.0), samples=16, budget_s=0.01) is not None and calls == [0, 4]

    class Broken(Sleepy):
        def __getitem__(self, i):
            raise OSError("unreadable")

    assert sample_cost(Broken()) is None


def test_stall_advice_on_cuda_names_the_gpus_idle_share():
    line = stall_advice(cfg(), torch.device("cuda"), 0.21, workers=2, cores=4, in_memory=False,
                        gpu_idle=True)
    assert line.startswith("the GPU stood idle for data 21% of the time: raise data.num_workers")


def test_count_of_agrees_in_number_with_its_noun_and_verb():
    assert count_of(1, "worker") == "1 worker" and count_of(2, "core") == "2 cores"
    assert count_of(0, "epoch") == "0 epochs"
    assert count_of(1, "unreadable file", was=True) == "1 unreadable file was"
    assert count_of(3, "unreadable file", was=True) == "3 unreadable files were"

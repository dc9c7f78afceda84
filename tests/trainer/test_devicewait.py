"""trainer/devicewait.py: the GPU's idle time across the loop's batch fetches."""
from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from trainer.devicewait import DeviceWait
from trainer.runner import train


class FakeEvent:
    """A CUDA event stand-in whose record time is a clock the test moves."""
    clock = 0.0
    made = 0
    reached = float("inf")  # the GPU has reached events recorded up to this clock

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        FakeEvent.made += 1
        self.at = None

    def record(self, stream=None) -> None:
        self.at = FakeEvent.clock

    def query(self) -> bool:
        return self.at <= FakeEvent.reached

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.query() and end.query(), "CUDA refuses to time unfinished events"
        return (end.at - self.at) * 1000.0  # milliseconds, as CUDA's


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA's events and streams stood in for by FakeEvent, its clock and counts from zero."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "stream")
    for name, value in (("made", 0), ("clock", 0.0), ("reached", float("inf"))):
        monkeypatch.setattr(FakeEvent, name, value)


def fetch(wait: DeviceWait, seconds: float, step: float = 1.0) -> None:
    """One micro-batch on the fake clock: a fetch of `seconds`, then the step's own work."""
    wait.before()
    FakeEvent.clock += seconds  # the fetch
    wait.after()
    FakeEvent.clock += step  # the step's own work: not a wait


def test_sums_each_windows_fetches_and_reuses_its_events(fake_cuda):
    wait = DeviceWait(torch.device("cuda"))
    for s in (0.25, 0.5, 0.125):
        fetch(wait, s)
    assert wait.take_s() == pytest.approx(0.875)
    assert FakeEvent.made == 6  # two events per fetch of the longest window
    fetch(wait, 0.0625)
    wait.begin_epoch()
    fetch(wait, 0.0625)
    assert wait.take_s() == pytest.approx(0.125)  # this window's two fetches alone
    assert FakeEvent.made == 6  # reused
    for _ in range(4):
        fetch(wait, 0.5)
    assert wait.take_s() == pytest.approx(2.0) and FakeEvent.made == 8
    assert wait.take_s() == 0.0  # nothing fetched since


def test_a_window_longer_than_its_events_sums_the_finished_ones_as_it_goes(fake_cuda,
                                                                            monkeypatch):
    import trainer.devicewait

    monkeypatch.setattr(trainer.devicewait, "MAX_PAIRS", 4)
    wait = DeviceWait(torch.device("cuda"))
    for _ in range(10):  # the GPU keeps up: four pairs, reused
        fetch(wait, 0.5)
    assert wait.take_s() == pytest.approx(5.0) and FakeEvent.made == 8
    for n in range(1, 12):  # the GPU two fetches behind the host: still no wait for it
        FakeEvent.reached = FakeEvent.clock - 2 * 1.25 - 0.1
        fetch(wait, 0.25)
    FakeEvent.reached = float("inf")  # (the boundary's synchronize)
    assert len(wait.pairs) == 4 and wait.take_s() == pytest.approx(11 * 0.25)
    FakeEvent.reached = -1.0  # the GPU far behind: nothing to sum early, so one pair more
    for _ in range(5):
        fetch(wait, 0.125)
    FakeEvent.reached = float("inf")  # (the boundary's synchronize)
    assert len(wait.pairs) == 5 and wait.take_s() == pytest.approx(5 * 0.125)


@pytest.mark.gpu
def test_a_fetch_hidden_behind_queued_work_is_no_wait_and_one_the_gpu_idles_for_is():
    dev = torch.device("cuda")
    wait = DeviceWait(dev)
    torch.cuda.synchronize(dev)
    wait.before()  # the GPU has nothing queued: it idles for the whole fetch
    time.sleep(0.05)
    wait.after()
    torch.cuda.synchronize(dev)
    assert wait.take_s() >= 0.045
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead of the fetch
    wait.before()
    time.sleep(0.05)
    wait.after()
    assert not torch.cuda.current_stream(dev).query()  # the GPU was busy all along
    torch.cuda.synchronize(dev)
    assert wait.take_s() < 0.005


@pytest.mark.gpu
def test_a_run_on_a_slow_feed_reports_the_gpu_idle_for_it(make_cfg, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="stoker"):
        summary = train(make_cfg("trainer.accelerator=cuda", "trainer.max_epochs=1",
                                 "data.dataset._target_=tests.helpers.SlowDigits",
                                 "+data.dataset.delay=0.001", "data.num_workers=0",
                                 "trainer.log_every_n_steps=4", "trainer.save_checkpoint=false",
                                 run_dir=tmp_path / "run"))
    # 64 ms of reading a batch against a step of well under a millisecond
    assert summary["run_device_wait_frac"] > 0.5 and summary["run_data_wait_frac"] > 0.5
    assert summary["run_device_wait_frac"] <= summary["run_data_wait_frac"] * 1.05
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    # after the first window, which holds the GPU's start-up work (as benchlib.steady reads)
    assert len(train_rows) > 2 and all(0.5 < r["device_wait_frac"] <= 1.0
                                       for r in train_rows[1:])
    assert any("GPU idle for data" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("the GPU stood idle for data")
               for r in caplog.records)


def test_the_loop_reports_it_per_window_and_for_the_run(make_cfg, tmp_path, fake_cuda,
                                                        monkeypatch, caplog):
    """The loop's side on CPU, with events that read the host's clock: each fetch bracketed,
    every window read, the run's share in the summary and the final line."""
    import trainer.devicewait

    class HostClockEvent(FakeEvent):
        def record(self, stream=None) -> None:
            self.at = time.perf_counter()

    monkeypatch.setattr(torch.cuda, "Event", HostClockEvent)
    made = []
    monkeypatch.setattr(trainer.devicewait, "for_device",
                        lambda device: made.append(DeviceWait(device)) or made[-1])
    cfg = make_cfg("trainer.max_epochs=2", "data.dataset._target_=tests.helpers.SlowDigits",
                   "+data.dataset.delay=0.0002", "trainer.log_every_n_steps=5",
                   "trainer.save_checkpoint=false", run_dir=tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="stoker"):
        summary = train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl")
            .read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert len(made) == 1 and len(train_rows) == 10  # 2 epochs of 23 steps, a row per 5
    # each fetch's events lie inside its host interval: the device's share is not above it
    assert all(0 < r["device_wait_frac"] <= r["data_wait_frac"] for r in train_rows)
    assert 0 < summary["run_device_wait_frac"] <= summary["run_data_wait_frac"]
    assert made[0].used == 0 and len(made[0].pairs) == 5  # read every window; reused
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("done:")]
    assert len(done) == 1 and "(GPU idle for data " in done[0]

"""trainer/logging.py: metrics.jsonl rows and TensorBoard's event files."""
from __future__ import annotations

import json
import math

import pytest

from trainer.logging import EventFile, RunLogger


def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_event_file_rows_are_read_back_by_tensorboard_while_the_file_is_open(tmp_path):
    events = EventFile(tmp_path / "tb")
    events.scalars(10, {"train/loss": 0.5, "train/lr": 1e-3})
    events.scalars(20, {"train/loss": 0.25})
    events.scalars(30, {})  # nothing to write: no event
    # on disk before close: a live TensorBoard shows the rows as they come
    assert _scalars(tmp_path / "tb") == {"train/loss": [(10, 0.5), (20, 0.25)],
                                         "train/lr": [(10, pytest.approx(1e-3))]}
    events.close()


def test_event_files_of_one_process_never_share_a_name(tmp_path):
    first, second = EventFile(tmp_path), EventFile(tmp_path)  # within the same second
    first.scalars(1, {"a": 1.0})
    second.scalars(2, {"a": 2.0})
    first.close()
    second.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert _scalars(tmp_path) == {"a": [(1, 1.0), (2, 2.0)]}


def test_run_logger_writes_rows_of_numbers_and_leaves_out_the_rest(tmp_path):
    logger = RunLogger(tmp_path, main=True, write=True, tensorboard=True, progress_bar=False)
    logger.metrics("train", 5, {"epoch": 0, "loss": 1.5, "lr": 0.1})  # before open: nothing
    logger.open()
    logger.metrics("train", 50, {"epoch": 1, "loss": math.nan, "lr": 0.1, "note": "x",
                                 "flag": True})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"split": "train", "step": 50, "epoch": 1, "loss": None, "lr": 0.1,
                     "note": "x", "flag": True}]
    scalars = _scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"train/loss", "train/lr"}  # numbers only; epoch is the x axis
    assert math.isnan(scalars["train/loss"][0][1]) and scalars["train/lr"] == [
        (50, pytest.approx(0.1))]


def test_a_silent_logger_writes_no_files(tmp_path):
    logger = RunLogger(tmp_path / "run", main=False, write=False)
    logger.open()
    logger.metrics("train", 1, {"loss": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()

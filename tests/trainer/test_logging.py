"""trainer/logging.py: metrics.jsonl rows and TensorBoard's event files."""
from __future__ import annotations

import json
import math

import pytest

from trainer.logging import EventFile, RunLogger, write_whole


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


def test_a_resumed_logger_drops_the_rows_past_its_step_from_both_records(tmp_path):
    first = RunLogger(tmp_path, main=True, write=True, tensorboard=True, progress_bar=False)
    first.open()
    for step in range(1, 9):  # an attempt killed at step 8, its last checkpoint at step 5
        first.metrics("train", step, {"loss": float(step)})
        if step in (4, 8):
            first.metrics("val", step, {"loss": 10.0 + step})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"split": "train", "st')  # the line the kill cut short
    again = RunLogger(tmp_path, main=True, write=True, tensorboard=True, progress_bar=False)
    assert again.open(step=5, validated_step=4) == 5  # train 6-8, val 8, the torn line
    for step in (6, 7):
        again.metrics("train", step, {"loss": 100.0 + step})
    again.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["split"], r["step"]) for r in rows] == [
        *[("train", s) for s in (1, 2, 3, 4)], ("val", 4), ("train", 5), ("train", 6),
        ("train", 7)]
    assert not list(tmp_path.glob("*.tmp"))
    scalars = _scalars(tmp_path / "tensorboard")  # TensorBoard's own reading of both files
    assert scalars["train/loss"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0),
                                     (6, 106.0), (7, 107.0)]
    assert scalars["val/loss"] == [(4, 14.0)]


def test_a_damaged_line_before_the_last_is_said_apart_from_the_rows_trained_again(tmp_path,
                                                                                  caplog):
    import logging

    (tmp_path / "metrics.jsonl").write_text("".join(
        [json.dumps({"split": "train", "step": 1}) + "\n", "{\"split\": \"tr\x00\x00\n",
         json.dumps({"split": "train", "step": 2}) + "\n",
         json.dumps({"split": "train", "step": 3}) + "\n"]))
    logger = RunLogger(tmp_path, main=True, write=True, tensorboard=False, progress_bar=False)
    with caplog.at_level(logging.WARNING, logger="stoker"):
        assert logger.open(step=2) == 1  # step 3, trained again; not the damaged line
    logger.close()
    assert [r.getMessage() for r in caplog.records] == [
        "metrics.jsonl: 1 lines before its last were not whole JSON rows (damaged) and were "
        "dropped"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text()
             .splitlines()]
    assert steps == [1, 2]


def test_a_logger_rewrites_nothing_when_no_row_is_past_its_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"split": "train", "step": 0, "loss": 1}\n')
    logger = RunLogger(tmp_path, main=True, write=True, tensorboard=False, progress_bar=False)
    assert logger.open() == 0
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"split": "train", "step": 0, "loss": 1}\n'


def test_validations_before_the_resumed_step_stay_and_one_at_it_only_if_it_was_saved(tmp_path):
    def rows_after(step, validated_step):
        (tmp_path / "metrics.jsonl").write_text("".join(
            json.dumps({"split": split, "step": s, "loss": 1.0}) + "\n"
            for split, s in [("val", 2), ("train", 4), ("val", 4), ("train", 6)]))
        logger = RunLogger(tmp_path, main=True, write=True, tensorboard=False,
                           progress_bar=False)
        logger.open(step, validated_step)
        logger.close()
        return [(r["split"], r["step"]) for r in map(
            json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]

    assert rows_after(4, 4) == [("val", 2), ("train", 4), ("val", 4)]
    # saved before step 4's validation (or a checkpoint that does not record it): run again
    assert rows_after(4, 2) == rows_after(4, -1) == [("val", 2), ("train", 4)]


def test_write_whole_leaves_the_file_as_it_was_when_the_disk_is_full(tmp_path, monkeypatch):
    """status.json, summary.json and config.yaml are written whole or not at all: a full disk
    used to leave status.json empty (written in place), and its error named no file."""
    import errno
    import os

    path = tmp_path / "status.json"
    write_whole(path, '{"status": "running"}\n')
    assert path.read_text() == '{"status": "running"}\n'

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError) as e:
        write_whole(path, '{"status": "failed"}\n')
    assert str(e.value) == f"[Errno 28] No space left on device: '{path}'"
    assert path.read_text() == '{"status": "running"}\n'
    assert os.listdir(tmp_path) == ["status.json"]  # (no temporary file left)


def test_a_metrics_row_that_cannot_be_written_names_the_file(tmp_path, monkeypatch):
    """A file size limit (ulimit -f) or a full disk: `[Errno 27] File too large` named no
    file; the line is the path and the cause."""
    import errno

    from trainer.oneline import describe

    monkeypatch.setattr("sys.argv", ["train.py"])  # (no override names the run dir)
    logger = RunLogger(tmp_path, main=True, write=True, tensorboard=False, progress_bar=False)
    logger.open()

    class Full:
        name = str(tmp_path / "metrics.jsonl")

        def write(self, text):
            raise OSError(errno.EFBIG, "File too large")

        def close(self):  # (a buffered file flushes what it holds again, and fails again)
            raise OSError(errno.EFBIG, "File too large")

    real, logger._jsonl = logger._jsonl, Full()
    with pytest.raises(OSError) as e:
        logger.metrics("train", 1, {"loss": 1.0})
    assert describe(e.value) == f"{tmp_path / 'metrics.jsonl'}: File too large"
    logger.close()  # (the run's end: no second, unnamed error from the file)
    real.close()


def test_an_event_file_that_cannot_be_written_names_the_file(tmp_path):
    """A full disk under the TensorBoard writer: `[Errno 28] No space left on device`, alone,
    named no file and no key (its flush is what fails: /dev/full fails each one)."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    from trainer.oneline import describe

    events = EventFile(tmp_path / "tb")
    real, events._file = events._file, open("/dev/full", "wb")
    events._records = RecordWriter(events._file)
    with pytest.raises(OSError) as e:
        events.scalars(1, {"train/loss": 1.0})
    assert describe(e.value) == "/dev/full: No space left on device"
    real.close()


def test_a_full_disk_under_the_event_file_leaves_no_second_unnamed_error_at_close(tmp_path,
                                                                                 monkeypatch):
    """Its close flushed the buffered event again, failed again, unnamed, and that error
    replaced the one naming the file (the run's clean-up stopped there: its lock stayed)."""
    from tensorboard.summary.writer.record_writer import RecordWriter

    from trainer.oneline import describe

    monkeypatch.setattr("sys.argv", ["train.py"])
    logger = RunLogger(tmp_path, main=True, write=True, tensorboard=True, progress_bar=False)
    logger.open()
    real = logger._tb._file
    logger._tb._file = open("/dev/full", "wb")
    logger._tb._records = RecordWriter(logger._tb._file)
    with pytest.raises(OSError) as e:
        logger.metrics("train", 1, {"loss": 1.0})
    assert describe(e.value) == "/dev/full: No space left on device"
    logger.close()  # (no second error)
    real.close()


def test_progress_is_a_line_a_logging_boundary_where_the_console_is_no_terminal(
        tmp_path, monkeypatch, caplog):
    """A SLURM output file or a pipe kept only a bar's `0%| 0/23` fragments: no loss, rate or
    wait. There a line at each logging boundary says them; on a terminal, the bar."""
    import io
    import logging
    import sys

    from tqdm import tqdm

    logger = RunLogger(tmp_path, main=True, write=False, tensorboard=False, progress_bar=True)
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # (isatty: False)
    bar = logger.progress(23, "epoch 3")
    with caplog.at_level(logging.INFO, logger="stoker"):
        bar.update(10)
        bar.set_postfix(loss="0.4321", sps="85540", wait="3%", refresh=False)
        bar.close()
    assert [r.getMessage() for r in caplog.records] == [
        "epoch 3: batch 10/23, loss 0.4321, 85540 samples/s, waiting for data 3%"]
    resumed = logger.progress(23, "epoch 3", done=15)  # (an epoch resumed mid-way: counted on)
    with caplog.at_level(logging.INFO, logger="stoker"):
        resumed.update(2)
        resumed.set_postfix(loss="0.4", sps="1", wait="3%", refresh=False)
    assert caplog.records[-1].getMessage().startswith("epoch 3: batch 17/23, ")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    terminal = logger.progress(23, "epoch 3", done=15)
    assert isinstance(terminal, tqdm) and (terminal.n, terminal.total) == (15, 23)
    terminal.close()
    logger.close()  # (its warning counter off the root logger)
    silent = RunLogger(tmp_path, main=True, write=False, tensorboard=False, progress_bar=False)
    assert not isinstance(silent.progress(23, "epoch 3"), tqdm)
    silent.close()


def test_a_python_warning_during_a_run_is_a_log_line_counted_with_the_others(make_cfg,
                                                                             tmp_path, caplog):
    """torch's "Using a target size ... different to the input size" from a task of one's
    own reached the console alone: not train.log, not the done line's count, nor
    summary.json's."""
    import warnings

    from trainer.loop import Callback
    from trainer.runner import train

    class Warns(Callback):
        def after_step(self, loop):
            if loop.state.step == 2:
                warnings.warn("a warning of my own code")

    before = warnings.showwarning
    summary = train(make_cfg("trainer.max_steps=3", "sched=constant", run_dir=tmp_path),
                    callbacks=[Warns()])  # (a warmup past 3 steps would warn too)
    assert summary["warnings"] == 1
    assert warnings.showwarning is before  # (put back at the run's end)
    [record] = [r for r in caplog.records if "of my own code" in r.getMessage()]
    assert (record.name, record.levelname) == ("py.warnings", "WARNING")  # (train.log's too)
    assert record.getMessage() == ("UserWarning: a warning of my own code "
                                   f"({__file__}:{Warns.after_step.__code__.co_firstlineno + 2})")



def test_a_run_from_a_program_without_logging_still_shows_its_warnings(tmp_path):
    """The warning counter on the root logger kept Python's last resort (stderr, for a
    program that configured no logging) from every warning of a run started from Python:
    Stoker's, the program's own loggers' and its Python warnings alike."""
    import subprocess
    import sys

    from tests.helpers import CONF, ROOT

    code = f"""
import logging, warnings
from hydra import compose, initialize_config_dir
from trainer.loop import Callback
from trainer.runner import train
class Warns(Callback):
    def after_step(self, loop):
        if loop.state.step == 1:
            logging.getLogger("mine").warning("my logger's warning")
            warnings.warn("my python warning")
with initialize_config_dir(config_dir={str(CONF)!r}, version_base="1.3"):
    cfg = compose("train", overrides=["run_dir={tmp_path / 'run'}", "trainer.max_steps=3"])
print("warnings", train(cfg, callbacks=[Warns()])["warnings"])
logging.getLogger("mine").warning("after the run")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout == "warnings 3\n", proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert lines[0].startswith("sched.warmup_steps=20 is not fewer than the run's 3 "), lines
    assert lines[1:] == ["my logger's warning", "UserWarning: my python warning (<string>:10)",
                         "after the run"], lines

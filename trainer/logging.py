"""Run outputs from rank 0: console, progress bar, TensorBoard, metrics.jsonl, profiler traces.

Every other rank holds a silent RunLogger, so call sites never branch on rank: they log, and
only rank 0 writes. Hydra already sends Python logging to the console and `<run dir>/train.log`.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from tqdm import tqdm

from trainer.config import rank_prefix

log = logging.getLogger("stoker")
_FILE_IDS = itertools.count()  # event files this process opened: unique names within it


def write_whole(path: Path, text: str) -> None:
    """Writes `text` to `path` whole or not at all (a temporary file beside it, renamed over
    it): a full disk leaves the file as it was, not empty. The OSError names the file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def json_safe(value: Any) -> Any:
    """`value` with every float that is not finite made null: JSON has no NaN or Infinity (what
    Python writes for them, strict readers such as jq and browsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def _named(e: OSError, path: str) -> OSError:
    """`e`, or, where it names no file (a buffered write's flush on a full disk), the same error
    naming `path`: the run's line is then the file and the cause."""
    return e if e.filename is not None else OSError(e.errno, e.strerror, path)


class WarningCount(logging.Handler):
    """Counts the warnings said on rank 0's console during a run: the done line names how
    many, since the start-up's config dump may have pushed them off the screen. The count is
    in shared memory: a loader worker forked from the process has this handler too, and the
    warnings it says (an unreadable file skipped) count with the rest."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._count = multiprocessing.Value("q", 0)

    @property
    def count(self) -> int:
        return int(self._count.value)

    def emit(self, record: logging.LogRecord) -> None:
        with self._count.get_lock():
            self._count.value += 1
        if not self._others_handle(record) and logging.lastResort is not None and \
                record.levelno >= logging.lastResort.level:
            # (a program that configured no logging: Python's last resort prints a warning
            # to stderr where no handler takes it, and this one, on the root logger, kept
            # every warning of a run started from Python from the screen)
            logging.lastResort.handle(record)

    def _others_handle(self, record: logging.LogRecord) -> bool:
        """Whether a handler besides this one is on the record's way up the loggers (Python
        calls its last resort where there is none)."""
        logger: Optional[logging.Logger] = logging.getLogger(record.name)
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return True
            logger = logger.parent if logger.propagate else None
        return False


def _logged_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """warnings.showwarning for a run: a warning that passed Python's filters as one log line
    (`[rank N] ` on other ranks), where the console and train.log show it and the run's end
    counts it; one written to a file of its own goes there as before."""
    if file is not None:
        file.write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    logging.getLogger("py.warnings").warning("%s%s: %s (%s:%s)", rank_prefix(),
                                             category.__name__, message, filename, lineno)


class RunLogger:
    """Writes one JSON object per call to `metrics.jsonl` and the same scalars to TensorBoard.

    Nothing is written before `open()`, which the runner calls once the run dir is known to be
    this run's (locked, no other run's files, the resume checks passed)."""

    def __init__(self, run_dir: Path, main: bool, write: bool, tensorboard: bool = True,
                 progress_bar: bool = True):
        self.main = main  # console and progress bar
        self.write = write  # metrics.jsonl and TensorBoard (off in fast_dev_run)
        self.show_progress = main and progress_bar
        self.run_dir = run_dir
        self.tensorboard = tensorboard
        self._jsonl = None
        self._tb = None
        self.dropped_rows: List[str] = []  # metrics.jsonl's rows past the step gone on from
        self.before_first_write: Optional[Callable[[], None]] = None  # opens the run's files
        self.warnings = WarningCount()
        if main:  # every logger's (the modules' own too); removed at close: a sweep's next
            logging.getLogger().addHandler(self.warnings)  # job counts its own
        # Python warnings (torch's, the user's code's) as log lines, for the run: on the
        # console alone they were not in train.log, nor counted in the done line's warnings
        self._showwarning = warnings.showwarning
        warnings.showwarning = _logged_warning

    def open(self, step: int = 0, validated_step: int = -1) -> int:
        """Creates metrics.jsonl and the TensorBoard writer (rank 0, when writing) for a run
        that goes on from optimizer step `step`, last validated at `validated_step`: rows an
        earlier attempt logged past them (killed after its last checkpoint, or before any) are
        trained again, so they leave metrics.jsonl and the event file starts with TensorBoard's
        purge event (EventFile). Returns how many rows of metrics.jsonl were dropped."""
        if not self.write or self._jsonl is not None:
            return 0
        run_dir, tensorboard = self.run_dir, self.tensorboard
        run_dir.mkdir(parents=True, exist_ok=True)
        # a validation before `step` ended before the checkpoint; one at `step` is in it only
        # if the checkpoint says so (else it is run again)
        val_last = step if validated_step >= step else step - 1
        dropped, damaged, self.dropped_rows = _trim_rows(run_dir / "metrics.jsonl",
                                                         {"train": step, "val": val_last})
        if damaged:  # (not rows of a later step: said apart)
            self.warning("metrics.jsonl: %d lines before its last were not whole JSON rows "
                         "(damaged) and were dropped", damaged)
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)  # line-buffered
        if tensorboard:
            self._tb = EventFile(run_dir / "tensorboard", purge_after=step)
        return dropped

    def info(self, msg: str, *args: Any) -> None:
        if self.main:
            log.info(msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        """A warning every rank meets alike, said once (rank 0)."""
        if self.main:
            log.warning(msg, *args)

    def metrics(self, split: str, step: int, values: Dict[str, Any]) -> None:
        """Records `values` for `split` ("train" or "val") at optimizer step `step`."""
        if self._jsonl is None and self.before_first_write is not None:
            self.before_first_write()  # the run's files, opened at its first row
        if self._jsonl is None:
            return
        try:
            self._jsonl.write(json.dumps(json_safe({"split": split, "step": step, **values}),
                                         allow_nan=False) + "\n")
        except OSError as e:  # (a full disk, a file size limit: the line names the file)
            jsonl, self._jsonl = self._jsonl, None  # (closed now: the buffered bytes would
            _close_quietly(jsonl)                   # fail again, unnamed, at the run's end)
            raise _named(e, jsonl.name) from None
        if self._tb is not None:
            try:
                self._tb.scalars(step, {f"{split}/{k}": float(v) for k, v in values.items()
                                        if isinstance(v, (int, float))
                                        and not isinstance(v, bool)
                                        and k not in ("step", "epoch")})
            except OSError:  # (named: EventFile._write; closed now, as metrics.jsonl is)
                tb, self._tb = self._tb, None
                _close_quietly(tb)
                raise

    def summary(self, values: Dict[str, Any]) -> None:
        """Writes the run's final numbers to `summary.json` (read by the scripts/ tools)."""
        if self.write:
            write_whole(self.run_dir / "summary.json",
                        json.dumps(json_safe(values), indent=2, allow_nan=False) + "\n")

    def progress(self, total: Optional[int], desc: str, done: int = 0):
        """A tqdm bar on rank 0 (when enabled) where the console is a terminal; where it is not
        (a SLURM output file, a pipe) a line at each logging boundary instead, as a bar's
        redraws leave there only `0%|...` fragments; else a silent stand-in. `done`: of the
        `total`, the ones before it began (an epoch resumed mid-way)."""
        if not self.show_progress:
            return _NoBar()
        if not _is_terminal(sys.stderr):
            return _LineBar(total, desc, done)
        return tqdm(total=total, initial=done, desc=desc, leave=False, dynamic_ncols=True,
                    unit="batch")

    def close(self) -> None:
        """Closes the run's writers, every one of them even where one fails (a full disk,
        whose error is raised after)."""
        logging.getLogger().removeHandler(self.warnings)
        if warnings.showwarning is _logged_warning:
            warnings.showwarning = self._showwarning
        tb, jsonl, self._tb, self._jsonl = self._tb, self._jsonl, None, None
        try:
            if tb is not None:
                tb.close()
        finally:
            if jsonl is not None:
                jsonl.close()


def _close_quietly(writer: Any) -> None:
    """Closes a writer whose write failed (its error is raised already): its flush of the
    buffered bytes fails again, and must not replace that error."""
    try:
        writer.close()
    except OSError:
        pass


def _trim_rows(path: Path, last: Dict[str, int]) -> Tuple[int, int, List[str]]:
    """Rewrites the JSON-lines file `path` (atomically) without the rows whose step is past
    `last[split]`, nor lines that are not whole rows; returns how many went of the first
    (the last line, which a kill cut short, among them) and of the second before the last,
    and the first's whole rows."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0, 0, []

    def row_of(line: str) -> Optional[dict]:
        try:
            row = json.loads(line)
        except ValueError:
            return None
        whole = isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and \
            isinstance(row.get("split"), str)
        return row if whole else None

    rows = [row_of(line) for line in lines]
    kept = [line for line, row in zip(lines, rows)
            if row is not None and row["step"] <= last.get(row["split"], row["step"])]
    past = [line for line, row in zip(lines, rows)
            if row is not None and row["step"] > last.get(row["split"], row["step"])]
    damaged = sum(row is None for row in rows[:-1])
    if len(kept) < len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return len(lines) - len(kept) - damaged, damaged, past


class EventFile:
    """A TensorBoard event file in `logdir`, written on the calling thread: one event per row
    of scalars, on disk when `scalars` returns (a live TensorBoard shows it).

    torch's SummaryWriter hands each event to a thread that reopens the file for every record
    and checksums it in Python: about 100 us of CPU per row, shared with the training thread
    (the GIL) and followed by thread wake-ups. Here a row is one protobuf, tensorboard's own
    record format (RecordWriter: length, data and their checksums) and one write, ~35 us.
    """

    def __init__(self, logdir: Path, purge_after: Optional[int] = None):
        """`purge_after`: the step the run goes on from (0 for a start), so TensorBoard drops
        the points past it that earlier files of the dir hold (a SessionLog START event, as
        SummaryWriter's purge_step writes)."""
        # slow imports (~0.15 s): rank 0 only, when it writes
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        logdir.mkdir(parents=True, exist_ok=True)
        # TensorBoard reads a directory's files in the order of their names: microseconds
        # first, so a resumed run's file (whose purge event must come last) sorts after the
        # files of earlier processes and of this one
        name = (f"events.out.tfevents.{time.time_ns() // 1000:016d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_FILE_IDS):04d}")
        self._file = open(logdir / name, "xb")  # never another file's records
        self._records = RecordWriter(self._file)
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_after is not None:
            self._write(Event(wall_time=time.time(), step=purge_after + 1,
                              session_log=SessionLog(status=SessionLog.START)))

    def _write(self, event) -> None:
        try:
            self._records.write(event.SerializeToString())
            self._file.flush()
        except OSError as e:  # (a full disk, a file size limit: named, as metrics.jsonl is)
            raise _named(e, self._file.name) from None

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        """One event holding `values` (tag -> number) at `step`."""
        if values:
            summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v)
                                           for k, v in values.items()])
            self._write(self._event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._file.close()


class _NoBar:
    """What the loop calls on a progress bar, doing nothing (a disabled tqdm still costs tens
    of microseconds per epoch and per update)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # (no isatty, or closed)
        return False


class _LineBar(_NoBar):
    """The progress of an epoch as a line at each logging boundary, for a console that is no
    terminal: `epoch 3: batch 150/230, loss 0.4321, 85540 samples/s, waiting for data 3%`."""

    def __init__(self, total: Optional[int], desc: str, done: int = 0):
        self.total, self.desc, self.done = total, desc, done

    def update(self, n: int = 1) -> None:
        self.done += n

    def set_postfix(self, **kwargs: Any) -> None:
        of = f"/{self.total}" if self.total else ""
        log.info("%s: batch %d%s, loss %s, %s samples/s, waiting for data %s", self.desc,
                 self.done, of, kwargs.get("loss"), kwargs.get("sps"), kwargs.get("wait"))


class _NoProfiler(contextlib.nullcontext):
    def __enter__(self) -> "_NoProfiler":
        return self

    def step(self) -> None:
        pass


def profiler(run_dir: Path, enabled: bool, device: torch.device):
    """A torch.profiler over a few optimizer steps, traced for TensorBoard; else a no-op.

    Call `.step()` once per optimizer step. Traces land in `<run dir>/profiler/`.
    """
    if not enabled:
        return _NoProfiler()
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # one cycle, one trace: a repeating schedule wrote a trace every 5 steps (two for
    # debug=profile's 10) and warned that each cycle drops the last one's events
    return profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=3,
                                                            repeat=1),
                   on_trace_ready=tensorboard_trace_handler(str(run_dir / "profiler")),
                   record_shapes=True, profile_memory=True, with_stack=False)

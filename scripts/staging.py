"""Writing a folder whole: into a staging folder beside it, moved into place once complete.

The data scripts (prepare_data.py, make_images.py) replace their `--out` folder this way, so a
failure, a Ctrl-C or a SIGTERM leaves it as it was and no partial folder behind.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path
from typing import Iterator


class Terminated(Exception):
    """SIGTERM, raised where the script is, so that its `finally` blocks run."""


def _terminated(signum, frame) -> None:
    raise Terminated()


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside, SIGTERM raises `Terminated` (its default ends the process at once, leaving a
    staging folder behind)."""
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """Yields a fresh folder beside `out` (resolved: a link's folder is replaced, not the
    link) to write into; when the block ends without an error, that folder becomes `out`,
    replacing what was there, with SIGINT and SIGTERM held for the two renames. The staging
    folder is removed in every case."""
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        yield stage
        signals = (signal.SIGINT, signal.SIGTERM)
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        try:
            if out.exists():
                out.rename(old)
            stage.rename(out)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def holds_working_dir(out: Path) -> bool:
    """Whether replacing `out` (resolved) would take the working directory with it."""
    cwd = Path.cwd().resolve()
    return out == cwd or out in cwd.parents

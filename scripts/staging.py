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
from typing import Callable, Iterator, Optional, Sequence, Tuple


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
    replacing what was there. The staging folder is removed in every case. From the swap on,
    the work is done: a Ctrl-C or SIGTERM then is let pass (handlers that only note it: a
    blocked signal mask holds for this thread only, and numpy's and torch's threads would
    take it), so the swap and the old folder's removal always end."""
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    try:
        yield stage
        with _signals_noted():
            if out.exists():
                out.rename(old)
            stage.rename(out)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        # (a second Ctrl-C during the clean-up of a first, or of a failure, cut it short:
        # the staging folder stayed, and a second traceback was printed into the first)
        with _signals_noted():
            shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def _signals_noted() -> Iterator[None]:
    """Inside, a Ctrl-C or SIGTERM is noted and let pass, so that what is inside ends."""
    previous = {sig: signal.signal(sig, _noted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _noted(signum, frame) -> None:
    """A signal during the swap or the clean-up: the script ends as it would."""


def refusal(out: Path, overwrite: bool, foreign: Callable[[Path], Optional[str]], own: str,
            reads: Sequence[Tuple[str, Path]] = ()) -> Optional[str]:
    """Why the folder `out` (resolved) must not be replaced whole, or None: it is the working
    directory or holds it, it overlaps a folder the script reads (`reads`: (its key, the
    folder)), it is a file or under one, or it is not empty and either `overwrite` is off or
    it holds an entry the script did not write (`foreign(out)` names the first; `own` says
    what the script writes)."""
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        return "is the working directory or holds it; give a folder of its own"
    for key, folder in reads:
        if folder == out or out in folder.parents or folder in out.parents:
            return f"overlaps {key}, which it reads; give a folder outside it"
    if out.exists() and not out.is_dir():
        return "is a file; give a folder to write"
    above = next((p for p in out.parents if p.exists()), None)
    if above is not None and not above.is_dir():  # (else an OS error once the data is read)
        return f"is under {above}, a file, not a folder; give a folder to write"
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if not overwrite:
        return ("exists and is not empty; give a new folder, or --overwrite to replace it "
                "once the new one is complete")
    name = foreign(out)
    if name:
        return (f"holds {name}, which this script did not write; --overwrite replaces only a "
                f"folder it wrote ({own})")
    return None

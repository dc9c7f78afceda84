"""The ranks of a node waiting for the local rank 0 that writes its cache (data/cache.py's
shm and disk copies): whether that writer lives (its record, one per writing process), the
wait itself, and the clean-up of writers killed mid-write."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, List, Optional

from trainer.config import ConfigError

log = logging.getLogger("stoker")


class WriterGone(RuntimeError):
    """The local rank writing a node's shared cache ended, or never began, while the other
    ranks waited for it (one line: its own error is in its output)."""


# who writes a node's disk cache now (`owner`), beside it: one record per writing process,
# so that another job writing the same cache at once keeps its own (a record per host that
# the second job's writer replaced, then removed, left the first job's ranks waiting for a
# writer that "never began")
WRITER = "{key}.writer-{host}-{pid}.json"


LAUNCH = ("job", "attempt", "launch")  # the keys of an `owner` record that name its launch


def _same_launch(who: dict, me: dict) -> bool:
    """Whether two `owner` records are of one launch (LAUNCH)."""
    return [who.get(k) for k in LAUNCH] == [me.get(k) for k in LAUNCH]


def _writer_state(record: Path, me: Optional[dict], alive: Callable[[dict], bool]
                  ) -> Optional[bool]:
    """Whether the writer that `record` names is alive: None while no writer of this launch
    (the same job, attempt and launch as `me`, this process's `owner`) has recorded itself
    there; a record of another launch (one killed mid-write, whose record is kept a while:
    `keep_record`) is not this launch's writer."""
    try:
        who = json.loads(record.read_text())
    except (OSError, ValueError):  # not there yet, or being written
        return None
    if not isinstance(who, dict) or me is None or not _same_launch(who, me):
        return None
    return alive(who)


def keep_record(record: Path, keep_s: float) -> bool:
    """Whether the record of a writer that is gone stays: for `keep_s` seconds after it was
    written, or after its unfinished data was freed (which touches it). The ranks of its
    launch on their way to wait for it read there that it is gone, and stop at once; without
    it they waited for a writer that never began (trainer.ddp.timeout_s), then named the
    wrong cause. A few bytes; the writer's unfinished data goes at once."""
    try:
        return time.time() - record.stat().st_mtime < keep_s
    except OSError:
        return False


def _records(cache_dir: Path, key: str) -> List[Path]:
    """This host's writer records of the disk cache `key` (`*` of a glob would also take
    another host's whose name is this one's and more: `node1` and `node1-2`)."""
    exact = re.compile(re.escape(WRITER.format(key=key, host=socket.gethostname(), pid="@"))
                       .replace("@", r"\d+") + "$")
    return [path for path in cache_dir.glob(f"{key}.writer-*.json") if exact.match(path.name)]


def _disk_writer_state(cache_dir: Path, key: str, me: Optional[dict],
                       alive: Callable[[dict], bool]) -> Optional[bool]:
    """`_writer_state` over this host's writer records of the disk cache `key`: True while a
    writer of this launch is alive, False when its only writers are gone, None when none
    has recorded itself."""
    states = {_writer_state(path, me, alive) for path in _records(cache_dir, key)}
    return True if True in states else False if False in states else None


def mark_failed(failed: Path, line: str, owner: Optional[dict]) -> None:
    """`failed`: a failed write's one line for the ranks waiting for it, and whose it is (the
    writer's `owner`: a later launch's ranks, there before their own writer removed it, do
    not take it for their writer's). Written whole: a waiting rank never reads half of it.
    Where it cannot be written (the full disk that failed the write, say), its partial file is
    removed and a warning says so, and the error being marked goes on unmasked: the waiting
    ranks learn of the writer's end from its exit (WriterGone) instead."""
    part = failed.with_name(f"{failed.name}.{os.getpid()}.tmp")
    try:
        part.write_text(json.dumps({"error": line, "writer": owner or {}}))
        os.replace(part, failed)
    except OSError as e:
        try:
            part.unlink(missing_ok=True)
        except OSError:
            pass
        log.warning("could not leave the failed write's line for the waiting ranks in %s (%s); "
                    "they learn of it as this rank ends", failed, e.strerror or e)


def _failure(failed: Path, me: Optional[dict]) -> Optional[str]:
    """The line in `failed` (mark_failed) where it is this launch's writer's (`me`: this
    process's `owner`; None: any)."""
    try:
        said = json.loads(failed.read_text())
    except (OSError, ValueError):  # none (or removed meanwhile: its writer's next launch began)
        return None
    if not isinstance(said, dict) or not isinstance(said.get("error"), str):
        return None  # (not a line of this version's)
    writer = said.get("writer") if isinstance(said.get("writer"), dict) else {}
    if me is not None and not _same_launch(writer, me):
        return None
    return said["error"]


def _await(done: Path, failed: Path, what: str, writer: Callable[[], Optional[bool]] = lambda:
           None, start_s: float = 0.0, me: Optional[dict] = None) -> None:
    """Blocks until another process wrote `done` (or `failed`, where it is the failure of this
    launch's writer, `_failure`: then raises its message).

    Ranks that wait for local rank 0 to materialise a dataset poll for its completion rather
    than wait in a collective, whose timeout (trainer.ddp.timeout_s) a long decode outlasts.
    `writer()` says whether the writing process is alive (None: it has not begun): one that
    ended without a word, or that has not begun within `start_s` seconds (0: no limit; it does
    the same work as this rank until then), raises WriterGone, so that no rank waits on for a
    writer that is gone (a launch without torchrun's agent would never end it)."""
    start = last = time.monotonic()
    while not done.exists():
        said = _failure(failed, me)
        if said is not None:
            raise ConfigError(f"{what}: local rank 0 failed to write it: {said}")
        state = writer()
        if state is False and not done.exists() and _failure(failed, me) is None:
            raise WriterGone(f"{what}: local rank 0, which was writing it, ended before it "
                             "finished; its own error, if it had one, is in its output")
        if state is None and start_s and time.monotonic() - start > start_s:
            raise WriterGone(f"{what}: local rank 0 did not begin writing it within "
                             f"{start_s:g} s (trainer.ddp.timeout_s); its own error, if it had "
                             "one, is in its output")
        if time.monotonic() - last > 60:
            last = time.monotonic()
            log.info("waiting for local rank 0 to write %s (%.0f s)", what, last - start)
        time.sleep(0.2)


def _reclaim_tmp(cache_dir: Path, keep_s: float) -> None:
    """Removes this host's unfinished cache folders whose writer process is gone (killed
    mid-write), and its records once `keep_record` lets them go; another host's are left to
    that host."""
    mine = re.compile(rf"^[^.]+\.(?:tmp-{re.escape(socket.gethostname())}-(\d+)-[0-9a-f]+|"
                      rf"writer-{re.escape(socket.gethostname())}-(\d+)\.json)$")
    gone: List[tuple] = []  # (path, pid) of writers gone
    for path in cache_dir.iterdir() if cache_dir.is_dir() else ():
        found = mine.match(path.name)  # (exactly: not another host's named this one's and more)
        if found is None:
            continue
        try:
            os.kill(int(found.group(1) or found.group(2)), 0)
        except ProcessLookupError:
            gone.append((path, found.group(1) or found.group(2)))
        except (ValueError, IndexError, PermissionError, OverflowError):
            continue
    freed = {pid for path, pid in gone if os.path.isdir(path)}
    for path, pid in gone:
        try:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif pid in freed:  # its data freed now: its record's while runs from here
                os.utime(path)
            elif not keep_record(path, keep_s):
                path.unlink(missing_ok=True)
        except OSError:  # (another run's reclaim took it meanwhile)
            continue

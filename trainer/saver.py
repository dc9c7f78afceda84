"""The run's checkpoint writer: `Checkpointer` writes `step-NNNNNNNN.pt` (on a background
thread where asked, after a copy of the state to CPU), keeps the newest `keep_last`, and points
`last.pt` and `best.pt` at one of them by an atomic hard link; the file format, atomic write and
checks are trainer/checkpoint.py's."""
from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

from trainer import checkpoint
from trainer.checkpoint import CheckpointWriteError, unlink_quietly

log = logging.getLogger("stoker")


def _link_over(src: Path, dst: Path) -> None:
    """Points `dst` at `src`'s bytes atomically (hard link, else a copy, then rename)."""
    tmp = dst.with_name(f".{dst.name}.link")
    unlink_quietly(str(tmp))
    try:
        os.link(src, tmp)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(src, tmp)
    try:
        os.replace(tmp, dst)
    except OSError as e:
        unlink_quietly(str(tmp), failed_write=True)
        in_the_way = "a folder is in the way" if dst.is_dir() else e.strerror or str(e)
        raise CheckpointWriteError(f"checkpoint {dst}: cannot point it at {src.name} "
                                   f"({in_the_way}); {src} was written") from None


def remove_leftovers(folder: Path) -> List[Path]:
    """Deletes the temp files of writes a crash interrupted (`.NAME.*.tmp`, `.NAME.link`);
    the run dir's lock guarantees no other run is writing them. Returns what it removed."""
    gone = [p for p in list(folder.glob(".*.tmp")) + list(folder.glob(".*.link"))
            if p.is_file()]
    for p in gone:
        unlink_quietly(str(p))
    return gone


WRITER = "stoker-checkpoint"  # the background write's thread
# background writes not yet ended, counted by the writers themselves: a KeyboardInterrupt in
# Thread.join marks the thread stopped while it still runs (Python up to 3.12)
_writing = [0]
_writing_lock = threading.Lock()


def writing_in_background() -> bool:
    """Whether a checkpoint is being written on its background thread now."""
    return _writing[0] > 0


def _count_writing(change: int) -> None:
    with _writing_lock:
        _writing[0] += change


class Checkpointer:
    """Writes `step-NNNNNNNN.pt`, keeps the newest `keep_last`, points `last.pt` (and `best.pt`)
    at them. With `async_save` (the constructor's default, or a save's own) the state is copied
    to CPU at once (the only stall) and written on one background thread; a new save first
    waits for the previous one."""

    def __init__(self, run_dir: Path, keep_last: int, async_save: bool, enabled: bool):
        self.folder = Path(run_dir) / checkpoint.CHECKPOINT_DIR
        self.keep_last, self.async_save, self.enabled = keep_last, async_save, enabled
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._unremovable: set = set()  # old step files that could not be removed (said once)
        self.last_saved_step: Optional[int] = None
        if enabled:
            remove_leftovers(self.folder)

    def save(self, state: Dict[str, Any], step: int, best: bool = False,
             async_save: Optional[bool] = None) -> Path:
        """Saves `state` as step `step` (only the caller on rank 0 passes enabled=True);
        `async_save` None: the constructor's setting."""
        path = self.folder / f"step-{step:08d}.pt"
        self.last_saved_step = step
        if not self.enabled:
            return path
        checkpoint.check_loadable(state)  # (before anything is written: none that cannot resume)
        self.wait()
        if not (self.async_save if async_save is None else async_save):
            self._write(state, path, best)
            return path
        cpu_state = checkpoint.to_cpu(state)  # the training stall: a copy to host, no disk I/O
        self._thread = threading.Thread(target=self._write_guarded, args=(cpu_state, path, best),
                                        name=WRITER, daemon=True)
        _count_writing(+1)  # (before it starts: an exit right after this sees it)
        try:
            self._thread.start()
        except BaseException:
            _count_writing(-1)
            raise
        return path

    def _write_guarded(self, state, path, best) -> None:
        try:
            self._write(state, path, best)
        except BaseException as e:  # reported by the next wait()
            self._error = e
        finally:
            _count_writing(-1)

    def _write(self, state: Dict[str, Any], path: Path, best: bool) -> None:
        checkpoint.save(state, path)
        _link_over(path, self.folder / checkpoint.LAST)
        if best:
            _link_over(path, self.folder / checkpoint.BEST)
        for old in checkpoint.step_files(self.folder)[:-self.keep_last]:
            try:
                unlink_quietly(str(old))  # only after the new one is complete
            except OSError as e:  # (an immutable or read-only old file: the new one is
                if old not in self._unremovable:  # written, and the run goes on; it failed
                    self._unremovable.add(old)  # the run, blaming hydra.run.dir)
                    log.warning("checkpoint: %s stays: it cannot be removed to keep the newest "
                                "trainer.checkpoint.keep_last=%d (%s); %s was written",
                                old, self.keep_last, e.strerror or e, path.name)

    def settle(self) -> Optional[BaseException]:
        """For a run that is failing: lets the background write (if any) end, so that the
        checkpoint it writes is complete (the process would otherwise exit under it: torch's
        writer aborts at the interpreter's shutdown, the file lost); returns its error."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001  (said by the caller; a Ctrl-C stops the wait)
            return e
        return None

    def wait(self) -> None:
        """Blocks until the background write (if any) is on disk; re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

"""Checkpoints: atomic writes and loads that fail with one line naming the file.

A checkpoint is written to a temporary file in the destination directory, fsynced, then
renamed over the real name, so a crash or a full disk mid-write never leaves a truncated file
under a real name; older checkpoints are deleted only after the new one is complete.
Layout: `checkpoints/step-NNNNNNNN.pt` (the newest `keep_last`), `last.pt` and `best.pt`
(hard links to one of them).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from data.prefetch import map_tensors

CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"
BEST = "best.pt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit this run; one line naming the file."""


def save(state: Dict[str, Any], path: Path) -> Path:
    """Writes `state` to `path` atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format_version": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    # the rename is durable only once the directory entry is on disk
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def load(path: Path, map_location: str | torch.device = "cpu") -> Dict[str, Any]:
    """Reads a checkpoint written by `save`; CheckpointError if missing, truncated or foreign."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        # weights_only: a checkpoint is data, never code to run
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises many types for a damaged zip/pickle
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from e
    if not isinstance(state, dict) or "format_version" not in state or "model" not in state:
        raise CheckpointError(f"checkpoint {path}: not a Stoker checkpoint")
    return state


def candidates(run_dir: Path) -> List[Path]:
    """This run's checkpoints, newest first: last.pt, then step-*.pt by step."""
    folder = Path(run_dir) / CHECKPOINT_DIR
    steps = sorted(folder.glob("step-*.pt"), key=lambda p: p.name, reverse=True)
    last = folder / LAST
    return ([last] if last.is_file() else []) + steps


def find_resume(resume: Optional[str], run_dir: Path,
                warn=lambda msg: None) -> Optional[Tuple[Path, Dict[str, Any]]]:
    """The checkpoint to resume from, loaded: null -> none; 'auto' -> the newest readable one
    in this run dir (a damaged one is reported through `warn` and the previous one tried;
    none at all is a fresh start); anything else -> that file, which must load."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.is_file():
            raise CheckpointError(f"trainer.resume={resume}: no such checkpoint file "
                                  "(give a path to a .pt file, auto, or null)")
        return path, load(path)
    for path in candidates(run_dir):
        try:
            return path, load(path)
        except CheckpointError as e:
            warn(f"{e}; trying the previous checkpoint")
    return None


def check_model_state(model: torch.nn.Module, state: Dict[str, Any], path: Path) -> None:
    """Refuses weights that do not fit `model` with a list of mismatches (never a partial
    load)."""
    own = model.state_dict()
    theirs = state["model"]
    missing = sorted(set(own) - set(theirs))
    unexpected = sorted(set(theirs) - set(own))
    shapes = sorted(k for k in set(own) & set(theirs)
                    if tuple(own[k].shape) != tuple(theirs[k].shape))
    if missing or unexpected or shapes:
        parts = []
        for name, keys in (("missing", missing), ("unexpected", unexpected),
                           ("shape mismatch", shapes)):
            if keys:
                shown = ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")
                parts.append(f"{name}: {shown}")
        raise CheckpointError(f"checkpoint {path} does not fit this model; " + "; ".join(parts))


def _link_over(src: Path, dst: Path) -> None:
    """Points `dst` at `src`'s bytes atomically (hard link, else a copy, then rename)."""
    tmp = dst.with_name(f".{dst.name}.link")
    _unlink_quietly(str(tmp))
    try:
        os.link(src, tmp)
    except OSError:  # a filesystem without hard links
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def to_cpu(obj: Any) -> Any:
    """A copy of `obj` whose tensors are detached CPU clones (safe to write later)."""
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))


class Checkpointer:
    """Writes `step-NNNNNNNN.pt`, keeps the newest `keep_last`, points `last.pt` (and `best.pt`)
    at them. With `async_save` the state is copied to CPU at once (the only stall) and
    written on one background thread; a new save first waits for the previous one."""

    def __init__(self, run_dir: Path, keep_last: int, async_save: bool, enabled: bool):
        self.folder = Path(run_dir) / CHECKPOINT_DIR
        self.keep_last, self.async_save, self.enabled = keep_last, async_save, enabled
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.last_saved_step: Optional[int] = None

    def save(self, state: Dict[str, Any], step: int, best: bool = False) -> Path:
        """Saves `state` as step `step` (only the caller on rank 0 passes enabled=True)."""
        path = self.folder / f"step-{step:08d}.pt"
        self.last_saved_step = step
        if not self.enabled:
            return path
        self.wait()
        if not self.async_save:
            self._write(state, path, best)
            return path
        cpu_state = to_cpu(state)  # the training stall: a device-to-host copy, no disk I/O
        self._thread = threading.Thread(target=self._write_guarded, args=(cpu_state, path, best),
                                        name="stoker-checkpoint", daemon=True)
        self._thread.start()
        return path

    def _write_guarded(self, state, path, best) -> None:
        try:
            self._write(state, path, best)
        except BaseException as e:  # reported by the next wait()
            self._error = e

    def _write(self, state: Dict[str, Any], path: Path, best: bool) -> None:
        save(state, path)
        _link_over(path, self.folder / LAST)
        if best:
            _link_over(path, self.folder / BEST)
        for old in sorted(self.folder.glob("step-*.pt"))[:-self.keep_last]:
            _unlink_quietly(str(old))  # only after the new one is complete

    def wait(self) -> None:
        """Blocks until the background write (if any) is on disk; re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

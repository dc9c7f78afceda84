"""Checkpoints: atomic writes and loads that fail with one line naming the file.

A checkpoint is written to a temporary file in the destination directory, fsynced, then
renamed over the real name, so a crash or a full disk mid-write never leaves a truncated file
under a real name and never removes the previous good one.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional

import torch

CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"
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


def find_resume(resume: Optional[str], run_dir: Path) -> Optional[Path]:
    """The checkpoint to resume from: null -> none, 'auto' -> this run's last.pt if present,
    anything else -> that path, which must exist."""
    if resume is None:
        return None
    if resume == "auto":
        last = Path(run_dir) / CHECKPOINT_DIR / LAST
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise CheckpointError(f"trainer.resume={resume}: no such checkpoint file "
                              "(give a path to a .pt file, auto, or null)")
    return path


def load_model_state(model: torch.nn.Module, state: Dict[str, Any], path: Path) -> None:
    """Loads model weights, refusing with a list of mismatches rather than a partial load."""
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
    model.load_state_dict(theirs)

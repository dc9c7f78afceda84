"""Checkpoints: atomic writes and loads that fail with one line naming the file.

A checkpoint is written to a temporary file in the destination directory, fsynced, then
renamed over the real name, so a crash or a full disk mid-write never leaves a truncated file
under a real name; older checkpoints are deleted only after the new one is complete. A write
that fails (a full disk, a read-only directory) is one line naming the file and the cause.

Damage is detected: torch.save writes a zip archive that holds a CRC-32 of every record (the
pickled structure and each tensor's bytes), and `load` checks every one of them before
unpickling, so a flipped bit in a stored weight is reported instead of loaded.
Layout: `checkpoints/step-NNNNNNNN.pt` (the newest `keep_last`), `last.pt` and `best.pt`
(hard links to one of them), written by trainer/saver.py.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from data.prefetch import each_tensor, map_tensors
from data.resident import nbytes
from trainer.config import first_line

CHECKPOINT_DIR = "checkpoints"
LAST = "last.pt"
BEST = "best.pt"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit this run; one line naming the file."""


class CheckpointWriteError(OSError):
    """A checkpoint the filesystem would not take (a full disk, a read-only dir, a file in the
    way): an OS error, exit 1, the previous checkpoints kept; one line naming the file."""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _umask()  # read once, at import, before any thread could race on it


def save(state: Dict[str, Any], path: Path) -> Path:
    """Writes `state` to `path` atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        in_the_way = isinstance(e, (FileExistsError, NotADirectoryError))
        raise CheckpointWriteError(
            f"checkpoint {path}: cannot write in {path.parent} (" + (
                "a file is in the way of the folder" if in_the_way else e.strerror or str(e))
            + ")") from None
    try:
        with os.fdopen(fd, "wb") as f:
            # mkstemp makes the file private (0600); a checkpoint gets the mode any file the
            # user writes gets (the umask's), so teammates on a shared disk can read it
            os.fchmod(f.fileno(), 0o666 & ~_UMASK)
            torch.save({"format_version": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        cause = _write_cause(e, path, tmp)
        unlink_quietly(tmp, failed_write=True)
        try:  # (the tmp file is gone)
            kept = any(p.suffix == ".pt" for p in path.parent.iterdir())
        except OSError:  # the folder went too (a deleted dir, a stale NFS handle)
            kept = False
        raise CheckpointWriteError(f"checkpoint {path}: the write failed "
                                   f"({cause}); " + (
                                       "the previous checkpoints are kept" if kept else
                                       "no checkpoint was written before it")) from None
    except BaseException:
        unlink_quietly(tmp, failed_write=True)
        raise
    # the rename is durable only once the directory entry is on disk
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def _write_cause(e: BaseException, path: Path, tmp: str) -> str:
    """The real cause of a failed write: torch reports a full disk as "enforce fail ...
    unexpected pos", so the free space is asked directly."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    try:
        if shutil.disk_usage(path.parent).free < 1 << 20:
            return "no space left on device"
    except OSError:
        pass
    limit = _file_size_limit()
    try:  # (the limit's EFBIG, said so too: where the file being written reached it)
        reached = limit is not None and os.path.getsize(tmp) >= limit
    except OSError:
        reached = False
    if reached and "unexpected pos" in str(e):
        return f"file too large: this process may write files of {limit} bytes at most " \
               "(ulimit -f)"
    return first_line(e)


def _file_size_limit() -> Optional[int]:
    """The process's limit on a file's size in bytes (ulimit -f), None without one."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):  # (not on every platform)
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def unlink_quietly(path: str, failed_write: bool = False) -> None:
    """Removes `path`; nothing where it is gone already, and, for the temp file of a
    `failed_write` whose error is said already, nothing where it cannot go either (an
    append-only or read-only folder: its PermissionError replaced the write's own line; the
    next start removes it, saver.remove_leftovers)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        if not failed_write:
            raise


# what torch.load(weights_only=True) takes back besides tensors (and dicts, lists, tuples, sets)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype,
          torch.device)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# the check's own serialiser, into memory: not the file writes `save` makes with torch.save
_IN_MEMORY_SAVE = torch.save
_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


def check_loadable(state: Dict[str, Any]) -> None:
    """CheckpointError (one line naming where) when `state` holds an object that a safe load
    (torch.load with weights_only=True, as `load` reads) refuses: such a checkpoint could be
    written at every save and never resumed. Only the state's structure is pickled to find
    out (its tensors left out), so the check costs little beside the save."""
    skeleton = map_tensors(state, lambda t: None)
    try:
        buffer = io.BytesIO()
        _IN_MEMORY_SAVE(skeleton, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
        return
    except (pickle.PicklingError, pickle.UnpicklingError, TypeError, AttributeError) as e:
        found = _foreign(skeleton, "")
        named = _GLOBAL.search(str(e))
        what = (f"a {type(found[1]).__module__}.{type(found[1]).__qualname__}" if found else
                named.group(1) if named else _ANSI.sub("", first_line(e))[:160])
        where = f"state{found[0]}" if found else "the state"
    raise CheckpointError(f"checkpoint: {where} holds {what}, which a checkpoint cannot load "
                          "back (torch.load with weights_only=True refuses what could run "
                          "code); keep tensors, numbers, strings, lists and dicts there (an "
                          "array: torch.from_numpy), or allow the type with "
                          "torch.serialization.add_safe_globals")


def _foreign(obj: Any, where: str) -> Optional[Tuple[str, Any]]:
    """The first object inside `obj` that is not plain data (`_PLAIN`, in dicts, lists,
    tuples and sets), with where it is (`['model']['net._extra_state']`); None if none."""
    if type(obj) in (dict, list, tuple, set) or isinstance(obj, collections.OrderedDict):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for key, value in items:
            found = _foreign(value, f"{where}[{key!r}]")
            if found:
                return found
        return None
    return None if isinstance(obj, _PLAIN) else (where, obj)


def load(path: Path, map_location: str | torch.device = "cpu") -> Dict[str, Any]:
    """Reads a checkpoint written by `save`; CheckpointError if missing, truncated or foreign."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: {_not_a_file(path)}")
    verify(path)
    state = read(path, map_location)
    if not isinstance(state, dict) or "format_version" not in state or "model" not in state:
        weights = isinstance(state, dict) and state and all(
            isinstance(v, torch.Tensor) for v in state.values())
        raise CheckpointError(f"checkpoint {path}: not a Stoker checkpoint" + (
            " but weights alone (a state_dict); trainer.init_from=PATH starts a run from "
            "them" if weights else ""))
    return state


NOT_REGULAR = "not a regular file (a device, a pipe or a socket)"


def checkpoints_in(folder: Path) -> List[Path]:
    """The checkpoints a run dir, or its checkpoints/ folder, holds by name: best.pt, then
    last.pt."""
    return [p for p in (folder / CHECKPOINT_DIR / BEST, folder / CHECKPOINT_DIR / LAST,
                        folder / BEST, folder / LAST) if p.is_file()]


def _not_a_file(path: Path) -> str:
    """Why `path` is no checkpoint file: a folder (with the checkpoints it holds), something
    that is not a regular file, or nothing."""
    if path.is_dir():
        held = ", ".join(map(str, checkpoints_in(path)))
        return "a directory, not a file" + (f"; it holds {held}" if held else "")
    return NOT_REGULAR if path.exists() else f"no such file{nearby(path)}"


def nearby(path: Path) -> str:
    """For a file that is not there (a misspelt name): the .pt files beside where it would be,
    as `; <folder> holds a.pt, b.pt`; "" where there are none."""
    there = sorted(p.name for p in path.parent.glob("*.pt")) if path.parent.is_dir() else []
    hint = f"; {path.parent} holds {', '.join(there[:4])}" if there else ""
    if path.name == BEST and LAST in there:
        hint += f" (a run keeps {BEST} only with trainer.checkpoint.monitor)"
    return hint


SAFE_GLOBALS_HINT = ("allow it with torch.serialization.add_safe_globals if you trust the "
                     "file")


def read(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False,
         refused: str = SAFE_GLOBALS_HINT) -> Any:
    """What torch.save wrote to `path`, loaded safely (tensors and plain containers, never code
    to run); CheckpointError naming the file when it is unreadable or holds an object of
    another kind (`refused`: what to do then). (`load` checks the archive's checksums first.)"""
    try:
        # weights_only: a checkpoint is data, never code to run
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        named = _GLOBAL.search(str(e))
        if named is None:
            raise CheckpointError(f"checkpoint {path}: unreadable (UnpicklingError: "
                                  f"{_ANSI.sub('', first_line(e))})") from e
        raise CheckpointError(f"checkpoint {path}: holds {named.group(1)}, which a safe load "
                              "(torch.load with weights_only=True) refuses as code that could "
                              f"run; {refused}") from None
    except Exception as e:  # torch raises many types for a damaged zip/pickle
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(e).__name__}: "
                              f"{first_line(e, empty='no detail')})") from e


def verify(path: Path) -> None:
    """Checks every record's CRC-32 in the checkpoint's zip archive (see the module doc)."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable ({type(e).__name__}: "
                              f"{e})") from None
    if bad is not None:
        raise CheckpointError(f"checkpoint {path}: damaged (checksum mismatch in {bad})")


STEP_FILE = re.compile(r"step-(\d+)\.pt")


def step_files(folder: Path) -> List[Path]:
    """The periodic checkpoints in `folder`, oldest first by their step (a number, not the
    name: past 8 digits the names no longer sort): `step-<digits>.pt` only, so that a file of
    the user's beside them (`step-00000046-keep.pt`) is neither counted nor removed."""
    found = [(int(m.group(1)), p) for p in Path(folder).glob("step-*.pt")
             for m in [STEP_FILE.fullmatch(p.name)] if m]
    return [p for _, p in sorted(found)]


# what a training state must hold to be resumed as the same run, and what each must be
_RESUMED = {"optimizer": dict, "scheduler": dict, "epoch": int, "step": int, "position": int,
            "world_size": int, "rng": list, "config": dict}


def resumable(state: Dict[str, Any], path: Path) -> Dict[str, Any]:
    """`state`, if it is a whole training state this version can resume: its format, every
    piece a resume restores, counts that are counts. CheckpointError naming the field."""
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format_version {version!r}, this version of "
                              f"Stoker reads {FORMAT_VERSION}")
    for key, kind in _RESUMED.items():
        if key not in state:
            raise CheckpointError(f"checkpoint {path}: incomplete, no '{key}' (a training "
                                  "state saved by Stoker holds it)")
        value = state[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"checkpoint {path}: '{key}' is {type(value).__name__}, "
                                  f"not {kind.__name__}")
        if kind is int and value < (1 if key == "world_size" else 0):
            raise CheckpointError(f"checkpoint {path}: '{key}' is {value}, not a count")
    return state


# How an optimizer computes (this run's optim.fused / optim.foreach), not what it has learned:
# Optimizer.load_state_dict takes them from the checkpoint's parameter groups
IMPLEMENTATION = ("fused", "foreach", "capturable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Dict[str, Any]) -> None:
    """`optimizer.load_state_dict(state)`, keeping this run's implementation choices (fused,
    foreach, capturable) instead of the checkpoint's, with each step count tensor where a new
    optimizer of this run would make it: on the parameter's device as float32 when fused or
    capturable, else on the CPU (torch's optimizers read a CPU step count on any device).
    (An fp16 run's checkpoint of a per-parameter AdamW resumed with optim.fused=true otherwise
    ran the unfused step with the GradScaler's fused-path arguments and stopped with an
    AssertionError.)"""
    chosen = [{k: g[k] for k in IMPLEMENTATION if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, flags in zip(optimizer.param_groups, chosen):
        group.update(flags)
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if not isinstance(step, torch.Tensor):
                continue
            if on_device and (step.device != p.device or step.dtype != torch.float32):
                optimizer.state[p]["step"] = step.to(p.device, torch.float32)
            elif not on_device and step.device.type != "cpu":
                optimizer.state[p]["step"] = step.to("cpu")


def tensors_in(obj: Any) -> List[torch.Tensor]:
    """Every tensor inside nested dicts, lists, tuples and dataclasses (map_tensors' walk)."""
    found: List[torch.Tensor] = []
    each_tensor(obj, found.append)
    return found


def state_bytes(obj: Any) -> int:
    """The bytes of every tensor inside a (nested) state."""
    return nbytes(tensors_in(obj))


def to_cpu(obj: Any) -> Any:
    """A copy of `obj` whose tensors are detached CPU clones (safe to write later)."""
    return map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))

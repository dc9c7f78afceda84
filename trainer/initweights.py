"""trainer.init_from: a new run's model weights from a file, and nothing else of a run.

Fine-tuning starts from trained weights with a fresh optimizer, schedule, step count and data
order; `trainer.resume` is the other thing (it continues a training state). The file may be a
Stoker checkpoint (its `model`), a state dict saved with `torch.save(model.state_dict(), path)`
(also one under a `state_dict`, `model_state_dict` or `model` key, as other trainers save
them), or a `.safetensors` file. Keys saved from a DDP/DataParallel wrapper (`module.`) or a
compiled module (`_orig_mod.`) are matched without that prefix.

Every key must fit (`trainer.init_strict=true`): a missing, unexpected or reshaped tensor is one
line naming them, before anything is trained. With `init_strict=false` the tensors that fit in
name and shape are loaded and the rest is said (a new classifier head keeps its
initialisation). Where the run resumes from a checkpoint, its weights win and the file is not
read: a requeued fine-tuning job continues its own run.
"""
from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any, Dict, Mapping, Tuple

import torch
from torch import nn

from trainer.checkpoint import CheckpointError, mismatches, read, said_mismatches

# where trainers keep a model's weights inside a saved dict of their own
_CONTAINERS = ("model", "state_dict", "model_state_dict")
# prefixes that wrappers put before a module's own keys
_WRAPPERS = ("module.", "_orig_mod.")


def init_weights(model: nn.Module, init_from: str, strict: bool) -> str:
    """Loads the weights in the file `init_from` names into `model` (the user's own module)
    and returns the line that says what was loaded; CheckpointError, with the model untouched,
    for a file that cannot be read, holds no weights, or does not fit."""
    path = Path(init_from)
    key = f"trainer.init_from={init_from}"
    if not path.is_file():
        what = "a directory, not a file" if path.is_dir() else "no such file"
        raise CheckpointError(f"{key}: {what} (give a Stoker checkpoint, a torch.save'd state "
                              "dict or a .safetensors file)")
    own = model.state_dict()
    theirs, removed = _without_wrappers(_state_dict(path, key), own)
    misfits = mismatches(own, theirs)
    tied = _tied(own, misfits["missing"], set(theirs) - set(misfits["shape mismatch"]))
    misfits["missing"] = [k for k in misfits["missing"] if k not in tied]
    prefix = f" (read without the keys' '{removed}' prefix)" if removed else ""
    if strict and any(misfits.values()):
        raise CheckpointError(f"{key} does not fit this model{prefix}; "
                              f"{said_mismatches(misfits)}; trainer.init_strict=false loads "
                              "the tensors that fit and leaves the rest as initialised")
    unfit = set(misfits["unexpected"]) | set(misfits["shape mismatch"])
    fitting = {k: v for k, v in theirs.items() if k not in unfit}
    if not fitting:
        raise CheckpointError(f"{key}: none of its {len(theirs)} tensors fits this "
                              f"model{prefix}; {said_mismatches(misfits)}")
    model.load_state_dict(fitting, strict=False)
    line = (f"model weights from {path}: {len(fitting) + len(tied)} of {len(own)} tensors"
            + (f" ({_first(tied)}: tied to a loaded one)" if tied else "") + prefix)
    if any(misfits.values()):
        left = sorted(set(misfits["missing"]) | set(misfits["shape mismatch"]))
        line += (f"; left as initialised: {_first(left)}" if left else "") + (
            f"; not used from the file: {_first(misfits['unexpected'])}"
            if misfits["unexpected"] else "")
    return line + "; the optimizer, schedule and step count start fresh"


def _tied(own: Mapping[str, Any], missing, loaded) -> list:
    """The `missing` keys whose tensor is one that a `loaded` key also names (a tied output
    layer and embedding: Hugging Face files store the pair once), which loading fills."""
    def ptr(value: Any) -> int:
        return value.data_ptr() if isinstance(value, torch.Tensor) and value.numel() else 0

    shared = {ptr(own[k]) for k in loaded if k in own} - {0}
    return [k for k in missing if ptr(own[k]) in shared]


def _first(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")


def _state_dict(path: Path, key: str) -> Dict[str, Any]:
    """The weights the file holds, as a state dict (see the module doc for the layouts)."""
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(f"{key}: reading a .safetensors file needs the safetensors "
                                  "package (pip install safetensors)") from None
        try:
            return load_file(str(path), device="cpu")
        except Exception as e:  # noqa: BLE001  (its Rust side raises its own types)
            raise CheckpointError(f"{key}: unreadable ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None
    archive = zipfile.is_zipfile(path)  # what torch.save writes (since torch 1.6)
    try:  # (memory-mapped where torch can: a large file is not read twice into memory)
        found = read(path, "cpu", mmap=archive)
    except CheckpointError as e:
        if not archive:  # (a text file's unpickling error would be torch's long advice)
            raise CheckpointError(f"{key}: not a file torch.save wrote (no zip archive) nor "
                                  "a .safetensors file") from None
        raise CheckpointError(f"trainer.init_from: {e}") from None
    if isinstance(found, Mapping) and "format_version" in found and "model" in found:
        found = found["model"]  # a Stoker checkpoint
    elif isinstance(found, Mapping) and not _is_weights(found):
        inner = [k for k in _CONTAINERS if _is_weights(found.get(k))]
        if inner:
            found = found[inner[0]]
    if not _is_weights(found):
        held = (f"a dict of {_first(map(str, found))}" if isinstance(found, Mapping)
                else f"a {type(found).__name__}")
        raise CheckpointError(f"{key}: holds no model weights ({held}); give a Stoker "
                              "checkpoint, a state dict saved with torch.save(model.state_dict()"
                              ", path), one under a 'state_dict', 'model_state_dict' or 'model' "
                              "key, or a .safetensors file")
    return dict(found)


def _is_weights(obj: Any) -> bool:
    """Whether `obj` looks like a state dict: string keys, and tensors among its values."""
    return (isinstance(obj, Mapping) and bool(obj) and all(isinstance(k, str) for k in obj)
            and any(isinstance(v, torch.Tensor) for v in obj.values()))


def _without_wrappers(theirs: Dict[str, Any], own: Mapping[str, Any]
                      ) -> Tuple[Dict[str, Any], str]:
    """`theirs` with a wrapper's prefix taken off every key, where each key has it and none
    is one of the model's own as it is; and the prefixes taken ('' for none)."""
    removed = []
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPERS:
            if theirs and not set(theirs) & set(own) and all(k.startswith(prefix)
                                                             for k in theirs):
                theirs = {k[len(prefix):]: v for k, v in theirs.items()}
                removed.append(prefix)
                changed = True
    return theirs, "".join(removed)

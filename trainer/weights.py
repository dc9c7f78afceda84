"""Model weights from files: whether a state dict fits a model (`mismatches`, said with both
shapes), a resumed checkpoint's model checked before it is loaded (`check_model_state`), and
trainer.init_from (`init_weights`): a new run's model weights from a file, and nothing else of
a run.

Fine-tuning starts from trained weights with a fresh optimizer, schedule, step count and data
order; `trainer.resume` is the other thing (it continues a training state). The file may be a
Stoker checkpoint (its `model`), a state dict saved with `torch.save(model.state_dict(), path)`
(also one under a `state_dict`, `model_state_dict` or `model` key, as other trainers save
them), or a safetensors file; which one is told from its bytes, not its name. A torch.save
archive's checksums are checked before it is read, as a checkpoint's are. Keys saved from a
DDP/DataParallel wrapper (`module.`), a compiled module (`_orig_mod.`) or a wrapper of one's
own (a LightningModule saves `model.`) are matched without that prefix; where the file holds
other keys beside that one subtree (a loss's buffers under `criterion.`), they are left out
and named.

Every key must fit (`trainer.init_strict=true`): a missing, unexpected or reshaped tensor is one
line naming them, before anything is trained. With `init_strict=false` the tensors that fit in
name and shape are loaded and the rest is said (a new classifier head keeps its
initialisation). Where the run resumes from a checkpoint, its weights win and the file is not
read: a requeued fine-tuning job continues its own run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from trainer.config import first_line
from trainer.checkpoint import CheckpointError, checkpoints_in, nearby, read, verify

# where trainers keep a model's weights inside a saved dict of their own
_CONTAINERS = ("model", "state_dict", "model_state_dict")
# prefixes that wrappers put before a module's own keys
_WRAPPERS = ("module.", "_orig_mod.")
_GIVE = "give a Stoker checkpoint, a torch.save'd state dict or a .safetensors file"


def check_model_state(model: torch.nn.Module, state: Dict[str, Any], path: Path) -> None:
    """Refuses weights that do not fit `model` with a list of mismatches (never a partial
    load)."""
    own = model.state_dict()
    misfits = mismatches(own, state["model"])
    if any(misfits.values()):
        raise CheckpointError(f"checkpoint {path} does not fit this model; "
                              + said_mismatches(misfits, own, state["model"]))


def mismatches(own: Dict[str, Any], theirs: Dict[str, Any]) -> Dict[str, List[str]]:
    """The keys of a model's state dict (`own`) that another (`theirs`) lacks ('missing'), the
    ones it has on top ('unexpected'), the ones with another shape ('shape mismatch'), and of
    the same shape, the ones of another kind of number or layout ('type mismatch': integers
    for floating weights were cast, zeros for the most part; a sparse tensor was
    load_state_dict's traceback; float16 for float32 is cast, and fits)."""
    both = set(own) & set(theirs)
    shapes = sorted(k for k in both if _dims(own[k]) != _dims(theirs[k]))
    return {"missing": sorted(set(own) - set(theirs)),
            "unexpected": sorted(set(theirs) - set(own)),
            "shape mismatch": shapes,
            "type mismatch": sorted(k for k in both - set(shapes)
                                    if _number_kind(own[k]) != _number_kind(theirs[k]))}


def _number_kind(value: Any) -> Any:
    """A tensor's layout and kind of number (floating, complex, bool, integer)."""
    if not isinstance(value, torch.Tensor):
        return None
    return (value.layout, value.is_floating_point(), value.is_complex(),
            value.dtype == torch.bool)


def said_mismatches(misfits: Dict[str, List[str]], own: Dict[str, Any],
                    theirs: Dict[str, Any]) -> str:
    """`mismatches` in words: the first five keys of each kind, and how many more; a shape
    mismatch with both shapes (the file's, then the model's)."""
    def dims(value: Any) -> str:
        if not isinstance(value, torch.Tensor):
            return type(value).__name__
        return "x".join(map(str, value.shape)) or "a scalar"

    def kind(value: Any) -> str:
        layout = "" if value.layout == torch.strided else f"{str(value.layout)[6:]} "
        return layout + str(value.dtype)[6:]

    def shown(name: str, key: str) -> str:
        if name == "type mismatch":
            return f"{key} ({kind(theirs[key])} in the file, {kind(own[key])} in the model)"
        if name != "shape mismatch":
            return key
        return f"{key} ({dims(theirs[key])} in the file, {dims(own[key])} in the model)"

    return "; ".join(f"{name}: " + _first(keys, lambda k, name=name: shown(name, k))
                     for name, keys in misfits.items() if keys)


def init_weights(model: nn.Module, init_from: str, strict: bool, training: bool = True) -> str:
    """Loads the weights in the file `init_from` names into `model` (the user's own module)
    and returns the line that says what was loaded; CheckpointError, with the model untouched,
    for a file that cannot be read, holds no weights, or does not fit. `training=False`
    (trainer.validate_only): a misfit is not offered init_strict=false (a model partly as
    initialised is no validation of the file), and nothing else starts."""
    path = Path(init_from)
    key = f"trainer.init_from={init_from}"
    path = _one_weights_file(path)
    if not path.is_file():
        raise CheckpointError(f"{key}: {_not_a_file(path)}")
    own = model.state_dict()
    theirs, removed, left_out = _without_wrappers(_state_dict(path, key), own, key)
    misfits = mismatches(own, theirs)
    tied = _tied(own, misfits["missing"], set(theirs) - set(misfits["shape mismatch"]))
    misfits["missing"] = [k for k in misfits["missing"] if k not in tied]
    prefix = "" if not removed else (
        f" (read without the keys' '{removed}' prefix)" if not left_out else
        f" (read from its keys under '{removed}'; left out: {_first(left_out)})")
    said = said_mismatches(misfits, own, theirs)
    if strict and any(misfits.values()):
        way = ("trainer.init_strict=false loads the tensors that fit and leaves the rest as "
               "initialised" if training else "trainer.validate_only validates the file's "
               "model as it is: give the model and data settings its run had")
        raise CheckpointError(f"{key} does not fit this model{prefix}; {said}; {way}")
    unfit = set(misfits["unexpected"]) | set(misfits["shape mismatch"]) | set(
        misfits["type mismatch"])
    fitting = {k: v for k, v in theirs.items() if k not in unfit}
    if not fitting:
        raise CheckpointError(f"{key}: none of its {len(theirs)} tensors fits this "
                              f"model{prefix}; {said}")
    model.load_state_dict(fitting, strict=False)
    line = (f"model weights from {path}: {len(fitting) + len(tied)} of {len(own)} tensors"
            + (f" ({_first(tied)}: tied to a loaded one)" if tied else "") + prefix)
    if any(misfits.values()):
        left = sorted(set(misfits["missing"]) | set(misfits["shape mismatch"])
                      | set(misfits["type mismatch"]))
        line += (f"; left as initialised: {_first(left)}" if left else "") + (
            f"; the file's keys the model lacks: {_first(misfits['unexpected'])}"
            if misfits["unexpected"] else "")
    return line + ("; the optimizer, schedule and step count start fresh" if training else "")


PRETRAINED_FILES = ("model.safetensors", "pytorch_model.bin")  # save_pretrained's one file


def _one_weights_file(path: Path) -> Path:
    """A Hugging Face save_pretrained folder's one weights file, where `path` is such a
    folder (one of PRETRAINED_FILES, no shards' index, no checkpoint of a run's); `path`
    otherwise."""
    if not path.is_dir() or checkpoints_in(path) or \
            any(path.glob("*.index.json")):
        return path
    found = [path / name for name in PRETRAINED_FILES if (path / name).is_file()]
    return found[0] if len(found) == 1 else path


def _not_a_file(path: Path) -> str:
    """Why `path` is not a weights file, and which file nearby would be."""
    if path.is_dir():
        found = checkpoints_in(path) + [p for p in (path / "model.safetensors",)
                                        if p.is_file()]
        near = (f"; it holds {', '.join(map(str, found[:2]))}" if found else
                "; for a Hugging Face save_pretrained folder of several files, load the model "
                "with model._target_=<class>.from_pretrained "
                "+model.pretrained_model_name_or_path=<folder>"
                if (path / "model.safetensors.index.json").is_file() else "")
        return f"a directory, not a file{near} ({_GIVE})"
    if path.exists():  # (neither a file nor a folder)
        return f"not a regular file (a device, a pipe or a socket; {_GIVE})"
    return f"no such file{nearby(path)}"


def _kind(path: Path) -> str:
    """'zip' (torch.save's archive), 'legacy' (its format before torch 1.6), 'safetensors',
    'index' (a sharded save's index) or 'other' (not a weights file), told from the bytes."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return "zip"
    if head[:1] == b"\x80":  # a pickle's protocol mark: torch.save's legacy format
        return "legacy"
    if len(head) == 9 and head[8:9] == b"{" and \
            int.from_bytes(head[:8], "little") < path.stat().st_size:
        return "safetensors"  # (an 8-byte header length, then the JSON header)
    if head[:1] == b"{" and path.name.endswith(".index.json"):
        return "index"
    return "other"


def _state_dict(path: Path, key: str) -> Dict[str, Any]:
    """The weights the file holds, as a state dict (see the module doc for the layouts)."""
    try:
        kind = _kind(path)
    except OSError as e:  # (unreadable, or gone since the check: another run's keep_last)
        raise CheckpointError(f"{key}: cannot be read ({e.strerror})") from None
    if kind == "safetensors":
        return _safetensors(path, key)
    if kind == "index":
        raise CheckpointError(f"{key}: the index of a sharded save (init_from reads one file); "
                              "load such a model with model._target_=<class>.from_pretrained "
                              "+model.pretrained_model_name_or_path=<its folder>")
    try:
        if kind == "zip":
            verify(path)  # (every record's checksum: a flipped bit is said, not loaded)
        found = read(path, "cpu", mmap=kind == "zip", refused="save the weights alone "
                     "instead: torch.save(model.state_dict(), path)")
    except CheckpointError as e:
        if kind == "other":  # (a text file's unpickling error would be torch's long advice)
            raise CheckpointError(f"{key}: not a file torch.save wrote nor a safetensors "
                                  "file") from None
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


def _safetensors(path: Path, key: str) -> Dict[str, Any]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise CheckpointError(f"{key}: reading a safetensors file needs the safetensors "
                              "package (pip install safetensors)") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # noqa: BLE001  (its Rust side raises its own types)
        raise CheckpointError(f"{key}: a damaged safetensors file ({type(e).__name__}: "
                              f"{first_line(e, empty='no detail')})") from None


def _is_weights(obj: Any) -> bool:
    """Whether `obj` looks like a state dict: string keys, and tensors among its values."""
    return (isinstance(obj, Mapping) and bool(obj) and all(isinstance(k, str) for k in obj)
            and any(isinstance(v, torch.Tensor) for v in obj.values()))


def _without_wrappers(theirs: Dict[str, Any], own: Mapping[str, Any], key: str
                      ) -> Tuple[Dict[str, Any], str, List[str]]:
    """`theirs` with a wrapper's prefix taken off its keys, where none is one of the model's
    own as it is; the prefixes taken ('' for none); and the keys left out. A known wrapper's
    prefix (every key has it) always goes; another one-name prefix only where keys without it
    are the model's: a LightningModule's `model.`, with the keys outside it (its loss's
    buffers, under `criterion.`) left out. CheckpointError where two such subtrees fit (a
    model and its EMA copy): which one is meant cannot be told."""
    removed: List[str] = []
    left_out: List[str] = []
    while theirs and not set(theirs) & set(own):
        heads = sorted({k.split(".", 1)[0] + "." for k in theirs if "." in k})
        under = {h: {k[len(h):]: v for k, v in theirs.items() if k.startswith(h)}
                 for h in heads}
        # (a subtree fits by its tensors of the model's names and shapes: a distilled
        # student's beside its wider teacher, whose names are the same)
        score = {h: sum(k in own and _dims(v) == _dims(own[k]) for k, v in under[h].items())
                 for h in heads}
        named = [h for h in heads if set(under[h]) & set(own)]
        best = [h for h in heads if score[h] and score[h] == max(score.values())]
        fits = best if best else named
        if len(heads) == 1 and len(under[heads[0]]) == len(theirs) and \
                (heads[0] in _WRAPPERS or named):
            first = heads[0]  # (a known wrapper's may hold one more: `_orig_mod.module.`)
        elif len(fits) == 1:
            first = fits[0]
            left_out += ["".join(removed) + k for k in theirs if not k.startswith(first)]
        elif len(fits) > 1:
            raise CheckpointError(f"{key}: the keys under {' and '.join(map(repr, fits))} "
                                  "each fit this model, and which one is meant cannot be "
                                  "told; save the one meant alone: "
                                  "torch.save(module.state_dict(), path)")
        else:
            break
        theirs = under[first]
        removed.append(first)
    return theirs, "".join(removed), left_out


def _dims(value: Any) -> Optional[tuple]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _tied(own: Mapping[str, Any], missing, loaded) -> list:
    """The `missing` keys whose tensor is one that a `loaded` key also names (a tied output
    layer and embedding: Hugging Face files store the pair once), which loading fills."""
    def ptr(value: Any) -> int:
        return value.data_ptr() if isinstance(value, torch.Tensor) and value.numel() else 0

    shared = {ptr(own[k]) for k in loaded if k in own} - {0}
    return [k for k in missing if ptr(own[k]) in shared]


def _first(keys, show: Callable[[str], str] = str) -> str:
    """The first five of `keys` in sorted order, each as `show` gives it, and how many more."""
    keys = sorted(keys)
    return ", ".join(map(show, keys[:5])) + (f" (+{len(keys) - 5} more)" if len(keys) > 5
                                             else "")


def not_read_line(init_from: str, state: Dict[str, Any], path: Path,
                  run_dir_key: str) -> Tuple[str, bool]:
    """What a resumed run says of the `init_from` it does not read, and whether it is a
    warning: the checkpoint's run started from another file (or from none), so the run dir
    may not be the run meant."""
    theirs = ((state.get("config") or {}).get("trainer") or {}).get("init_from")
    if theirs is not None and Path(theirs).resolve() == Path(init_from).resolve():
        return f"trainer.init_from={init_from} not read: the resumed run's weights continue it", \
            False
    started = f"from {theirs}" if theirs else "from its own initialisation (no init_from)"
    return (f"trainer.init_from={init_from} not read: resuming {path}, whose run started "
            f"{started}; if that is not the run meant, name the right one's dir "
            f"({run_dir_key})"), True

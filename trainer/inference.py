"""load_model: a run's model with a checkpoint's weights, for use outside Stoker (inference,
evaluation of one's own, export)."""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from omegaconf import OmegaConf

from trainer import components
from trainer.checkpoint import CheckpointError, load
from trainer.config import ConfigError


def load_model(path: Union[str, Path], device: Union[str, torch.device] = "cpu"
               ) -> torch.nn.Module:
    """The model a Stoker checkpoint (`last.pt`, `best.pt`, `step-*.pt`) holds: built from the
    run's config kept in the file as the run built it (`data.input_shape` and
    `data.num_classes` offered where its `_target_` takes them), with the file's weights, on
    `device`, in eval mode. The `_target_` must import as it did for the run (the same working
    folder, or its package on the path). CheckpointError for a file that is not a whole
    Stoker checkpoint (its checksums are checked first)."""
    state = load(Path(path), "cpu")
    cfg = OmegaConf.create(state.get("config") or {})
    if OmegaConf.select(cfg, "model._target_") is None:
        raise CheckpointError(f"checkpoint {path}: keeps no model config (model._target_) to "
                              "build the model from")
    d = cfg.get("data") or {}
    offered = {"input_shape": None if d.get("input_shape") is None else list(d.input_shape),
               "num_classes": d.get("num_classes")}
    model = components.build(cfg.model, "model", offered)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model._target_={cfg.model._target_}: builds a "
                          f"{type(model).__name__}, not a torch.nn.Module")
    model.load_state_dict(state["model"])
    return model.to(device).eval()

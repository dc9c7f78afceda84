"""load_model: a run's model with a checkpoint's weights, for use outside Stoker (inference,
evaluation of one's own, export)."""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from omegaconf import OmegaConf

from trainer import components
from trainer.checkpoint import CheckpointError, load


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
    model = components.build_model(cfg)
    model.load_state_dict(state["model"])
    return model.to(device).eval()

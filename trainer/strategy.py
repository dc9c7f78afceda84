"""How the model is replicated: single device, DistributedDataParallel, or DataParallel.

DDP (one process per device) is the default for multi-process jobs. DataParallel (one process
scattering each batch over all visible GPUs) is kept only as a comparison mode: its
single-process GIL and per-step replica broadcast are why DDP replaced it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ConfigError, DDPConfig, Strategy


# DDP's words for parameters that differ between the ranks (their count, a size)
_DIFFERENT = ("DDP expects same model across all ranks", "appears not to match sizes of the same")


def _lines(e: BaseException) -> str:
    return " ".join(str(e).split()).rstrip(".")[:200]


def wrap(model: nn.Module, strategy: Strategy, device: torch.device, ddp: DDPConfig) -> nn.Module:
    """Moves the model to `device` and wraps it for `strategy` (already resolved, never auto)."""
    if strategy == Strategy.ddp and ddp.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if strategy == Strategy.ddp:
        ids = [device.index] if device.type == "cuda" else None
        try:
            return DistributedDataParallel(
                model, device_ids=ids, bucket_cap_mb=ddp.bucket_cap_mb,
                gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters)
        except RuntimeError as e:  # DDP compares the ranks' parameters as it wraps
            if not any(words in str(e) for words in _DIFFERENT):
                raise
            raise ConfigError(f"model: the ranks built different models ({_lines(e)}); build "
                              "the same model on every rank (do its sizes depend on the rank, "
                              "or on randomness drawn before the seed is set?)") from None
    if strategy == Strategy.dp:
        return nn.DataParallel(model)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module, without DDP/DP wrappers (state_dict keys carry no `module.`)."""
    while isinstance(model, (DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model

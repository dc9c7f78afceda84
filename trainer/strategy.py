"""How the model is replicated: single device, DistributedDataParallel, or DataParallel.

DDP (one process per device) is the default for multi-process jobs. DataParallel (one process
scattering each batch over all visible GPUs) is kept only as a comparison mode: its
single-process GIL and per-step replica broadcast are why DDP replaced it.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Dict

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.config import ConfigError, DDPConfig, Strategy

log = logging.getLogger("stoker")


# DDP's words for parameters that differ between the ranks (their count, a size)
_DIFFERENT = ("DDP expects same model across all ranks", "appears not to match sizes of the same")


def _lines(e: BaseException) -> str:
    return " ".join(str(e).split()).rstrip(".")[:200]


def wrap(model: nn.Module, strategy: Strategy, device: torch.device, ddp: DDPConfig,
         deterministic: bool = False) -> nn.Module:
    """Moves the model to `device` and wraps it for `strategy` (already resolved, never auto).
    `deterministic` (trainer.deterministic): DDP sums each parameter's gradient on its own
    where the job has 3 ranks or more (`_bucket_per_parameter`)."""
    if strategy == Strategy.ddp and ddp.sync_batchnorm:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if strategy == Strategy.ddp:
        ids = [device.index] if device.type == "cuda" else None
        try:
            return DistributedDataParallel(
                model, device_ids=ids, bucket_cap_mb=ddp.bucket_cap_mb,
                gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters,
                **(_bucket_per_parameter() if deterministic else {}))
        except RuntimeError as e:  # DDP compares the ranks' parameters as it wraps
            if not any(words in str(e) for words in _DIFFERENT):
                raise
            raise ConfigError(f"model: the ranks built different models ({_lines(e)}); build "
                              "the same model on every rank (do its sizes depend on the rank, "
                              "or on randomness drawn before the seed is set?)") from None
    if strategy == Strategy.dp:
        return nn.DataParallel(model)
    return model


def _bucket_per_parameter() -> Dict[str, Any]:
    """DDP's arguments that put each parameter's gradient in a bucket of its own, in a job of
    3 ranks or more. DDP's first step of a process reduces all gradients as one bucket in the
    parameters' order, and later steps in buckets of the order the gradients came; an
    all-reduce over 3 ranks or more adds each element in an order its place in the bucket
    sets ((a + b) + c is not a + (b + c)), so a resumed run, whose process began at another
    step, drifted from the uninterrupted one in the last bits (2 ranks add a + b either way).
    One parameter a bucket, its sums are the same whatever the layout: more, smaller
    all-reduces (DDP's bucket_cap_mb_list; a torch without it: a warning)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 3:
        return {}
    if "bucket_cap_mb_list" not in inspect.signature(DistributedDataParallel).parameters:
        if dist.get_rank() == 0:
            log.warning("trainer.deterministic: this torch's DDP cannot put each gradient in a "
                        "bucket of its own (bucket_cap_mb_list), so a resumed run of %d ranks "
                        "may differ from an uninterrupted one in the last bits",
                        dist.get_world_size())
        return {}
    return {"bucket_cap_mb_list": [0]}


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module, without DDP/DP wrappers (state_dict keys carry no `module.`)."""
    while isinstance(model, (DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model

"""Settings and data every rank must share, agreed at start-up before any other collective:
ranks with other batch sizes or limits take other numbers of steps (gloo aborts the process on
the mismatched collective while NCCL hangs), ranks with another lr, model or split train
replicas that drift apart, ranks in another run dir resume from other checkpoints."""
from __future__ import annotations

import os
import zlib
from typing import Any, Dict

import torch
from omegaconf import DictConfig, OmegaConf

from trainer import argvalues, distributed
from trainer.config import ConfigError, plain
from trainer.resumechanges import flat


# settings every rank must share: the steps each takes and when, which samples (the sampler's
# seed and order), when the ranks meet (logging, validation, checkpoints, the sanity check),
# whether they train at all (validate_only), when they stop (early stopping) and how DDP
# buckets the gradients (deterministic: a bucket per gradient)
SHARED = ("seed", "data.batch_size", "data.eval_batch_size", "data.drop_last", "data.shuffle",
           "trainer.accumulate_grad_batches", "trainer.max_epochs", "trainer.max_steps",
           "trainer.limit_train_batches", "trainer.limit_val_batches",
           "trainer.overfit_batches", "trainer.val_every_n_epochs", "trainer.log_every_n_steps",
           "trainer.max_bad_steps", "trainer.precision", "trainer.save_checkpoint",
           "trainer.fast_dev_run", "trainer.resume", "trainer.compile.enabled",
           "trainer.checkpoint.every_n_steps", "trainer.checkpoint.every_n_epochs",
           "trainer.checkpoint.async_save", "trainer.checkpoint.monitor",
           "trainer.checkpoint.mode", "trainer.ddp.static_graph",
           "trainer.ddp.find_unused_parameters", "trainer.ddp.sync_batchnorm",
           "trainer.ddp.bucket_cap_mb", "trainer.validate_only", "trainer.sanity_check",
           "trainer.deterministic", "trainer.early_stopping.patience",
           "trainer.early_stopping.min_delta")


def same_settings_everywhere(cfg: DictConfig, device: torch.device) -> None:
    """Every rank must run with the same settings (an override that reads the rank's
    environment, `${oc.env:RANK}`, could give them different ones): ranks with different
    batch sizes or limits take different numbers of steps (gloo aborts the process on the
    mismatched collective while NCCL hangs), ranks with another lr, clipping, model or
    dataset split train replicas that drift apart, and ranks with another run dir resume from
    other checkpoints. Two small all-reduces at start-up, before any other collective of the
    run; ConfigError on every rank, naming the keys."""
    if distributed.world_size() == 1:
        return
    compared = _compared(cfg)
    keys = list(compared)
    # the same keys first (a list of another length on one rank): the values' all-reduce
    # needs as many on every rank
    shape = [float(len(keys)), float(zlib.crc32("\n".join(keys).encode()))]
    if len(set(map(tuple, distributed.spread(shape, device)))) > 1:
        raise ConfigError("the ranks run with different settings (other keys, or lists of "
                          "other lengths); every rank must have the same ones (an override "
                          "that reads the rank's environment?)")
    values = [float(v) if isinstance(v, (int, float)) and v == v else  # (bools too)
              float(zlib.crc32(repr(v).encode())) for v in compared.values()]  # (null, nan)
    low, high = distributed.spread(values, device)
    differ = [f"{key} ({lo:g} to {hi:g})" if argvalues.is_number(compared[key]) else key
              for key, lo, hi in zip(keys, low, high) if lo != hi]
    if differ == ["run_dir"]:  # (each node named its own: a static launch with no run id)
        raise ConfigError("the ranks run in different run dirs, and every rank reads the run's "
                          "checkpoints: name one on a filesystem every node shares with "
                          "hydra.run.dir=... (or launch torchrun with --rdzv-id)")
    if differ:
        raise ConfigError(f"the ranks run with different settings: {', '.join(differ)}; every "
                          "rank must have the same ones (an override that reads the rank's "
                          "environment?)")


# what the ranks' training computes, beside SHARED: every value but paths and addresses
# (which may differ between nodes: a node's own scratch folder)
SAME_MATH = ("model", "optim", "sched", "task", "trainer.grad_clip", "data.dataset",
             "data.train_dataset", "data.val_dataset", "data.augment", "data.normalize_mean",
             "data.normalize_std", "data.input_shape", "data.num_classes", "data.channels_last")


def _compared(cfg: DictConfig) -> Dict[str, Any]:
    """The settings every rank must share, by key: SHARED and the run dir (every rank reads
    its checkpoints) as they are, and the values under SAME_MATH but paths."""
    out: Dict[str, Any] = {}
    for key in (*SHARED, "run_dir"):
        v = OmegaConf.select(cfg, key)
        out[key] = getattr(v, "value", v)  # an enum's value
    for root in SAME_MATH:
        values = plain(OmegaConf.select(cfg, root), resolve=True)
        for key, v in flat(_lists_as_dicts(values), root).items():
            if not (isinstance(v, str) and (os.sep in v or "://" in v)):
                out[key] = v
    return out


def _lists_as_dicts(value: Any) -> Any:
    """Lists as {index: item}, so that `flat` reaches their items (hidden sizes, means)."""
    if isinstance(value, list):
        value = dict(enumerate(value))
    if isinstance(value, dict):
        return {str(k): _lists_as_dicts(v) for k, v in value.items()}
    return value


def same_data_everywhere(train_feed, val_feed, device: torch.device) -> None:
    """Every rank must have built datasets of the same lengths: the samplers cut one index
    range into shards, and ranks with different ones would take different numbers of steps
    (gloo aborts the process on the mismatched collective, NCCL hangs). One small all-reduce
    at start-up; ConfigError on every rank."""
    if distributed.world_size() == 1:
        return
    sizes = [len(train_feed.loader.dataset),
             len(val_feed.loader.dataset) if val_feed is not None else -1]
    for split, lo, hi in zip(("training", "validation"), *distributed.spread(sizes, device)):
        if hi != lo:
            raise ConfigError(
                f"data: the ranks built {split} sets of different lengths ({int(lo)} to "
                f"{int(hi)} samples); every rank must build the same dataset (one that reads "
                "RANK, or files that differ between nodes?)")

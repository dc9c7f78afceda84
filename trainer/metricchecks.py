"""The task's metrics tried before the first step: on a copy of each, given the first training
batch (and, where compute() failed on it, the sanity check's first validation batch too), so that
a metric that cannot take the task's inputs stops the run before its training, not at its first
validation after an epoch no checkpoint kept."""
from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from trainer import distributed
from trainer.config import first_line
from trainer.task import Task, TaskError, _note, describe

log = logging.getLogger("stoker")


def _collective_failed(e: BaseException) -> bool:
    """Whether `e` is a collective's failure (a peer gone mid-sync), not the code's own."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(
        word in text for word in ("/gloo/", "NCCL", "ProcessGroup")))


def check_metrics(task: Task, output: Any, batch: Any, compute: bool = True) -> None:
    """Every metric tried once, on the first training batch (a copy of it, whose state is
    thrown away): a metric that cannot take the task's inputs stops the run at its first
    step, not after the first epoch's training, at validation. A compute() that fails on
    one batch only warns: some need more samples than a batch has (R2 needs two).
    `compute=False`: updates alone (compute syncs over the ranks: a collective)."""
    if not task.metrics:
        return
    with torch.no_grad():
        preds, target = task._metric_pair(output, batch)
        preds = preds.detach() if isinstance(preds, torch.Tensor) else preds
        for name, metric in task.metrics.items():
            try:
                trial = copy.deepcopy(metric)
            except Exception:  # noqa: BLE001  (a metric that cannot be copied: validation
                continue  # tries it)
            task._update(name, trial, preds, target, trial=True)
            if not compute:
                continue
            try:
                task.compute_metric(name, trial)
            except TaskError:
                raise  # (not one number: so on the whole set too)
            except Exception as e:  # noqa: BLE001
                if _collective_failed(e):  # its sync over the ranks met a lost peer:
                    raise  # the run names that rank, not the metric
                if distributed.rank() == 0:  # (every rank meets it alike: said once)
                    log.warning("task.metrics.%s: %s.compute() failed on the first "
                                "training batch (%s: %s); validation computes it over the "
                                "whole set", name, type(metric).__name__, type(e).__name__,
                                first_line(e, empty=""))
                # (the same failure over the validation set names these inputs; the copy,
                # holding this batch, is given the sanity check's too: check_compute_again)
                task.__dict__.setdefault("_compute_failed", {})[name] = (
                    type(e), describe((preds, target)), trial)
    task.check_keys()  # (of those computed: the others at check_compute_again or validation)


def check_compute_again(task: Task, output: Any, batch: Any) -> None:
    """The metrics whose compute() failed on the first training batch, tried again once
    their copy holding that batch is given the first validation batch too (the sanity
    check's, before the first step; a metric that needs more samples than one batch has
    gets them): failing alike there, it would fail at the first validation, after an
    epoch of training that no checkpoint kept. Under several ranks, only metrics whose
    compute can be kept from syncing over them (torchmetrics'): a rank without a
    validation batch skips this, and must not be waited for."""
    failed = task.__dict__.get("_compute_failed", {})
    if not failed:
        return
    ranks = distributed.world_size() > 1
    with torch.no_grad():
        preds, target = task._metric_pair(output, batch)
        preds = preds.detach() if isinstance(preds, torch.Tensor) else preds
        for name in failed:
            metric, trial = task.metrics[name], failed[name][2]
            if ranks and not hasattr(metric, "sync_on_compute"):
                continue
            if hasattr(trial, "sync_on_compute"):
                trial.sync_on_compute = trial._to_sync = False
            task._update(name, trial, preds, target, trial=True)
            try:
                value = trial.compute()
            except Exception as e:
                if type(e) is not failed[name][0]:
                    continue  # (another failure: validation over the whole set decides)
                _note(e, f"stoker: task.metrics.{name}: {type(metric).__name__}.compute() "
                         "failed on the first training batch and again given the first "
                         "validation batch too, before the first step (this one "
                         f"{describe((preds, target))}): does the metric take these? (a "
                         "binary metric takes one score per sample, a multiclass one a "
                         "score per class); trainer.sanity_check=false leaves it to the "
                         "validation after the first epoch")
                raise
            task.values_of(name, metric, value)  # (its keys: for check_keys)
    task.check_keys()

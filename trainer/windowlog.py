"""A logging window's numbers (`log_window`): its sums over the ranks at its boundary (one
all-reduce, one host sync: none per step), added to the run's totals (`run_rates`), recorded in
metrics.jsonl and the progress bar, and the losses of its steps checked for being finite
(`check_finite`, trainer.max_bad_steps).
"""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Dict, Optional

import torch

from data.resident import rows_of
from trainer import distributed
from trainer.config import ConfigError
from trainer.feeds import skipped_files
from trainer.progress import Window

if TYPE_CHECKING:
    from trainer.loop import Loop


class NonFiniteLoss(RuntimeError):
    """The loss stayed NaN/inf for trainer.max_bad_steps optimizer steps."""


class OutOfMemory(RuntimeError):
    """A training or validation step ran out of memory (the host's or the GPU's): one line
    saying where and what to shrink (failure.out_of_memory)."""


def check_counted(loop: "Loop", samples: float, count: float, window_done: bool = True
                  ) -> None:
    """TaskError where the run's batches, over a whole epoch or the whole run, held samples
    and counted no unit for the loss to average over (every target ignored: labels all -100
    under task.count=tokens): the run trained on nothing (zero gradients) and logged NaN
    losses, exit 0. A batch of padding alone is fine (it weighs 0), and so is a first window
    of them. `samples` and `count`: every rank's, of a logging window (`window_done`) or of
    the current one so far."""
    if loop.counted:
        return
    if count > 0:
        loop.counted = True
        return
    if window_done:
        loop.uncounted_samples += samples
    samples = loop.uncounted_samples + (0 if window_done else samples)
    if not samples or not loop.whole_epoch_seen:
        return
    from trainer.task import TaskError  # (lazy: trainer.task imports this module's users)

    task = loop.task
    raise TaskError(
        f"task {getattr(task, 'label', type(task).__name__)}: the run's {loop.state.step} "
        f"optimizer steps so far counted nothing for the loss to average over, in "
        f"{int(samples)} samples: is every target ignored? ({type(task).__name__}.count(batch) "
        "was 0 for every batch; with task.count=tokens, labels of -100 are left out)")


def log_window(loop: "Loop", w: Window, epoch: int, grad_norm, bar) -> None:
    """Averages the window over ranks (one all-reduce, one host sync) and records it."""
    if loop.device.type == "cuda":
        torch.cuda.synchronize(loop.device)  # wall time must include queued GPU work
    wall = time.perf_counter() - w.start - w.paused_s
    # the loss sum read to the host, and a device count of tokens: the boundary's sync
    sums = [loop.ledger.take_loss_sum(), float(w.count), w.samples, w.wait_s, wall]
    device_wait = None if loop.device_wait is None else loop.device_wait.take_s()
    if device_wait is not None:  # (its events completed: synchronized above)
        sums.append(device_wait)  # every rank's device is of the same type
    if loop.world > 1:
        sums = distributed.all_reduce_sum(
            torch.tensor(sums, dtype=torch.float64, device=loop.device)).tolist()
    loss_sum, count, samples, wait_s, wall_sum = sums[:5]
    check_counted(loop, samples, count)
    world = loop.world
    loop.run_wait_s += w.wait_s
    loop.run_samples += int(samples)
    values = {"epoch": epoch, "loss": loss_sum / count if count else math.nan,
              "lr": loop.optimizer.param_groups[0]["lr"],
              "samples_per_s": samples / max(wall_sum / world, 1e-9),
              "data_wait_frac": wait_s / max(wall_sum, 1e-9)}
    if loop.tokens:  # (the count the loss sum is divided by: no other read)
        values["tokens_per_s"] = count / max(wall_sum / world, 1e-9)
        loop.run_tokens += int(count)
    if device_wait is not None:  # the GPU's idle time across the fetches
        values["device_wait_frac"] = sums[5] / max(wall_sum, 1e-9)
        loop.run_device_wait_s += device_wait
    if grad_norm is not None:
        values["grad_norm"] = float(grad_norm)
    if loop.precision.scaler is not None:
        values["skipped_steps"] = int(loop.precision.skipped_steps)  # fp16 overflow
    check_finite(loop)
    loop.last_train = {"train_loss": values["loss"]}
    loop.logger.metrics("train", loop.state.step, values)
    if bar is not None:
        bar.set_postfix(loss=f"{values['loss']:.4f}", sps=f"{values['samples_per_s']:.0f}",
                        wait=f"{100 * values['data_wait_frac']:.0f}%", refresh=False)


def check_finite(loop: "Loop", bad: Optional[int] = None) -> None:
    """NonFiniteLoss where the latest trainer.max_bad_steps optimizer steps of some rank had
    a loss that was not finite (a collective: every rank checks at the same boundary; `bad`:
    loop.bad_steps() where the caller has it already)."""
    bad = loop.bad_steps() if bad is None else bad
    if loop.cfg.max_bad_steps and bad >= loop.cfg.max_bad_steps:
        raise NonFiniteLoss(
            f"the loss was not finite for {bad} optimizer steps in a row (up to step "
            f"{loop.state.step}, trainer.max_bad_steps={loop.cfg.max_bad_steps}); stopped"
            + (empty_hint(loop, bad) or data_hint(loop)))


def empty_hint(loop: "Loop", bad: int) -> str:
    """Where the latest `bad` non-finite steps began right after a micro-batch of some rank
    that counted 0 units (task.count) with a loss that was not finite, on weights whose loss
    was finite before (`loop.bad_steps()` agreed it): that step, and why its gradients were
    NaN while its loss weighed 0 ("" otherwise)."""
    ago = loop.empty_nan_ago
    if ago is None or ago != bad:
        return ""
    return (f"; step {loop.state.step - ago}'s batch counted 0 units (task.count) and its loss "
            "was not finite, as a loss divided by its count is for an empty batch (0 / 0): "
            "its weight of 0 leaves the loss out, not the NaN gradients the weights took; "
            "return a finite loss there, e.g. divide by count.clamp(min=1)")


_SUSPECTS = " (NaN or inf values in the data? too high a learning rate?)"  # (data unread)


def data_hint(loop: "Loop") -> str:
    """Why a run's losses went non-finite, where its training data can tell: the NaN or inf
    values its tensors hold (arrays, a cache, device-resident data; up to 2**28 elements, read
    once, when the run stops), else the usual suspects. A NaN row in the data was said as a
    non-finite loss alone."""
    loader = loop.train_feed.loader
    tensors = getattr(loader, "tensors", None) or rows_of(loader.dataset)
    floats = [(i, t) for i, t in enumerate(tensors or ()) if t.is_floating_point()]
    if not floats or sum(t.numel() for _, t in floats) > 2**28:
        return _SUSPECTS
    try:  # (what it explains must not be lost to its own error: memory, say)
        bad = [(i, int((~torch.isfinite(t)).sum())) for i, t in floats]
    except (RuntimeError, MemoryError):
        return _SUSPECTS
    bad = [(i, n) for i, n in bad if n]
    if not bad:
        return (" (the training data holds no NaN or inf: too high a learning rate, optim.lr, "
                "or no gradient clipping, trainer.grad_clip?)")
    what = {0: "inputs", 1: "targets"}
    return ("; the training data holds " + " and ".join(
        f"{n} NaN or inf values in its {what.get(i, f'tensor {i}')}" for i, n in bad)
        + ": a batch holding one has a loss that is not finite")


def run_rates(loop: "Loop") -> Dict[str, float]:
    """The run's totals over its windows (and its validation and checkpoint time), as
    summary.json's `run_*` values."""
    train_s = max(loop.run_train_s, 1e-9)
    rates = {"run_samples_per_s": loop.run_samples / train_s,
             **({"run_tokens_per_s": loop.run_tokens / train_s} if loop.tokens else {}),
             "run_data_wait_frac": loop.run_wait_s / train_s,
             "run_train_s": loop.run_train_s, "run_data_wait_s": loop.run_wait_s,
             "run_val_s": loop.run_val_s, "run_checkpoint_s": loop.run_checkpoint_s}
    if loop.device_wait is not None:
        rates["run_device_wait_frac"] = loop.run_device_wait_s / train_s
    return rates


def check_read(loop: "Loop") -> None:
    """ConfigError on every rank when the run's steps so far read no sample and the
    datasets skipped files as unreadable (on_error=skip): a run on nothing. One small
    all-reduce (ranks decide alike); only while no logging boundary counted samples.
    Batches whose size cannot be told (a dataclass of one's own) count as read."""
    counts = torch.stack([torch.tensor(float(loop.window.samples), dtype=torch.float64,
                                       device=loop.device),
                          torch.tensor(float(len(skipped_files(loop.train_feed))),
                                       dtype=torch.float64, device=loop.device),
                          torch.as_tensor(loop.window.count, dtype=torch.float64,
                                          device=loop.device).reshape(())])
    if loop.world > 1:
        counts = distributed.all_reduce_sum(counts)
    samples, files, count = counts.tolist()
    if loop.run_samples + samples == 0 and files > 0:
        raise ConfigError(
            f"data: no training sample was read in {loop.state.step} optimizer steps: "
            f"every one of them was skipped as unreadable ({int(files)} files, "
            "data.dataset.on_error=skip); check the training files")
    check_counted(loop, samples, count, window_done=False)

"""fit / train_epoch / evaluate: the training loop, readable top to bottom.

Conventions: a *step* is an optimizer step; a *micro-batch* is one loader batch. With
`accumulate_grad_batches=k`, k micro-batches form a window; each micro-batch's loss is
weighted by its share of the window's samples, so k batches of b match one batch of k*b
(a short last batch or window included). Host syncs (`.item()`, all-reduce of metrics) happen
only at logging boundaries, never per step.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from data.prefetch import DevicePrefetcher
from trainer import distributed
from trainer.config import TrainerConfig
from trainer.logging import RunLogger
from trainer.precision import MixedPrecision
from trainer.strategy import sync_context, unwrap


@dataclass
class FitState:
    """Progress that a checkpoint must carry: the current epoch (= epochs completed),
    optimizer steps taken, and global samples of the current epoch already consumed."""

    epoch: int = 0
    step: int = 0
    position: int = 0


@dataclass
class Window:
    """Running sums over one logging window; read (with one sync) at a logging boundary."""

    loss_sum: Optional[torch.Tensor] = None
    samples: int = 0
    wait_s: float = 0.0
    start: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, n: int) -> None:
        contrib = loss.float() * n
        self.loss_sum = contrib if self.loss_sum is None else self.loss_sum + contrib
        self.samples += n


def batch_plan(num_samples: int, batch_size: int, drop_last: bool, limit: Optional[int],
               accumulate: int) -> List[Tuple[float, bool]]:
    """(loss weight, is optimizer-step boundary) for each micro-batch of one epoch on one rank."""
    sizes = [batch_size] * (num_samples // batch_size)
    if not drop_last and num_samples % batch_size:
        sizes.append(num_samples % batch_size)
    if limit is not None:
        sizes = sizes[:limit]
    plan = []
    for start in range(0, len(sizes), accumulate):
        window = sizes[start:start + accumulate]
        total = sum(window)
        plan += [(n / total, i == len(window) - 1) for i, n in enumerate(window)]
    return plan


def classification_loss(logits: torch.Tensor, target: torch.Tensor,
                        reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy in fp32 over (batch, classes) logits, or over every position of
    (batch, tokens, vocabulary) logits with (batch, tokens) targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1),
                           reduction=reduction)


def epoch_plan(loader: DataLoader, limit: Optional[int],
               accumulate: int) -> List[Tuple[float, bool]]:
    """`batch_plan` for this rank's shard of `loader` in one epoch."""
    return batch_plan(len(loader.sampler), loader.batch_size, loader.drop_last, limit,
                      accumulate)


def steps_per_epoch(loader: DataLoader, limit: Optional[int], accumulate: int) -> int:
    return sum(1 for _, boundary in epoch_plan(loader, limit, accumulate) if boundary)


class NonFiniteLoss(RuntimeError):
    """The loss stayed NaN/inf for trainer.max_bad_steps optimizer steps."""


class NoEvents:
    """Loop events without checkpointing (the default)."""

    def after_step(self, loop) -> None:
        pass

    def after_epoch(self, loop, val) -> None:
        pass


class Loop:
    """Runs epochs of training and validation over already-built components."""

    def __init__(self, *, cfg: TrainerConfig, model: nn.Module, optimizer, scheduler,
                 precision: MixedPrecision, train_feed: DevicePrefetcher,
                 val_feed: DevicePrefetcher,
                 device: torch.device, logger: RunLogger, profiler, state: FitState,
                 train_limit: Optional[int], val_limit: Optional[int], events=None):
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.precision, self.device, self.logger, self.prof = precision, device, logger, profiler
        self.train_feed, self.val_feed = train_feed, val_feed
        self.state, self.train_limit, self.val_limit = state, train_limit, val_limit
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.run_wait_s = 0.0
        self.run_train_s = 0.0
        self.run_samples = 0
        self.last_train: Dict[str, Any] = {}
        self.last_val: Dict[str, Any] = {}
        self.events = events or NoEvents()
        self.loader_rng: Optional[torch.Tensor] = None  # loader generator at epoch start
        # non-finite guard, kept on the device: no host sync per step
        self.step_loss = torch.zeros((), device=device)
        self.bad_run = torch.zeros((), dtype=torch.int64, device=device)

    def losses_finite(self) -> bool:
        """False while the latest optimizer steps had a non-finite loss (one host sync)."""
        return int(self.bad_run) == 0

    def _done(self) -> bool:
        max_steps = self.cfg.max_steps
        return (max_steps > 0 and self.state.step >= max_steps) or \
            self.state.epoch >= self.cfg.max_epochs

    def fit(self) -> Dict[str, Any]:
        """Trains from `state` until max_epochs or max_steps; validates on schedule and last."""
        validated_at = None
        while not self._done():
            epoch = self.state.epoch
            if not self.train_epoch(epoch):
                break  # max_steps inside the epoch
            self.state.epoch, self.state.position = epoch + 1, 0
            val = None
            if self.state.epoch % self.cfg.val_every_n_epochs == 0 or self._done():
                val = self.evaluate(epoch)
                validated_at = self.state.step
            self.events.after_epoch(self, val)
        if validated_at != self.state.step:  # stopped mid-epoch, or resumed at the end
            self.evaluate(self.state.epoch if self.state.position else self.state.epoch - 1)
        return {"epochs": self.state.epoch, "steps": self.state.step,
                **self.last_train, **self.last_val, **self.run_rates()}

    def run_rates(self) -> Dict[str, float]:
        train_s = max(self.run_train_s, 1e-9)
        return {"run_samples_per_s": self.run_samples / train_s,
                "run_data_wait_frac": self.run_wait_s / train_s}

    def _start_epoch(self, epoch: int) -> Tuple[List[Tuple[float, bool]], int]:
        """Positions the sampler (mid-epoch after a resume); returns the plan and the
        global samples one batch on every rank consumes."""
        loader = self.train_feed.loader
        sampler = loader.sampler
        sampler.set_epoch(epoch)  # a new shuffle per epoch, identical on every rank
        per_batch = loader.batch_size * distributed.world_size()
        start = self.state.position
        if start:
            sampler.set_start(start)
        elif loader.generator is not None:  # its state before this epoch's iterator draws
            self.loader_rng = loader.generator.get_state()
        limit = self.train_limit
        if limit is not None:
            limit = max(0, limit - start // per_batch)
        return epoch_plan(loader, limit, self.cfg.accumulate_grad_batches), per_batch

    def train_epoch(self, epoch: int) -> bool:
        """This rank's (rest of the) epoch; False if max_steps stopped it on a step boundary."""
        self.model.train()
        plan, per_batch = self._start_epoch(epoch)
        window = Window()
        bar = self.logger.progress(len(plan), f"epoch {epoch}")
        batches = iter(self.train_feed)
        epoch_start = time.perf_counter()
        complete = True
        for i, (weight, boundary) in enumerate(plan):
            t0 = time.perf_counter()
            batch = next(batches)  # on the device already (copied on a side stream on CUDA)
            window.wait_s += time.perf_counter() - t0  # time the step stood waiting for data
            loss = self._micro_step(batch, weight, boundary)
            window.add(loss, len(batch[1]))
            self.step_loss = self.step_loss + loss.float()
            self.state.position += per_batch
            bar.update(1)
            if not boundary:
                continue
            log_now = (self.state.step + 1) % self.cfg.log_every_n_steps == 0
            grad_norm = self._optimizer_step(want_norm=log_now)
            if log_now:
                self._log_window(window, epoch, grad_norm, bar)
                window = Window()
            self.events.after_step(self)
            if self.cfg.max_steps > 0 and self.state.step >= self.cfg.max_steps:
                complete = i == len(plan) - 1
                break
        if window.samples:
            self._log_window(window, epoch, None, bar)
        bar.close()
        self.run_train_s += time.perf_counter() - epoch_start
        return complete

    def _micro_step(self, batch, weight: float, boundary: bool) -> torch.Tensor:
        inputs, target = batch
        with sync_context(self.model, boundary):
            with self.precision.autocast():
                loss = classification_loss(self.model(inputs), target)
            self.precision.backward(loss * weight)
        return loss.detach()

    def _optimizer_step(self, want_norm: bool) -> Optional[torch.Tensor]:
        finite = torch.isfinite(self.step_loss)
        self.bad_run = torch.where(finite, torch.zeros_like(self.bad_run), self.bad_run + 1)
        self.step_loss = torch.zeros((), device=self.device)
        norm = self.precision.step(self.optimizer, self.params, self.cfg.grad_clip, want_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # frees grads instead of writing zeros
        self.state.step += 1
        self.prof.step()
        return norm

    def _log_window(self, w: Window, epoch: int, grad_norm, bar) -> None:
        """Averages the window over ranks (one all-reduce, one host sync) and records it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # wall time must include queued GPU work
        wall = time.perf_counter() - w.start
        loss_sum = w.loss_sum if w.loss_sum is not None else torch.zeros((), device=self.device)
        stats = torch.stack([loss_sum.float().to(self.device), *(
            torch.tensor(v, dtype=torch.float32, device=self.device)
            for v in (w.samples, w.wait_s, wall))])
        loss_sum, samples, wait_s, wall_sum = distributed.all_reduce_sum(stats).tolist()
        world = distributed.world_size()
        self.run_wait_s += w.wait_s
        self.run_samples += int(samples)
        values = {"epoch": epoch, "loss": loss_sum / max(samples, 1),
                  "lr": self.optimizer.param_groups[0]["lr"],
                  "samples_per_s": samples / max(wall_sum / world, 1e-9),
                  "data_wait_frac": wait_s / max(wall_sum, 1e-9)}
        if grad_norm is not None:
            values["grad_norm"] = float(grad_norm)
        if self.precision.scaler is not None:
            values["skipped_steps"] = int(self.precision.skipped_steps)  # fp16 overflow
        self._check_finite()
        self.last_train = {"train_loss": values["loss"]}
        self.logger.metrics("train", self.state.step, values)
        bar.set_postfix(loss=f"{values['loss']:.4f}", sps=f"{values['samples_per_s']:.0f}",
                        wait=f"{100 * values['data_wait_frac']:.0f}%", refresh=False)

    def _check_finite(self) -> None:
        bad = int(self.bad_run)
        if self.cfg.max_bad_steps and bad >= self.cfg.max_bad_steps:
            raise NonFiniteLoss(
                f"the loss was not finite for {bad} optimizer steps in a row (up to step "
                f"{self.state.step}, trainer.max_bad_steps={self.cfg.max_bad_steps}); "
                "stopped with the last good checkpoint intact")

    @torch.no_grad()
    def evaluate(self, epoch: int) -> Dict[str, float]:
        """Exact loss and accuracy over the whole validation set (summed over ranks)."""
        model = unwrap(self.model)  # no DDP collectives in evaluation
        distributed.broadcast_buffers(model)  # every rank evaluates rank 0's BatchNorm stats
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for inputs, target in itertools.islice(self.val_feed, self.val_limit):
            with self.precision.autocast():
                logits = model(inputs)
            sums[0] += classification_loss(logits, target, reduction="sum")
            sums[1] += (logits.argmax(dim=-1) == target).sum()
            sums[2] += target.numel()
        loss_sum, correct, count = distributed.all_reduce_sum(sums).tolist()
        values = {"epoch": max(epoch, 0),
                  "val_loss": loss_sum / count if count else math.nan,
                  "val_acc": correct / count if count else math.nan}
        self.last_val = {"val_loss": values["val_loss"], "val_acc": values["val_acc"]}
        self.logger.metrics("val", self.state.step, values)
        self.logger.info("epoch %d step %d: val_loss %.4f val_acc %.4f", values["epoch"],
                         self.state.step, values["val_loss"], values["val_acc"])
        model.train()
        return values

"""fit / train_epoch / evaluate: the training loop, readable top to bottom (its validation pass:
trainer/validation.py; its logging windows' sums: trainer/windowlog.py).

Conventions: a *step* is an optimizer step; a *micro-batch* is one loader batch. With
`accumulate_grad_batches=k`, k micro-batches form a window. The loop never looks inside a batch:
the task (trainer/task.py) runs the model, computes the loss as a mean over `count` units
(samples, or valid tokens) and feeds the metrics. Each micro-batch adds its mean loss times its
count to the gradients, and at the window's end they are multiplied once so that every unit of
the window, on all ranks, weighs the same (`window_factor`): k micro-batches on N ranks give
the update of one batch of all of them (a short last batch or window, or padded tokens,
included). Host syncs (`.item()`, all-reduce of metrics) happen only at logging boundaries,
never per step.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from omegaconf import DictConfig, OmegaConf

from data.advice import queued_s
from data.prefetch import DevicePrefetcher
from trainer import checkpoint, devicewait, distributed, metricchecks, validation, windowlog
from trainer.callbacks import (Callback,  # (users import it here)
                               call_hook, callback_failed, callback_states,
                               load_callback_states)
from trainer.config import Precision, TrainerConfig
from trainer.firstbatch import (check_batch, check_count, check_input_shape, check_loss,
                                checked_forward, loss_failed)
from trainer.ledger import Ledger, window_factor
from trainer.logging import RunLogger
from trainer.precision import MixedPrecision
from trainer.progress import FitState, Window, rest_plan
from trainer.speed import cuda_graphs
from trainer.strategy import unwrap
from trainer.task import Task, TaskError, batch_size


class Loop:
    """Runs epochs of training and validation over already-built components.

    The loop is the run's training state: `state_dict()` holds every piece a resume needs
    (weights, optimizer, scheduler, GradScaler, progress) and `load_state_dict` puts it back,
    so checkpointing saves `{"train_state": loop}` without reaching into its attributes.
    """

    def __init__(self, *, cfg: TrainerConfig, model: nn.Module, task: Task, optimizer,
                 scheduler, precision: MixedPrecision, train_feed: DevicePrefetcher,
                 val_feed: Optional[DevicePrefetcher], device: torch.device, logger: RunLogger,
                 state: FitState, train_limit: Optional[int],
                 val_limit: Optional[int], callbacks: Sequence[Callback] = (),
                 input_shape: Optional[Sequence[int]] = None):
        # a plain dataclass: reading a DictConfig key costs ~10 us, and the hot loop reads several
        self.cfg: TrainerConfig = OmegaConf.to_object(cfg) if isinstance(cfg, DictConfig) else cfg
        self.model, self.task = model, task
        self.optimizer, self.scheduler = optimizer, scheduler
        self.precision, self.device, self.logger = precision, device, logger
        self.train_feed, self.val_feed = train_feed, val_feed
        self.state, self.train_limit, self.val_limit = state, train_limit, val_limit
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.world = distributed.world_size()
        self.run_wait_s = 0.0
        # on CUDA, the GPU's own idle time across the fetches (trainer/devicewait.py)
        self.device_wait = devicewait.for_device(device)
        self.run_device_wait_s = 0.0
        self.run_train_s = 0.0
        self.epoch_paused_s = 0.0  # the sanity check's time inside an epoch: not training's
        # the training thread's time queued for a CPU over its epochs (None: not known)
        self.run_queued_s: Optional[float] = 0.0
        self.run_samples = 0
        self.counted = False  # a training batch counted a unit for the loss (check_counted)
        self.uncounted_samples = 0.0  # ... the samples of the windows before it
        self.whole_epoch_seen = False  # the run trained an epoch, or ended
        self.val_read = False  # a validation of this run read a sample
        self.val_samples = 0  # the samples the latest validation read, over every rank
        self.val_failure_agreed = False  # a validation raised on every rank alike (a save meets)
        self.tokens = task.counts_tokens()  # the window's count is tokens: a rate of them too
        self.run_tokens = 0
        self.run_val_s = 0.0  # time in validation
        self.run_checkpoint_s = 0.0  # time the training thread spent in checkpoint saves
        self.last_train: Dict[str, Any] = {}
        self.last_val: Dict[str, Any] = {}
        self.callbacks = list(callbacks)
        self.phase = "training"  # training | validating | checkpointing: for the heartbeat
        # whether a preemption signal or a Ctrl-C came (the runner's Preemption): a validation
        # after training steps stops at its next batch, as a long one outlived the grace
        # period a scheduler gives (SLURM's 30 s) and lost the epoch's checkpoint
        self.stop_asked: Callable[[], bool] = lambda: False
        self.stopped_early: Optional[str] = None  # a callback's reason that ended the run
        self._forwarded = False  # no forward pass has succeeded yet
        self._loss_checked = False  # the first training loss was checked (firstbatch.check_loss)
        # the first validation batch, tried after the first training batch's backward
        self._sanity = cfg.sanity_check and val_feed is not None and not cfg.fast_dev_run
        self.input_shape = input_shape  # named when the first batch does not fit the model
        self.loader_rng: Optional[torch.Tensor] = None  # loader generator at epoch start
        self.epoch_end = 0  # the position the current epoch's last step reaches
        # losses and the non-finite guard, kept on the device: no host sync per step
        self._ddp = isinstance(model, DistributedDataParallel)
        self._autocast = None if precision.precision == Precision.fp32 else precision.autocast
        # a compiled model that replays CUDA graphs returns outputs its next replay overwrites
        self.replays = cuda_graphs(cfg.compile) and device.type == "cuda"
        self.ledger = Ledger(device, copy=self.replays, task=task)
        self.empty_nan_ago: Optional[int] = None  # (bad_steps' agreement; empty_hint reads it)
        self.window = Window()  # the current logging window

    def state_dict(self) -> Dict[str, Any]:
        """Everything of the training state but the random states (see resilience.capture)."""
        return {"model": unwrap(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.precision.state_dict(),
                "callbacks": callback_states(self.callbacks, self.state.step),
                **asdict(self.state),
                # the latest window row's values: a run resumed where only its last
                # validation was left has them for its summary
                "last_train": dict(self.last_train),
                # what the position counts into: a resume over a changed set says so
                "train_samples": len(self.train_feed.loader.dataset),
                # which files a drawn validation split holds out (ImageFolder.held_out)
                "held_out": getattr(getattr(self.val_feed, "source", None), "held_out", None)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores what `state_dict` saved (model weights already checked to fit)."""
        self.load_training_state(state)
        self.load_callback_states(state)

    def load_training_state(self, state: Dict[str, Any]) -> None:
        """The weights, optimizer, scheduler, GradScaler and progress of `state`."""
        unwrap(self.model).load_state_dict(state["model"])
        checkpoint.load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("scaler", {}))
        self.state = FitState(epoch=state["epoch"], step=state["step"],
                              position=state.get("position", 0),
                              validated_step=state.get("validated_step", -1))
        self.last_train = dict(state.get("last_train", {}))

    def load_callback_states(self, state: Dict[str, Any]) -> None:
        """The callbacks' own states of `state` (callbacks.load_callback_states)."""
        load_callback_states(self.callbacks, state.get("callbacks", {}), state.get("step", 0))

    def bad_steps(self) -> int:
        """Optimizer steps in a row with a non-finite loss, the most of any rank (a collective
        and one host sync: every rank must call it at the same step, so that all of them take
        the same branch afterwards, e.g. into a checkpoint's gather or not)."""
        ledger = self.ledger
        ledger.fold()
        # (and the step of an empty batch's NaN loss just before such a run, on any rank:
        # under DDP its NaN gradients reached every rank's weights; windowlog.empty_hint)
        ago = ledger.empty_nan_ago
        began = ago if ago is not None and ago == ledger.bad_run else -1
        bad = ledger.bad_run
        if self.world > 1:
            both = torch.tensor([bad, began], dtype=torch.int64, device=self.device)
            bad, began = distributed.all_reduce_max(both).tolist()
        self.empty_nan_ago = began if bad and began == bad else None
        return bad

    def reached_limit(self) -> bool:
        """Trained to trainer.max_epochs or trainer.max_steps."""
        max_steps = self.cfg.max_steps
        return (max_steps > 0 and self.state.step >= max_steps) or \
            0 < self.cfg.max_epochs <= self.state.epoch

    def complete(self) -> bool:
        """Nothing left to do: trained to max_epochs or max_steps, or stopped by a callback
        (early stopping), and validated there (a run resumed from its final checkpoint)."""
        return (self.reached_limit() or self.stop_reason() is not None) and \
            self.state.validated_step == self.state.step

    def stop_reason(self) -> Optional[str]:
        """Why a callback ends the run here (Callback.should_stop), or None; agreed over the
        ranks (one small all-reduce, where a callback defines should_stop): a rank that
        stopped alone would leave the others waiting in the next collective."""
        asked = [cb for cb in self.callbacks if type(cb).should_stop is not Callback.should_stop]
        if not asked:
            return None
        reason = None
        for callback in asked:
            reason = call_hook(callback, "should_stop", self.state.step, self)
            if reason:
                break
        if self.world > 1:
            flag = torch.tensor([0.0 if reason is None else 1.0], device=self.device)
            if distributed.all_reduce_max(flag).item() and reason is None:
                reason = "a callback on another rank asked to stop"
        return reason

    def fit(self) -> Dict[str, Any]:
        """Trains from `state` until max_epochs or max_steps, or until a callback's
        `should_stop` gives a reason (early stopping); validates on schedule and last."""
        self.window = Window()
        while True:
            # asked first: a stop at the epoch that reaches the limit is still said as one
            # (so is a run resumed where it stopped), as complete() and a resume see it
            self.stopped_early = self.stop_reason()
            if self.stopped_early:
                self.logger.info("stopping early %s step %d: %s", f"after epoch "
                                 f"{self.state.epoch - 1}" if self.state.epoch else
                                 "before the first epoch, at", self.state.step,
                                 self.stopped_early)
                break
            if self.reached_limit():
                break
            epoch = self.state.epoch
            steps_before = self.state.step
            if not self.train_epoch(epoch):
                break  # max_steps inside the epoch
            self.whole_epoch_seen = True
            if not self.run_samples and self.state.step > steps_before:
                windowlog.check_read(self)  # (until a logging boundary counted samples)
            self.state.epoch, self.state.position = epoch + 1, 0
            paused = time.perf_counter()
            last = self.reached_limit()  # the run's last epoch
            if last:  # its last window row, before its last validation: a signal stops that
                self._log_rest(epoch)  # one too, and loses nothing of the window (its sums
                # are not in the checkpoint)
            val = None
            if self.state.step == steps_before == self.state.validated_step and \
                    not last:  # (the run's last: validated, for its summary)
                # a resume whose position is past the epoch's batches (trainer.
                # limit_train_batches lowered): nothing trained since that step's validation,
                # which gave a second row for the step
                self.logger.info("epoch %d: nothing trained since step %d, validated then (the "
                                 "run's position is past this epoch's batches)", epoch,
                                 self.state.step)
            elif self.state.epoch % self.cfg.val_every_n_epochs == 0 or last:
                val = self._evaluate_trained(epoch, (epoch, self.epoch_end))
            for callback in self.callbacks:
                call_hook(callback, "after_epoch", self.state.step, self, val)
            self.window.paused_s += time.perf_counter() - paused
        self.whole_epoch_seen = True  # (the run's end)
        if not self.run_samples and self.window.steps:  # a run shorter than an epoch
            windowlog.check_read(self)
        self._log_rest(self.state.epoch - (0 if self.state.position else 1))
        if self.state.validated_step != self.state.step:  # stopped mid-epoch, or resumed
            # at the end before its validation
            self._evaluate_trained(self.state.epoch if self.state.position
                                   else self.state.epoch - 1,
                                   (self.state.epoch, self.state.position))
        return {"epochs": self.state.epoch, "steps": self.state.step,
                **({"stopped_early": self.stopped_early} if self.stopped_early else {}),
                **self.last_train, **self.last_val, **windowlog.run_rates(self)}

    def _log_rest(self, epoch: int) -> None:
        """The steps since the last logging boundary, as a row (a collective; none without
        such steps)."""
        if self.window.steps:
            windowlog.log_window(self, self.window, epoch, None, None)
            self.window = Window()

    def _evaluate_trained(self, epoch: int, back: Tuple[int, int]) -> Dict[str, float]:
        """`evaluate` after training steps: where it raises (a validation sample or metric
        that fails), the callbacks hear of it first (checkpointing saves the trained state,
        which went with the error before: an epoch's steps lost to a bad validation file).
        A signal stops it (validation.Stopped): the state is put back to where the last step
        left it (`back`: epoch and position) and the callbacks hear of it (checkpointing
        saves and raises Preempted): the resumed run validates before anything else. (The
        run's last one too: its window row is logged before it, and `last_train` is in the
        checkpoint for the resumed run's summary.)"""
        try:
            return self.evaluate(epoch, stop=self.stop_asked)
        except validation.Stopped:
            self.state.epoch, self.state.position = back
            for callback in self.callbacks:
                call_hook(callback, "validation_stopped", self.state.step, self)
            raise
        except Exception:
            for callback in self.callbacks:
                callback.validation_failed(self)
            raise

    def _start_epoch(self, epoch: int) -> Tuple[List[int], int]:
        """Positions the sampler (mid-epoch after a resume); returns the epoch's windows and
        the global samples one batch on every rank consumes."""
        loader = self.train_feed.loader
        sampler = loader.sampler
        sampler.set_epoch(epoch)  # a new shuffle per epoch, identical on every rank
        per_batch = loader.batch_size * distributed.world_size()
        if not self.state.position and loader.generator is not None:
            self.loader_rng = loader.generator.get_state()  # before this epoch's draws
        windows = rest_plan(loader, self.train_limit, self.cfg.accumulate_grad_batches,
                            self.state.position, per_batch)
        self.epoch_end = self.state.position + per_batch * sum(windows)
        return windows, per_batch

    def train_epoch(self, epoch: int) -> bool:
        """This rank's (rest of the) epoch; False if max_steps stopped it on a step boundary."""
        if not self.model.training:  # (a walk over every module: ~0.1 ms an epoch otherwise)
            self.model.train()
        windows, per_batch = self._start_epoch(epoch)
        planned = sum(windows)
        if not planned:  # resumed at its end: no loader pass, and no training time (a launch
            return True  # that trained nothing said "0 samples/s")
        done = self.state.position // per_batch  # (the batches before a mid-epoch resume)
        bar = self.logger.progress(done + planned, f"epoch {epoch}", done)
        epoch_start, queued = time.perf_counter(), queued_s()
        # (closed as an error leaves the epoch: its workers end then, not in the interpreter's
        # shutdown, where the traceback's frames kept the pass and its clean-up failed)
        with contextlib.closing(self.train_feed.take(planned)) as batches:  # none past the plan
            try:  # an error mid-epoch clears the bar's line too: its one line starts a line
                complete = self._epoch_steps(epoch, windows, batches, per_batch, bar)
            finally:
                bar.close()
        if self.device.type == "cuda":  # the epoch's queued GPU work is its time, not
            torch.cuda.synchronize(self.device)  # validation's (once an epoch)
        self.run_train_s += time.perf_counter() - epoch_start - self.epoch_paused_s
        self.epoch_paused_s = 0.0
        now = queued_s()
        self.run_queued_s = None if None in (now, queued, self.run_queued_s) else \
            self.run_queued_s + now - queued
        return complete

    def _epoch_steps(self, epoch: int, windows: List[int], batches, per_batch: int,
                     bar) -> bool:
        """The optimizer steps of `windows` (micro-batches each) over `batches`; False if
        max_steps stopped them before the last."""
        window = self.window  # logging windows run on across epochs: one row per N steps
        complete = True
        # the step's own work is a tiny step's overhead: names looked up once an epoch
        loader_batch, alone, state = self.train_feed.loader.batch_size, self.world == 1, self.state
        task, ledger, forward_backward, perf = (self.task, self.ledger, self._forward_backward,
                                                time.perf_counter)
        log_every, max_steps, callbacks = (self.cfg.log_every_n_steps, self.cfg.max_steps,
                                           self.callbacks)
        no_sync = self.model.no_sync if self._ddp else None
        waits = distributed.WAITING if self._ddp else None  # (DDP's all-reduce: a peer stuck
        # in its own code is told from the ranks waiting for it in a backward)
        device_wait = self.device_wait
        if device_wait is not None:
            device_wait.begin_epoch()
        for w, size in enumerate(windows):
            base, total = loader_batch * size, 0
            for i in range(size):
                t0 = perf()
                if device_wait is not None:
                    device_wait.before()
                batch = next(batches)  # on the device already (copied on a side stream on CUDA)
                if device_wait is not None:
                    device_wait.after()
                window.wait_s += perf() - t0  # the time the step stood waiting for data
                count = task.count(batch)
                if not self._loss_checked:  # the run's first batch: said in one line
                    check_count(task, count, batch)
                if size == 1 and alone and type(count) is int and count:
                    base = count  # the window is this batch (an epoch's short last one too):
                    # its mean loss, unweighted, as a plain loop steps (window_factor: None)
                if no_sync is not None and i < size - 1:  # inside the window: no all-reduce
                    with no_sync():
                        loss = forward_backward(batch, count / base)
                else:
                    loss = forward_backward(batch, count / base, waits)
                ledger.add(loss, count)
                total = total + count
                window.samples += batch_size(batch)
            ledger.end_step()
            window.count, window.steps = window.count + total, window.steps + 1
            state.position += per_batch * size
            bar.update(size)
            log_now = (state.step + 1) % log_every == 0
            grad_norm = self._optimizer_step(window_factor(total, base, self.world, self.device),
                                             want_norm=log_now)
            if log_now:
                windowlog.log_window(self, window, epoch, grad_norm, bar)
                window = self.window = Window()
            try:  # (free unless it raises)
                for callback in callbacks:
                    callback.after_step(self)
            except Exception as e:
                callback_failed(e, callback, "after_step", state.step)
                raise
            if max_steps > 0 and state.step >= max_steps:
                complete = w == len(windows) - 1
                break
        return complete

    def _forward_backward(self, batch, weight, waits: Optional[List[int]] = None
                          ) -> torch.Tensor:
        """Forward, loss and backward of one micro-batch (its gradients weighted by `weight`);
        returns the loss. `waits`: distributed.WAITING, counted up during a backward that
        all-reduces (DDP outside no_sync)."""
        output = None
        try:  # (free unless it raises)
            if self._autocast is None:  # fp32: no context to enter
                output = self._forward(batch)
                loss = self.task.loss(output, batch)
            else:
                with self._autocast():
                    output = self._forward(batch)
                    loss = self.task.loss(output, batch)
        except Exception as e:
            if not self._loss_checked and output is not None:  # (the forward passed)
                loss_failed(self.task, e, output, batch)
            raise
        first = not self._loss_checked
        if first:
            check_batch(self.task, batch)
            check_input_shape(self.task, batch, self.input_shape)
            check_loss(self.task, loss)
            metricchecks.check_metrics(self.task, output, batch)
            self._loss_checked = True
        output = None  # (held no longer than the graph holds it)
        # a full window of samples in one process weighs 1: no multiplication in the graph
        one = isinstance(weight, float) and weight == 1.0
        if waits is not None:
            waits[0] += 1
        try:
            self.precision.backward(loss if one else loss * weight)
        except RuntimeError:  # a later loss backward cannot start from (not 0-d, detached):
            try:  # the task's line, as for the first one, not autograd's traceback
                check_loss(self.task, loss)
            except TaskError as said:
                raise said from None
            raise
        finally:
            if waits is not None:
                waits[0] -= 1
        if first and self._sanity:  # after the training batch's own checks (a model that
            # takes no batch is said as training's) and its graph is freed; before any step
            self._sanity = False
            start = time.perf_counter()
            loss = validation.sanity_check(self, loss)
            # (a validation batch's time: not training's rate nor its data-wait share)
            spent = time.perf_counter() - start
            self.window.paused_s += spent
            self.epoch_paused_s += spent
        return loss

    def _forward(self, batch) -> Any:
        output = checked_forward(self.task, self.model, batch, not self._forwarded,
                                 self.input_shape, self.cfg.ddp.find_unused_parameters)
        self._forwarded = True
        return output

    def _optimizer_step(self, factor, want_norm: bool) -> Optional[torch.Tensor]:
        if factor is not None:  # see window_factor
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)
        norm = self.precision.step(self.optimizer, self.params, self.cfg.grad_clip, want_norm)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)  # frees grads instead of writing zeros
        self.state.step += 1
        return norm

    def evaluate(self, epoch: int, stop: Optional[Callable[[], bool]] = None
                 ) -> Dict[str, float]:
        """The loss (a mean over every counted unit) and the task's metrics over the whole
        validation set, exact on any world size; {} when there is no validation set
        (trainer/validation.py; `stop`: asked before each batch, validation.Stopped where
        it says so)."""
        return validation.evaluate(self, epoch, stop)

"""The validation pass: the loss, a mean over every counted unit, and the task's metrics over
the whole validation set, exact on any world size (each rank its shard, without padding; sums
all-reduced, metrics synced by their own state), under the training loop's precision."""
from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from data.prefetch import map_tensors
from trainer import distributed, liveness, metricchecks
from trainer.config import ConfigError
from trainer.feeds import skipped_files
from trainer.firstbatch import check_count, checked_forward
from trainer.ledger import counted
from trainer.strategy import unwrap
from trainer.task import batch_size

if TYPE_CHECKING:
    from trainer.loop import Loop


SANITY = "the first validation batch (trainer.sanity_check)"


class Stopped(Exception):
    """A validation after training steps that a preemption signal or a Ctrl-C stopped (on
    any rank: agreed at its sums), with no values; the loop's callbacks save and stop."""


class PeerFailedValidation(liveness.PeerLost):
    """This rank's validation shard passed and another rank's raised: the ranks agreed on it
    at the validation's sums, every one saved the trained state (Callback.validation_failed),
    and this one ends saying the other's error."""


@torch.no_grad()
def sanity_check(loop: "Loop", loss: torch.Tensor) -> torch.Tensor:
    """The first validation batch of this rank, through the model, the task's count and loss,
    and a copy of each metric, once the first training batch passed its own checks and its
    backward, before the first optimizer step (trainer.sanity_check): a validation split the
    model or the task cannot take (another dtype, shape or label range than training's) stops
    the run then, not after an epoch of training. Otherwise invisible: no collective (a rank
    with no validation batch skips it), no metric state kept, and the random states it could
    draw from (torch's, python's and numpy's: the model's, a dataset read in this process;
    the loader's worker seeds) put back. Returns the training batch's `loss`: a copy, with the
    gradients, where the model replays CUDA graphs, since the check's replay writes over what
    the training batch's replays handed over (the gradients, a loss the model returned)."""
    # (lazy: trainer.resilience imports the loop, which imports this module)
    from trainer.resilience import rng_state, set_rng_state

    if loop.replays:
        loss = loss.detach().clone()
        for p in loop.params:
            if p.grad is not None:
                p.grad = p.grad.clone()
    task, model, feed = loop.task, unwrap(loop.model), loop.val_feed
    generator = getattr(feed.loader, "generator", None)
    generator = generator if isinstance(generator, torch.Generator) else None
    gpus = [loop.device] if loop.device.type == "cuda" else []
    kept = rng_state(generator.get_state() if generator is not None else None, gpus)
    model.eval()
    phase, loop.phase = loop.phase, "sanity check"  # (a peer lost in it is said so)
    try:
        with contextlib.closing(feed.take(1)) as batches:
            for batch in batches:
                with loop.precision.autocast():
                    output = checked_forward(task, model, batch, True, loop.input_shape,
                                             find_unused=True, which=SANITY)
                    count = task.count(batch)
                    check_count(task, count, batch)
                    task.loss(output, batch)
                metricchecks.check_metrics(task, output, batch, compute=False)
                metricchecks.check_compute_again(task, output, batch)
    except ConfigError as e:  # the task's or a metric's line: say which split it met
        if "trainer.sanity_check" in str(e):
            raise
        raise type(e)(f"{e} (in {SANITY}; the training batches passed)") from None
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"stoker: in {SANITY}; the training batches passed")
        raise
    finally:
        model.train()
        loop.phase = phase
        set_rng_state(kept, generator, gpus)
    return loss


@torch.no_grad()
def evaluate(loop: "Loop", epoch: int,
             stop: Optional[Callable[[], bool]] = None) -> Dict[str, float]:
    """The loss (a mean over every counted unit) and the task's metrics over the whole
    validation set, exact on any world size; {} when there is no validation set.
    `stop` (`loop.stop_asked`: a signal or a Ctrl-C came), asked before
    each batch: where it is true, the rank stops reading its shard, and where any rank
    stopped, every one raises Stopped after the sums (the one collective every rank meets,
    whatever it read): the metrics' own collectives are not entered."""
    if loop.val_feed is None:
        loop.state.validated_step = loop.state.step
        return {}
    model = unwrap(loop.model)  # no DDP collectives in evaluation
    loop.phase = "validating"
    distributed.broadcast_buffers(model)  # every rank evaluates rank 0's BatchNorm stats
    model.eval()
    start = time.perf_counter()
    sums, failed = _agreed(loop, lambda: _shard_sums(loop, model, stop),
                           lambda: _failed_sums(loop))
    loss_sum, count, samples, files, failures, stopped = \
        distributed.all_reduce_sum(sums).tolist()
    _raise_agreed(loop, failures, failed)  # (every rank has the same sums: all decide alike)
    if stopped:
        loop.run_val_s += time.perf_counter() - start
        loop.logger.info("validation at step %d stopped by the signal, before its end",
                         loop.state.step)
        model.train()
        loop.phase = "training"
        raise Stopped(f"validation at step {loop.state.step} stopped by a signal")
    if samples == 0 and files > 0:  # (every rank has the same sums: all decide alike)
        line = ("no validation sample was read: every one was skipped as unreadable "
                f"({int(files)} files, data.dataset.on_error=skip)")
        if not loop.val_read:  # the run's first: the files, not a passing outage
            raise ConfigError(f"data: {line}; check the validation files")
        loop.logger.warning("data: validation at step %d: %s", loop.state.step, line)
    loop.val_read = loop.val_read or samples > 0
    loop.val_samples = int(samples)
    values, failed = _agreed(loop, lambda: _values(loop, loss_sum, count))
    # what decides best.pt must be the same on every rank: a metric that does not sync
    # its state would otherwise send ranks into different collectives. (One gather: rank
    # 0's values, and whether a rank's metric raised in its compute, after its sync.)
    gathered = distributed.all_gather_object((values, failed is not None))
    _raise_agreed(loop, any(f for _, f in gathered), failed)
    values = gathered[0][0]
    _say_unsynced(loop, [v for v, _ in gathered])
    loop.last_val = values
    loop.state.validated_step = loop.state.step
    loop.run_val_s += time.perf_counter() - start
    loop.logger.metrics("val", loop.state.step, {"epoch": max(epoch, 0), **values})
    loop.logger.info("epoch %d step %d: %s", max(epoch, 0), loop.state.step,
                     values_line(values))
    model.train()
    loop.phase = "training"  # (after validation's collectives: a wait there is named so)
    return values


SHOWN_VALUES = 12  # validation values a console line shows (a per-class metric logs 100)


def values_line(values: Dict[str, float]) -> str:
    """`key value` for each validation value, up to SHOWN_VALUES of them and a count of the
    rest, which metrics.jsonl and TensorBoard hold: a dict-valued metric of 100 classes made
    an epoch's line 2,000 characters long."""
    shown = " ".join(f"{k} {v:.4f}" for k, v in list(values.items())[:SHOWN_VALUES])
    rest = len(values) - SHOWN_VALUES
    return shown + (f" and {rest} more (metrics.jsonl)" if rest > 0 else "")


def _values(loop: "Loop", loss_sum: float, count: float) -> Dict[str, float]:
    """The validation's values on this rank: the loss, the task's metrics (torchmetrics
    gathers every rank's state) and the values derived from them."""
    values = {"val_loss": loss_sum / count if count else math.nan}
    failed = None
    for name, metric in loop.task.metrics.items():
        try:
            values.update(loop.task.compute_metric(name, metric) if count else
                          dict.fromkeys(loop.task.metric_keys(name), math.nan))
        except Exception as e:  # (the metrics after it still computed: each may sync the
            failed = failed or e  # ranks in its compute, and every rank must meet there)
    if failed is not None:
        raise failed
    loop.task.check_keys()  # (one key of two metrics; a monitored entry none of them has)
    values.update(loop.task.derived_values(values))
    return values


def _say_unsynced(loop: "Loop", values: List[Dict[str, float]]) -> None:
    """Warns, once a run, of each metric whose value differs between the ranks: one that
    keeps its state per rank and does not sum it over them in its compute, so that the value
    logged, rank 0's, is that of rank 0's shard of the validation set alone (it was said
    nowhere). A metric that syncs (torchmetrics', the built-in ones) has one state, one
    value, on every rank."""
    said = loop.__dict__.setdefault("_unsynced_said", set())
    for name, metric in loop.task.metrics.items():
        if name in said:
            continue
        key = next((k for k in loop.task.metric_keys(name)  # (a dict's: its first that differs)
                    if not all(_same(values[0].get(k), v.get(k)) for v in values[1:])), None)
        if key is None:
            continue
        seen = [v.get(key) for v in values]
        said.add(name)
        loop.logger.warning(
            "task.metrics.%s: %s computed other values on the ranks (%s): it keeps its state "
            "per rank, so %s is rank 0's shard of the validation set alone (1/%d of it); make "
            "it a torchmetrics.Metric (its state by add_state, with dist_reduce_fx) to have "
            "it over the whole set", name, type(metric).__name__,
            ", ".join(f"rank {r}: " + ("none" if v is None else f"{v:.4g}")
                      for r, v in enumerate(seen[:4]))
            + (", ..." if len(seen) > 4 else ""), key, len(seen))


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _agreed(loop: "Loop", work: Callable[[], Any], stand_in: Callable[[], Any] = lambda: None
            ) -> Tuple[Any, Optional[Exception]]:
    """`work()` and None, or where it raised under DDP, `stand_in()` and its error: a rank
    whose shard raised (a sample it could not read, a metric's update) or whose metric's
    compute raised ended at once, and its peers waiting in the next collective lost it with
    the epoch's training unsaved; it now meets them there with its error left in the store,
    and every rank learns of it (_raise_agreed). One process raises at once (its save waits
    in no collective)."""
    try:
        return work(), None
    except Exception as e:
        if loop.world == 1:
            raise
        from trainer.ending import status_error  # (lazy: trainer.ending imports the loop)

        liveness.record_error(distributed.rank(), status_error(e))
        return stand_in(), e


def _raise_agreed(loop: "Loop", failures: Any, failed: Optional[Exception]) -> None:
    """Where a rank's validation raised (`failures`, the same on every rank), every rank
    raises, the rank that failed its own error, the others PeerFailedValidation naming it;
    Checkpointing saves the trained state first on all of them."""
    if not failures:
        return
    loop.val_failure_agreed = True
    if failed is not None:
        raise failed
    rank = distributed.rank()
    raise PeerFailedValidation(
        f"rank {rank} ended with its peers at step {loop.state.step} (validating): "
        + (liveness.first_said(liveness.peer_errors(rank, loop.world))
           or "another rank's validation failed; its own error is in its output"))


def _failed_sums(loop: "Loop") -> torch.Tensor:
    """The sums of a shard that raised: nothing counted, the failure flag (the fifth) 1."""
    sums = torch.zeros(6, dtype=torch.float64, device=loop.device)
    sums[4] = 1
    return sums


def _shard_sums(loop: "Loop", model: nn.Module,
                stop: Optional[Callable[[], bool]] = None) -> torch.Tensor:
    """(loss sum, count, samples, files skipped as unreadable so far, 0: no failure, 1 where
    `stop()` said to stop before the shard's end) over this rank's validation shard; metrics
    updated on the way."""
    task = loop.task
    for metric in task.metrics.values():
        metric.reset()
    sums = torch.zeros(6, dtype=torch.float64, device=loop.device)
    samples = 0
    if stop is not None and stop():  # (came in the epoch's last steps: no loader started)
        sums[5] = 1
        return sums
    with contextlib.closing(loop.val_feed.take(loop.val_limit)) as batches:
        for batch in batches:
            if stop is not None and stop():
                sums[5] = 1
                break
            first = not loop.val_read and samples == 0  # the run's first validation batch
            samples += batch_size(batch)  # (shapes only)
            with loop.precision.autocast():
                # the run's first: data the model cannot take (only the validation split's dtype
                # or shape differs from training's) is one line, as the first training batch's is
                output = checked_forward(task, model, batch, first, loop.input_shape,
                                         find_unused=True, which="the first validation batch")
                count = task.count(batch)
                if first:
                    check_count(task, count, batch)
                sums[0] += counted(task.loss(output, batch), count)
                sums[1] += count
            if task.metrics:  # (a metric may keep the output itself: AUROC's list of preds)
                task.update_metrics(map_tensors(output, torch.clone) if loop.replays else output,
                                    batch)
    sums[2], sums[3] = samples, len(skipped_files(loop.val_feed))
    return sums


def validate_once(loop: "Loop", weights: str) -> Dict[str, Any]:
    """trainer.validate_only: the validation set once through the model as
    trainer.init_from (`weights`) loaded it, and no training; the run's summary values
    (`validate_only`, the weights, the samples read and the validation's numbers; no
    training rates: a sweep's table of validations shows none)."""
    values = evaluate(loop, 0)
    return {"epochs": 0, "steps": 0, "validate_only": True, "weights": str(weights),
            "validated_samples": loop.val_samples, **values, "run_val_s": loop.run_val_s}

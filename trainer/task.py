"""The task: the seam between the training loop and the user's work.

The loop never looks inside a batch. It asks the task four things:

- `forward(model, batch)`: run the model on the batch (how the batch reaches the model);
- `count(batch)`: how many units the loss averages over: samples, or valid tokens for a token
  loss. A Python int (known from shapes, no host sync) or a 0-d tensor on the device;
- `loss(output, batch)`: the loss as a mean over those `count` units;
- `metric_inputs(output, batch)`: the (preds, target) pair handed to every metric's `update`.

From `count` the loop weights every micro-batch so that k micro-batches on N ranks give the
update of one batch of all of them: each micro-batch contributes `loss * count / total`, where
`total` is the window's count summed over its micro-batches and, when counts are tensors (valid
tokens), over ranks too. A mean of per-batch means would weight a batch of 3 valid tokens as
much as one of 300.

Built-in tasks (conf/task/): Classification, Regression, LanguageModel, ModelLoss. A task of
your own subclasses `Task` and overrides what differs; see README "Bring your own".
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import math
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from trainer import distributed
from trainer.config import ConfigError
from trainer.strategy import unwrap

Count = Union[int, torch.Tensor]
log = logging.getLogger("stoker")


class TaskError(ConfigError):
    """A batch or a model output that the task cannot use; one line naming the task."""


def describe(obj: Any) -> str:
    """A short description of a batch or output for error messages: types, keys and shapes."""
    if isinstance(obj, torch.Tensor):
        return f"tensor{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')}"
    if isinstance(obj, Mapping):
        return "dict{" + ", ".join(f"{k}: {describe(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        items = [describe(v) for v in obj]
        if len(items) > 4 and len(set(items)) == 1:  # a list of 64 file names, say
            return f"{type(obj).__name__}({len(items)} x {items[0]})"
        return type(obj).__name__ + "(" + ", ".join(items) + ")"
    return type(obj).__name__


def _note(e: BaseException, line: str) -> None:
    """A line under an error's traceback (Python 3.11's notes) saying what Stoker gave the
    code that raised it."""
    if hasattr(e, "add_note"):
        e.add_note(line)


def batch_size(batch: Any) -> int:
    """Samples in `batch`: the first dimension of the first tensor found in it (shapes only)."""
    if type(batch) in (list, tuple) and batch and type(batch[0]) is torch.Tensor \
            and batch[0].dim():  # the common (inputs, target) batch, without the walk below
        return batch[0].shape[0]
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):  # a class of one's own
        return next((n for n in (batch_size(getattr(batch, f.name))
                                 for f in dataclasses.fields(batch)) if n), 0)
    values = batch.values() if isinstance(batch, Mapping) else (
        batch if isinstance(batch, (list, tuple)) else ())
    if isinstance(batch, (list, tuple)) and batch and not isinstance(
            batch[0], (torch.Tensor, Mapping, list, tuple)):
        return 0  # a list of names or numbers: nothing to walk through
    for v in values:
        n = batch_size(v)
        if n:
            return n
    return 0


def units(target: Any, batch: Any) -> int:
    """A target's elements (one per sample, or per sample and output), from shapes only."""
    return target.numel() if isinstance(target, torch.Tensor) else batch_size(batch)


def perplexity(values: Dict[str, float]) -> Dict[str, float]:
    """val_ppl = exp(val_loss) for a per-token loss."""
    loss = values.get("val_loss", math.nan)
    return {"val_ppl": math.exp(min(loss, 700.0)) if math.isfinite(loss) else math.nan}


class Task:
    """Base of every task. Subclasses override `loss` (and usually `count`, `metric_inputs`).

    `metrics`: name -> torchmetrics.Metric (built by Hydra from `task.metrics.<name>`), logged
    as `val_<name>`. `input_key`/`target_key`: for dict batches, the entry fed to the model
    (null: every entry but the target, as keyword arguments) and the target's entry.
    `output_key`: the attribute or entry holding the predictions in a model output that is
    not a tensor (Hugging Face outputs carry `.logits`).
    """

    name = "task"
    _call_checked = False  # the first call of the model was checked (`call`)

    def __init__(self, metrics: Optional[Mapping[str, Any]] = None,
                 input_key: Optional[str] = None, target_key: str = "labels",
                 output_key: str = "logits"):
        metrics = {k: v for k, v in (metrics or {}).items() if v is not None}
        for key, metric in metrics.items():
            if key == "loss" or not callable(getattr(metric, "update", None)) \
                    or not callable(getattr(metric, "compute", None)):
                raise ConfigError(f"task.metrics.{key}: {type(metric).__name__} is not a metric "
                                  "with update/compute (e.g. a torchmetrics.Metric), or is "
                                  "named 'loss' (val_loss is always logged)")
        self.metrics = nn.ModuleDict(metrics) if all(
            isinstance(m, nn.Module) for m in metrics.values()) else metrics
        # (a null target: a model that computes a loss of its own, with no labels)
        for key, value, nullable in (("input_key", input_key, True),
                                     ("target_key", target_key, True),
                                     ("output_key", output_key, False)):
            if not (isinstance(value, str) and value) and not (nullable and value is None):
                shown = "null" if value is None else repr(value)
                raise ConfigError(f"task.{key}={shown}: must be the name of a batch entry or "
                                  "output attribute" + (" (or null)" if nullable else ""))
        self.input_key, self.target_key, self.output_key = input_key, target_key, output_key

    note: Optional[str] = None  # a line for the run's log about what `setup` decided

    # -- what the loop calls ---------------------------------------------------------------
    def setup(self, model: nn.Module) -> None:
        """Called once with the user's model (before any wrapper or compilation), before the
        first batch: for what a task decides from the model. The base does nothing."""

    def forward(self, model: nn.Module, batch: Any) -> Any:
        """The model's output for `batch` (dict inputs become keyword arguments)."""
        inputs, _ = self.split(batch)
        if type(inputs) is torch.Tensor and self._call_checked:
            return model(inputs)  # the common case, before the slower Mapping check
        if isinstance(inputs, Mapping):
            return self.call(model, kwargs=inputs, hint="set task.input_key to the batch entry "
                             "the model takes, or task.target_key to the target's entry")
        return self.call(model, args=(inputs,))

    def count(self, batch: Any) -> Count:
        """Units the loss of `batch` averages over; the batch's samples by default."""
        return batch_size(batch)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        """The mean loss over `count(batch)` units (a 0-d tensor that autograd can use)."""
        raise NotImplementedError(f"{type(self).__name__} must define loss(output, batch)")

    def metric_inputs(self, output: Any, batch: Any) -> Tuple[Any, Any]:
        """(preds, target) for the metrics' `update`."""
        return self.predictions(output), self.split(batch)[1]

    def derived(self, values: Dict[str, float]) -> Dict[str, float]:
        """Values computed from the validation results (e.g. perplexity from the loss)."""
        return {}

    def update_metrics(self, output: Any, batch: Any) -> None:
        """Feeds every metric this batch's `metric_inputs`; a metric that refuses them is one
        line naming it."""
        preds, target = self.metric_inputs(output, batch)
        for name, metric in self.metrics.items():
            self._update(name, metric, preds, target)

    def check_metrics(self, output: Any, batch: Any) -> None:
        """Every metric tried once, on the first training batch (a copy of it, whose state is
        thrown away): a metric that cannot take the task's inputs stops the run at its first
        step, not after the first epoch's training, at validation. A compute() that fails on
        one batch only warns: some need more samples than a batch has (R2 needs two)."""
        if not self.metrics:
            return
        with torch.no_grad():
            preds, target = self.metric_inputs(output, batch)
            preds = preds.detach() if isinstance(preds, torch.Tensor) else preds
            for name, metric in self.metrics.items():
                try:
                    trial = copy.deepcopy(metric)
                except Exception:  # noqa: BLE001  (a metric that cannot be copied: validation
                    continue  # tries it)
                self._update(name, trial, preds, target)
                try:
                    self.compute_metric(name, trial)
                except TaskError:
                    raise  # (not one number: so on the whole set too)
                except Exception as e:  # noqa: BLE001
                    log.warning("task.metrics.%s: %s.compute() failed on the first training "
                                "batch (%s: %s); validation computes it over the whole set",
                                name, type(metric).__name__, type(e).__name__,
                                str(e).splitlines()[0] if str(e) else "")

    def _update(self, name: str, metric: Any, preds: Any, target: Any) -> None:
        try:
            metric.update(preds, target)
        except (ValueError, TypeError, RuntimeError) as e:
            raise TaskError(f"task.metrics.{name}: {type(metric).__name__} refused the "
                            f"task's metric inputs ({describe((preds, target))}): "
                            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
                            ) from None
        except Exception as e:  # inside the metric's own code: its traceback stays
            _note(e, f"stoker: task.metrics.{name}: {type(metric).__name__}.update() failed, "
                     f"given {describe((preds, target))}")
            raise

    def compute_metric(self, name: str, metric: Any) -> float:
        """The metric's value over the whole validation set, as one number."""
        try:
            value = metric.compute()
        except Exception as e:
            _note(e, f"stoker: task.metrics.{name}: {type(metric).__name__}.compute() failed")
            raise
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise TaskError(f"task.metrics.{name}: {type(metric).__name__} computed "
                            f"{describe(value)}, not one number; configure it to reduce "
                            "(e.g. average: macro)")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TaskError(f"task.metrics.{name}: {type(metric).__name__} computed "
                            f"{describe(value)}, not one number") from None

    def higher_is_better(self) -> Dict[str, Optional[bool]]:
        """Every validation key this task logs, with its better direction where known."""
        keys: Dict[str, Optional[bool]] = {"val_loss": False}
        for name, metric in self.metrics.items():
            keys[f"val_{name}"] = getattr(metric, "higher_is_better", None)
        return keys

    # -- helpers for subclasses --------------------------------------------------------------
    def call(self, model: nn.Module, args: tuple = (), kwargs: Optional[Mapping] = None,
             hint: str = "") -> Any:
        """`model(*args, **kwargs)`; on the first call, arguments the model's `forward` cannot
        take are reported in one line (with `hint`) instead of a traceback from inside it."""
        kwargs = kwargs or {}
        if self._call_checked:
            return model(*args, **kwargs)
        self._call_checked = True
        module = unwrap(model) if isinstance(model, nn.Module) else model
        got = dict(kwargs) if not args else (
            {"args": tuple(args), **kwargs} if kwargs else tuple(args))
        try:
            signature = inspect.signature(getattr(module, "forward", module))
        except (TypeError, ValueError):
            signature = None
        if signature is not None:
            try:
                signature.bind(*args, **kwargs)
            except TypeError as e:
                raise self.error(f"a model whose forward{signature} cannot take the batch "
                                 f"({e})", got, fix=hint) from None
        try:
            return model(*args, **kwargs)
        except (TypeError, ValueError, IndexError, KeyError, AttributeError, RuntimeError) as e:
            # inside the model: its traceback stays, with what it was given
            if not isinstance(e, torch.OutOfMemoryError):
                _note(e, f"stoker: task {self.name}: the model's first forward failed, given "
                         f"{describe(got)}: do the data (data=...) and the model (model=...) "
                         "fit together?")
            raise

    def split(self, batch: Any) -> Tuple[Any, Any]:
        """(inputs, target) of a batch: a sequence's first two items, or a dict's entries."""
        if isinstance(batch, (list, tuple)) and len(batch) >= 2 \
                and not isinstance(batch[0], str):  # (the default collate's batch of strings)
            return batch[0], batch[1]
        if isinstance(batch, Mapping) and self.target_key in batch:
            target = batch[self.target_key]
            if self.input_key is not None:
                if self.input_key not in batch:
                    raise self.error(f"a dict batch without the input key "
                                     f"'{self.input_key}' (task.input_key)", batch)
                return batch[self.input_key], target
            return {k: v for k, v in batch.items() if k != self.target_key}, target
        raise self.error("a batch it cannot unpack", batch,
                         f"(inputs, target) or a dict with the target key '{self.target_key}' "
                         "(task.target_key)" + ("" if self.name == "model_loss" else
                                                "; or task=model_loss if the model computes "
                                                "its loss"))

    def predictions(self, output: Any) -> torch.Tensor:
        """The prediction tensor inside a model output (a tensor, `.logits`, ["logits"], [0])."""
        if isinstance(output, torch.Tensor):
            return output
        found = getattr(output, self.output_key, None)
        if found is None and isinstance(output, Mapping):
            found = output.get(self.output_key)
        if found is None and isinstance(output, (list, tuple)) and output:
            found = output[0]
        if not isinstance(found, torch.Tensor):
            raise self.error("a model output it cannot read", output,
                             f"a tensor, or an output with a '{self.output_key}' tensor "
                             "(task.output_key)")
        return found

    def check_loss(self, loss: Any) -> None:
        """The first training loss, checked once: what backward needs, said in one line
        instead of autograd's traceback."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 \
                or not loss.is_floating_point():
            raise self.error(f"{type(self).__name__}.loss(output, batch) returned no loss "
                             "backward can start from", loss,
                             expected="a 0-d floating tensor (the mean over the batch)",
                             fix="reduce it, e.g. reduction='mean'")
        if not loss.requires_grad:
            raise self.error(f"{type(self).__name__}.loss(output, batch) returned a loss that "
                             "does not depend on the model's parameters", loss,
                             fix="compute it from the model's output (not detached, not "
                             "under torch.no_grad)")

    def error(self, what: str, got: Any, expected: str = "", fix: str = "") -> TaskError:
        text = f"task {self.name}: {what}: got {describe(got)}"
        return TaskError(text + (f"; expected {expected}" if expected else "")
                         + (f"; {fix}" if fix else ""))

    def to(self, device: torch.device) -> "Task":
        for metric in self.metrics.values():
            if isinstance(metric, nn.Module):
                metric.to(device)
        return self


class Classification(Task):
    """Cross-entropy over (batch, classes) logits and int64 targets; top-1 accuracy by default.

    Targets equal to `ignore_index` (null: none) are left out of the loss and its count.
    `num_classes` (from data.num_classes when set) is checked against the logits' last size.
    """

    name = "classification"

    def __init__(self, ignore_index: Optional[int] = None, label_smoothing: float = 0.0,
                 num_classes: Optional[int] = None, **kwargs):
        super().__init__(**kwargs)
        if ignore_index is not None and (isinstance(ignore_index, bool)
                                         or not isinstance(ignore_index, int)):
            raise ConfigError(f"task.ignore_index={ignore_index!r}: must be an integer target "
                              "value (e.g. -100) or null")
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
                or not 0.0 <= label_smoothing <= 1.0:
            raise ConfigError(f"task.label_smoothing={label_smoothing!r}: must be a number "
                              "from 0.0 to 1.0")
        if num_classes is not None and (isinstance(num_classes, bool)
                                        or not isinstance(num_classes, int) or num_classes < 2):
            raise ConfigError(f"task.num_classes={num_classes!r}: must be an integer >= 2 or "
                              "null (it follows data.num_classes)")
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        self.num_classes = num_classes
        self._checked = False
        self._passed: Optional[tuple] = None  # (logits shape, target shape, dtype) that passed

    def target(self, batch: Any) -> torch.Tensor:
        return self.split(batch)[1]

    def count(self, batch: Any) -> Count:
        target = self.target(batch)
        if self.ignore_index is None or not isinstance(target, torch.Tensor):
            return units(target, batch)
        return (target != self.ignore_index).sum()  # stays on the device

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        """Mean cross-entropy over the counted targets (NaN for a batch of padding only: the
        loop weighs that batch 0)."""
        logits, target = self.predictions(output), self.target(batch)
        self.check(logits, target)
        if logits.dim() != 2:
            logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
        return F.cross_entropy(
            logits.float(), target.long(),
            ignore_index=-100 if self.ignore_index is None else self.ignore_index,
            label_smoothing=self.label_smoothing)

    def check(self, logits: torch.Tensor, target: Any) -> None:
        """Shapes and dtypes on every call (metadata only; skipped for the shapes and dtype
        that passed last time); target values on the first call (one host sync, once per run)."""
        if isinstance(target, torch.Tensor) and self._passed == (
                logits.shape, target.shape, target.dtype):
            return
        if not isinstance(target, torch.Tensor) or target.dtype not in (
                torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise self.error("targets that are not integer class indices", target,
                             "an int64 tensor of class indices (task=regression for real "
                             "values)")
        if tuple(target.shape) != tuple(logits.shape[:-1]):
            raise self.error(f"logits {tuple(logits.shape)} and targets of another shape",
                             target, f"targets of shape {tuple(logits.shape[:-1])}")
        classes = logits.shape[-1]
        if self.num_classes is not None and classes != self.num_classes:
            raise self.error(f"logits with {classes} classes but data.num_classes="
                             f"{self.num_classes}", logits,
                             "the model's output size to match data.num_classes")
        if not self._checked:
            self._checked = True
            valid = target if self.ignore_index is None else target[target != self.ignore_index]
            if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= classes):
                raise self.error(f"a target outside 0..{classes - 1} (the logits have {classes} "
                                 f"classes)", target, "class indices below the model's "
                                 "output size (is the model's num_classes right?)")
        self._passed = (logits.shape, target.shape, target.dtype)


class LanguageModel(Classification):
    """Next-token cross-entropy over (batch, tokens, vocabulary) logits; targets equal to
    `ignore_index` (-100, padding) are left out; logs per-token accuracy and perplexity.

    `shift_labels`: the targets are the inputs themselves (Hugging Face's `labels`): position
    t's logits are scored against token t + 1. false: the data already yields shifted targets.
    """

    name = "language_model"

    def __init__(self, ignore_index: int = -100, shift_labels: bool = False, **kwargs):
        super().__init__(ignore_index=ignore_index, **kwargs)
        self.shift_labels = shift_labels
        self._last_inputs: Any = None

    def target(self, batch: Any) -> torch.Tensor:
        target = super().target(batch)
        return target[..., 1:] if self.shift_labels and isinstance(target, torch.Tensor) else target

    def check(self, logits: torch.Tensor, target: Any) -> None:
        first = not self._checked
        super().check(logits, target)
        if first:
            if not self.shift_labels:
                self._warn_if_unshifted(target)
            self._last_inputs = None

    def _warn_if_unshifted(self, target: torch.Tensor) -> None:
        """Targets that equal the inputs make next-token training an identity (an accuracy of
        about 1 that means nothing): Hugging Face-style `labels` need shift_labels=true."""
        inputs = self._last_inputs
        if isinstance(inputs, torch.Tensor) and inputs.shape == target.shape:
            valid = target != self.ignore_index
            same = bool(valid.any()) and bool((inputs[valid] == target[valid]).all())
            if same and distributed.detect().is_main:  # every rank sees the same mistake
                log.warning("task language_model: the targets equal the inputs; if they are "
                            "Hugging Face-style labels, set task.shift_labels=true (position t "
                            "is scored against token t + 1)")

    def forward(self, model: nn.Module, batch: Any) -> Any:
        if not self._checked:  # kept for the one-off check of the first batch
            inputs = self.split(batch)[0]
            self._last_inputs = inputs if isinstance(inputs, torch.Tensor) else (
                inputs.get("input_ids") if isinstance(inputs, Mapping) else None)
        return super().forward(model, batch)

    def predictions(self, output: Any) -> torch.Tensor:
        logits = super().predictions(output)
        if logits.dim() != 3:
            raise self.error("logits that are not (batch, tokens, vocabulary)", logits,
                             "a 3-D output (task=classification for one label per sample)")
        return logits[:, :-1] if self.shift_labels else logits

    def metric_inputs(self, output: Any, batch: Any) -> Tuple[Any, Any]:
        return self.predictions(output), self.target(batch)

    def derived(self, values: Dict[str, float]) -> Dict[str, float]:
        return perplexity(values)

    def higher_is_better(self) -> Dict[str, Optional[bool]]:
        return {**super().higher_is_better(), "val_ppl": False}


class Regression(Task):
    """Mean squared error between the model's output and real-valued targets (any shape the
    output has; a (batch, 1) output meets (batch,) targets). Logs val_mse and val_mae."""

    name = "regression"

    def pair(self, output: Any, batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        pred, target = self.predictions(output), self.split(batch)[1]
        if not isinstance(target, torch.Tensor) or not target.is_floating_point():
            raise self.error("targets that are not real numbers", target,
                             "a float tensor (task=classification for class indices)")
        if target.shape != pred.shape:
            if target.numel() != pred.numel():
                raise self.error(f"outputs {tuple(pred.shape)} that do not match the targets",
                                 target, "one output value per target value (a model with "
                                 "num_classes=1, say, for one real target per sample)")
            target = target.reshape(pred.shape)
        return pred.float(), target.float()  # never bf16/fp16 targets or metrics

    def count(self, batch: Any) -> Count:
        return units(self.split(batch)[1], batch)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        pred, target = self.pair(output, batch)
        return F.mse_loss(pred, target)

    def metric_inputs(self, output: Any, batch: Any) -> Tuple[Any, Any]:
        return self.pair(output, batch)


def causal_lm(model: nn.Module) -> bool:
    """Whether `model` is a Hugging Face causal language model: given `labels` equal to its
    inputs, it scores position t's logits against label t + 1 itself."""
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return True
    if not type(model).__module__.startswith("transformers."):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


class ModelLoss(Task):
    """The model computes its own loss (Hugging Face models given `labels`, a LightningModule-
    style forward): an output with `.loss`, a dict with "loss", or a scalar tensor.

    The batch reaches the model whole: a dict as keyword arguments, a sequence as positional
    arguments, a tensor as the one argument. `count`: samples (the loss is a mean over the
    batch) or tokens (a mean over the labels not equal to `ignore_index` in
    `batch[target_key]`), so that accumulation and DDP weight every token equally.
    `shift_labels` (with tokens): the labels are scored one position on, as causal LMs do
    (the last position's logits and the first label are left out of the count and the
    metrics); `auto`: for Hugging Face causal LMs only (a token classifier, an encoder or a
    seq2seq model scores each label where it stands).
    """

    name = "model_loss"

    def __init__(self, count: str = "samples", ignore_index: int = -100,
                 shift_labels: Union[bool, str] = "auto", **kwargs):
        super().__init__(**kwargs)
        if count not in ("samples", "tokens"):
            raise ConfigError(f"task.count={count}: must be samples or tokens")
        if shift_labels not in (True, False, "auto"):
            raise ConfigError(f"task.shift_labels={shift_labels}: must be auto, true or false")
        self.count_by, self.ignore_index, self.shift_labels = count, ignore_index, shift_labels
        self._looked = False  # the first labels were compared with the inputs
        self._replicas = 1  # the GPUs a DataParallel model splits the batch over

    def setup(self, model: nn.Module) -> None:
        if self.shift_labels != "auto":
            return
        self.shift_labels = causal_lm(model)
        if self.count_by == "tokens":
            name = type(model).__name__
            self.note = (f"task model_loss: labels scored one position on ({name} is a causal "
                         "language model; task.shift_labels=auto)" if self.shift_labels else
                         f"task model_loss: labels scored where they stand ({name} is not a "
                         "Hugging Face causal language model; task.shift_labels=true if it "
                         "predicts the next token)")

    def _shift(self) -> bool:
        if self.shift_labels == "auto":
            raise ConfigError("task.shift_labels=auto is decided from the model: call the "
                              "task's setup(model) first, or set true or false")
        return self.shift_labels

    def forward(self, model: nn.Module, batch: Any) -> Any:
        hint = ("task=model_loss needs a model that takes the whole batch and returns its loss "
                "(task=classification or regression for a model that returns predictions)")
        self._replicas = len(model.device_ids) if isinstance(model, nn.DataParallel) else 1
        if isinstance(batch, Mapping):
            return self.call(model, kwargs=batch, hint=hint)
        if isinstance(batch, (list, tuple)):
            return self.call(model, args=tuple(batch), hint=hint)
        return self.call(model, args=(batch,), hint=hint)

    def labels(self, batch: Any) -> torch.Tensor:
        labels = batch.get(self.target_key) if isinstance(batch, Mapping) else None
        if not isinstance(labels, torch.Tensor):
            raise self.error(f"task.count=tokens but no '{self.target_key}' tensor in the batch",
                             batch, f"a dict batch with '{self.target_key}' (task.target_key)")
        if not self._looked:
            self._looked = True
            self._warn_if_inputs(batch, labels)
        return labels[..., 1:] if self._shift() else labels

    def _warn_if_inputs(self, batch: Mapping, labels: torch.Tensor) -> None:
        """Labels equal to `input_ids` are a causal LM's, to be scored one position on:
        with shift_labels false every metric would compare a token with itself."""
        inputs = batch.get("input_ids")
        if self._shift() or not isinstance(inputs, torch.Tensor) or inputs.shape != labels.shape:
            return
        valid = labels != self.ignore_index
        if bool(valid.any()) and bool((inputs[valid] == labels[valid]).all()) \
                and distributed.detect().is_main:  # every rank sees the same
            log.warning("task model_loss: the labels equal the input_ids; if the model predicts "
                        "the next token, set task.shift_labels=true")

    def count(self, batch: Any) -> Count:
        if self.count_by == "samples":
            return batch_size(batch)
        return (self.labels(batch) != self.ignore_index).sum()

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor) and loss.dim() == 1 and self._replicas > 1:
            loss = self._replica_mean(loss, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise self.error("no scalar loss in the model output", output,
                             "an output with .loss, a dict with 'loss', or a 0-d tensor "
                             "(give the model its labels, or use task=classification)")
        return loss

    def _replica_mean(self, losses: torch.Tensor, batch: Any) -> torch.Tensor:
        """DataParallel (trainer.strategy=dp on several GPUs) gathers each GPU's mean loss into
        a vector, one per chunk of the batch (`torch.chunk` along dim 0): their mean, each
        weighted by what it averages over (a chunk of padding only weighs 0); a vector of
        another length is left to be refused."""
        if self.count_by == "tokens":
            weights = torch.stack([c.sum() for c in (self.labels(batch) != self.ignore_index)
                                   .chunk(self._replicas)])
        else:
            weights = torch.tensor([len(c) for c in
                                    torch.arange(batch_size(batch)).chunk(self._replicas)])
        if len(weights) != len(losses):
            return losses
        weights = weights.to(losses.device, torch.float32)
        return torch.where(weights > 0, losses.float() * weights, 0.0).sum() / weights.sum()\
            .clamp(min=1)

    def metric_inputs(self, output: Any, batch: Any) -> Tuple[Any, Any]:
        logits = self.predictions(output)
        if self.count_by == "tokens":
            labels = self.labels(batch)
            return (logits[:, :-1] if self._shift() else logits), labels
        return logits, self.split(batch)[1]

    def derived(self, values: Dict[str, float]) -> Dict[str, float]:
        return perplexity(values) if self.count_by == "tokens" else {}

    def higher_is_better(self) -> Dict[str, Optional[bool]]:
        extra = {"val_ppl": False} if self.count_by == "tokens" else {}
        return {**super().higher_is_better(), **extra}

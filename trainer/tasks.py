"""The built-in tasks (conf/task/): Classification, LanguageModel, Regression and ModelLoss.

Each is a `trainer.task.Task` that overrides what differs from the base: what it counts, its
loss, the pair its metrics see. A task of your own subclasses `Task` (or one of these); see
README "Bring your own".
"""
from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from trainer import distributed
from trainer.config import ConfigError
from trainer.task import Count, Task, batch_size

log = logging.getLogger("stoker")


def units(target: Any, batch: Any) -> int:
    """A target's elements (one per sample, or per sample and output), from shapes only."""
    return target.numel() if isinstance(target, torch.Tensor) else batch_size(batch)


def perplexity(values: Dict[str, float]) -> Dict[str, float]:
    """val_ppl = exp(val_loss) for a per-token loss."""
    loss = values.get("val_loss", math.nan)
    return {"val_ppl": math.exp(min(loss, 700.0)) if math.isfinite(loss) else math.nan}


MULTI_LABEL = ("for multi-label 0/1 targets, one per class, a task of your own with "
               "binary_cross_entropy_with_logits: README \"A task and a metric of your own\"")


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
        self._last_inputs: Any = None  # the first batch's inputs, until its targets are checked

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
        try:
            return F.cross_entropy(
                logits.float(), target.long(),
                ignore_index=-100 if self.ignore_index is None else self.ignore_index,
                label_smoothing=self.label_smoothing)
        except IndexError as e:  # a later batch's target out of range (checked on the first)
            classes = logits.shape[-1]
            raise self.error(f"a target outside 0..{classes - 1} (the logits have {classes} "
                             f"classes; {str(e).strip()})", target,
                             "class indices below the model's output size (a label file "
                             "with a value out of range?)") from None

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
                             f"values; {MULTI_LABEL})")
        if logits.dim() == 1 and tuple(target.shape) == tuple(logits.shape):  # (batch,)
            # logits: no score per class (one-hot targets of (batch, classes) logits are not)
            classes = self.num_classes if self.num_classes is not None else "classes"
            raise self.error(f"logits {tuple(logits.shape)} of the targets' own shape: the "
                             "model gives no score per class", logits,
                             f"logits of shape {(*tuple(logits.shape), classes)} (a model "
                             "that squeezes its output? task=regression for one real value)")
        if tuple(target.shape) != tuple(logits.shape[:-1]):
            if logits.dim() > 2 and tuple(target.shape) == (logits.shape[0],
                                                             *logits.shape[2:]):
                # (F.cross_entropy's own layout, (batch, classes, steps))
                classes_last = (logits.shape[0], *logits.shape[2:], logits.shape[1])
                raise self.error(f"logits {tuple(logits.shape)} with the classes in dimension "
                                 "1, as F.cross_entropy takes them", target,
                                 f"the classes last, logits of shape {classes_last}, as the "
                                 "task reads them: return output.movedim(1, -1) from the model")
            # (integer 0/1 targets of the logits' own shape: one label per class, which
            # float ones were told of, above)
            multi = tuple(target.shape) == tuple(logits.shape) and logits.dim() == 2
            raise self.error(f"logits {tuple(logits.shape)} and targets of another shape",
                             target, f"targets of shape {tuple(logits.shape[:-1])}"
                             + (f" (class indices; {MULTI_LABEL})" if multi else ""))
        classes = logits.shape[-1]
        if self.num_classes is not None and classes != self.num_classes:
            raise self.error(f"logits with {classes} classes but data.num_classes="
                             f"{self.num_classes}", logits,
                             "the model's output size to match data.num_classes (a "
                             "model's own argument, such as model.num_classes="
                             f"{self.num_classes}; a Hugging Face model's is its config's "
                             f"num_labels: model.config.num_labels={self.num_classes}, with a "
                             "leading + where the config does not set it)")
        if not self._checked:
            self._checked = True
            self._warn_if_copied(logits, target)
            valid = target if self.ignore_index is None else target[target != self.ignore_index]
            low = int(valid.min()) if valid.numel() else 0
            if valid.numel() and (low < 0 or int(valid.max()) >= classes):
                # (-100: torch's and Hugging Face's padding; -1 and 1: a sign of one's own)
                padding = self.ignore_index is None and low == -100 and \
                    int(valid[valid >= classes].numel()) == 0 and \
                    bool((valid[valid < 0] == low).all())
                signs = low == -1 and int(valid.max()) == 1 and \
                    bool((valid.abs() == 1).all())
                raise self.error(f"a target outside 0..{classes - 1} (the logits have {classes} "
                                 f"classes)", target, "class indices below the model's "
                                 "output size (is the model's num_classes right?)" + (
                                     "; are the targets of -100 padding to leave out? set "
                                     "task.ignore_index=-100" if padding else
                                     "; the targets are -1 and 1: classes 0 and 1 are "
                                     "(y + 1) // 2" if signs else ""))
        self._passed = (logits.shape, target.shape, target.dtype)

    def copied(self, logits: torch.Tensor) -> Optional[str]:
        """What to say where the targets equal the inputs (None: nothing): a label per
        position, (batch, tokens, classes) logits, that is the input token itself trains a
        copy, whose accuracy of about 1 means nothing."""
        if logits.dim() < 3:
            return None
        return (f"task {self.name}: the targets equal the inputs, position by position: the "
                "model learns to copy its input (an accuracy near 1 that means nothing); for "
                "next-token prediction, task=language_model task.shift_labels=true")

    def _warn_if_copied(self, logits: torch.Tensor, target: torch.Tensor) -> None:
        """Once, on the first batch: `copied`'s warning where the targets equal the inputs."""
        inputs, self._last_inputs = self._last_inputs, None
        said = self.copied(logits)
        if said and isinstance(inputs, torch.Tensor) and inputs.shape == target.shape:
            valid = torch.ones_like(target, dtype=torch.bool) if self.ignore_index is None \
                else target != self.ignore_index
            same = bool(valid.any()) and bool((inputs[valid] == target[valid]).all())
            if same and distributed.detect().is_main:  # every rank sees the same mistake
                log.warning(said)

    def forward(self, model: nn.Module, batch: Any) -> Any:
        if not self._checked:  # kept for the one-off check of the first batch
            inputs = self.split(batch)[0]
            self._last_inputs = inputs if isinstance(inputs, torch.Tensor) else (
                inputs.get("input_ids") if isinstance(inputs, Mapping) else None)
        return super().forward(model, batch)


class LanguageModel(Classification):
    """Next-token cross-entropy over (batch, tokens, vocabulary) logits; targets equal to
    `ignore_index` (-100, padding) are left out; logs per-token accuracy and perplexity.

    `shift_labels`: the targets are the inputs themselves (Hugging Face's `labels`): position
    t's logits are scored against token t + 1. false: the data already yields shifted targets.
    """

    name = "language_model"

    def counts_tokens(self) -> bool:
        return True

    def __init__(self, ignore_index: int = -100, shift_labels: bool = False, **kwargs):
        super().__init__(ignore_index=ignore_index, **kwargs)
        self.shift_labels = shift_labels

    def target(self, batch: Any) -> torch.Tensor:
        target = super().target(batch)
        return target[..., 1:] if self.shift_labels and isinstance(target, torch.Tensor) else target

    def copied(self, logits: torch.Tensor) -> Optional[str]:
        """Targets that equal the inputs make next-token training an identity: Hugging
        Face-style `labels` need shift_labels=true."""
        return None if self.shift_labels else (
            "task language_model: the targets equal the inputs; if they are Hugging "
            "Face-style labels, set task.shift_labels=true (position t is scored against "
            "token t + 1)")

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

    def derived_keys(self) -> Dict[str, Optional[bool]]:
        return {"val_ppl": False}


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
            if not _same_layout(pred.shape, target.shape):
                # (B, 2, 4) outputs against (B, 4, 2) targets: paired flattened, every value
                # met another's target, and the run trained and scored that silently
                raise self.error(f"outputs {tuple(pred.shape)} laid out otherwise than the "
                                 "targets", target, "the targets' layout (the same sizes in "
                                 "the same order, size-1 dimensions aside, or neighbouring ones "
                                 "merged: a flat row per sample)", "permute the model's output, "
                                 "or the targets in the dataset, to match")
            target = target.reshape(pred.shape)
        return pred.float(), target.float()  # never bf16/fp16 targets or metrics

    def count(self, batch: Any) -> Count:
        return units(self.split(batch)[1], batch)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        pred, target = self.pair(output, batch)
        return F.mse_loss(pred, target)

    def metric_inputs(self, output: Any, batch: Any) -> Tuple[Any, Any]:
        return self.pair(output, batch)


@functools.lru_cache(maxsize=64)  # (a pair of shapes a step: judged once)
def _same_layout(a: torch.Size, b: torch.Size) -> bool:
    """Whether outputs of shape `a` and targets of shape `b` (as many values) pair value by
    value when one is reshaped to the other: size-1 dimensions aside, one shape merges
    neighbouring dimensions of the other ((B, 12) against (B, 3, 4), a Linear's flat row;
    (B*T,) against (B, T), a sequence model's flattened steps), which the running products
    of its sizes tell (a subset of the other's); (B, 2, 4) against (B, 4, 2) is no merge."""
    def ends(shape: torch.Size) -> set:
        out, total = set(), 1
        for d in shape:
            if d != 1:
                total *= d
                out.add(total)
        return out

    ours, theirs = ends(a), ends(b)
    return ours <= theirs or theirs <= ours


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
    whole_batch = True

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

    def counts_tokens(self) -> bool:
        return self.count_by == "tokens"

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None and isinstance(output, (list, tuple)) and output:
            loss = output[0]  # (loss, logits, ...): Hugging Face's return_dict=False given labels
        if isinstance(loss, torch.Tensor) and loss.dim() == 1 and self._replicas > 1:
            loss = self._replica_mean(loss, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            number = isinstance(loss, (int, float)) and not isinstance(loss, bool)
            raise self.error("no scalar loss in the model output", output,
                             "an output with .loss, a dict with 'loss', a 0-d tensor, or a "
                             "tuple whose first item is one (give the model its labels, or use "
                             "task=classification)",
                             fix="the model's loss is a number: return the tensor itself "
                             "(.item() or float() of it is a number backward cannot start from)"
                             if number else "")
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

    def derived_keys(self) -> Dict[str, Optional[bool]]:
        return {"val_ppl": False} if self.count_by == "tokens" else {}

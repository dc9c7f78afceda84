"""The run's first batch, looked at once: what it and the task's answers on it must be.

A mistake in how the data, the model and the task fit together shows on the first batch. The
loop and validation check that batch here and say such a mistake in one line naming what to
change, instead of a traceback from inside autograd or the model, or a run that trains on
nothing. Later batches run unchecked: the hot loop pays for none of this.

- `checked_forward`: the forward pass, a RuntimeError on the first batch said as
  `forward_error` says it (inputs of a shape or dtype the model cannot take);
- `check_count`, `check_loss`: the task's count and loss are what the loop can weigh and
  start backward from;
- `check_batch`: a batch of more items than a two-item task reads warns that the rest is unused;
- `check_input_shape`: samples of data.input_shape's size but another shape warn (a model
  that flattens them takes them silently).
"""
from __future__ import annotations

import inspect
import logging
import math
import re
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import nn

from trainer import distributed
from trainer.checkpoint import tensors_in
from trainer.config import ConfigError
from trainer.strategy import unwrap
from trainer.task import Task, TaskError, _note, batch_size, describe, stoker_notes

log = logging.getLogger("stoker")

# the modules whose methods read a batch as (inputs, target) alone
BUILT_IN = ("trainer.task", "trainer.tasks")


def check_batch(task: Task, batch: Any) -> None:
    """A sequence of more items than (inputs, target), under a task whose every step reads
    only those two (the built-in ones bar model_loss, which passes the model the whole batch),
    warns that the rest is not used, rather than leaving a (x, weight, y) batch to train on its
    weights unsaid."""
    if not isinstance(batch, (list, tuple)) or len(batch) <= 2 or \
            isinstance(batch[0], str) or not reads_two_items(task):
        return
    if distributed.detect().is_main:  # every rank sees the same batches
        log.warning("task %s: the batches hold %d items; the first two are taken as "
                    "(inputs, target) and the rest (%d more) is not used (a dict batch names "
                    "its entries, task=model_loss passes them all to the model, and a task "
                    "of your own reads what it needs: README \"Bring your own\")",
                    task.name, len(batch), len(batch) - 2)


def check_input_shape(task: Task, batch: Any, input_shape: Optional[Any]) -> None:
    """Samples of data.input_shape's size but another shape warn: a model that flattens them
    ((4, 5) samples into an MLP built for [20]) trained on without a word. (Other sizes are
    no mistake of this kind: a sequence shorter than the longest a transformer takes.)"""
    if input_shape is None or task.whole_batch:
        return
    try:
        inputs = task.split(batch)[0]
    except Exception:  # noqa: BLE001  (a batch the task reads otherwise: its own business)
        return
    if not isinstance(inputs, torch.Tensor) or inputs.dim() < 2:
        return
    sample, expected = tuple(inputs.shape[1:]), tuple(int(n) for n in input_shape)
    if sample != expected and math.prod(sample) == math.prod(expected) and \
            distributed.detect().is_main:
        log.warning("data.input_shape=%s, but the first batch's samples are %s (inputs %s): "
                    "the model took them, reshaped; is data.input_shape the samples' shape?",
                    list(expected), sample, describe(inputs))


def reads_two_items(task: Task) -> bool:
    """Whether `task`'s steps read a batch through `split` alone: each of its methods that
    sees the batch is a built-in one."""
    return not task.whole_batch and all(
        getattr(type(task), m).__module__ in BUILT_IN
        for m in ("split", "forward", "count", "loss", "metric_inputs"))


def check_count(task: Task, count: Any, batch: Any) -> None:
    """The first batch's count: an int >= 1 (0 only for a batch of no samples: every file in it
    skipped as unreadable) or a one-element tensor, said in one line instead of a TypeError
    inside the loop, or a run that trains on no units (a count of 0 weighs every loss by
    nothing)."""
    if isinstance(count, torch.Tensor) and count.numel() == 1 or \
            type(count) is int and (count >= 1 or count == 0 and not batch_size(batch)):
        return
    shown = describe(count) if isinstance(count, torch.Tensor) else repr(count)[:60]
    raise TaskError(f"task {task.label}: {type(task).__name__}.count(batch) returned "
                    f"{shown}; expected the units its loss averages over: an int >= 1 "
                    "(the batch's samples) or a one-element tensor (valid tokens)")


def check_loss(task: Task, loss: Any) -> None:
    """The first training loss: what backward needs, said in one line instead of autograd's
    traceback."""
    name = type(task).__name__
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 \
            or not loss.is_floating_point():
        # (a Python number: a tensor's .item() or float(), which leaves the graph)
        number = isinstance(loss, (int, float)) and not isinstance(loss, bool)
        raise task.error(f"{name}.loss(output, batch) returned no loss backward can start "
                         "from", loss, expected="a 0-d floating tensor (the mean over the batch)",
                         fix="return the tensor itself: .item() or float() of it is a number "
                         "backward cannot start from" if number else
                         "reduce it, e.g. reduction='mean'")
    if not loss.requires_grad:
        raise task.error(f"{name}.loss(output, batch) returned a loss that does not depend on "
                         "the model's parameters", loss,
                         fix="compute it from the model's output (not detached, not under "
                         "torch.no_grad)")


def checked_forward(task: Task, model: nn.Module, batch: Any, first: bool,
                    input_shape: Optional[Any], find_unused: bool,
                    which: str = "the first batch") -> Any:
    """`task.forward(model, batch)`, a RuntimeError it raises said as `forward_error` says it
    (`first`: the run's first such batch, named `which`). Another error raised in a task's
    own forward, before its model (`batch["image"]` of a tuple batch), keeps its traceback
    with a note saying what the task was given, as the model's own first forward does."""
    if first:  # (on CUDA an id past the embedding is a device-side assert no process survives)
        said = out_of_range(batch, unwrap(model))
        if said:
            raise ConfigError(f"{said} (in {which})")
    try:
        return task.forward(model, batch)
    except (RuntimeError, IndexError) as e:
        # (a later batch's, on a CPU: on CUDA the assert left no device to read the ids from)
        said = out_of_range(batch, unwrap(model), cpu_only=True)
        if said:
            raise ConfigError(f"{said} (in a batch after {which})") from None
        if isinstance(e, IndexError):
            _forward_failed(task, e, batch, first, which)
            raise
        error = forward_error(e, batch, unwrap(model), first, input_shape, find_unused, which)
        if error is e:
            raise
        raise error from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        if isinstance(e, ValueError) and str(e).startswith(_ONE_VALUE):
            raise ConfigError(_one_value_per_channel(e, unwrap(model), batch)) from None
        if first and isinstance(e, ValueError) and "dtype" in str(e):  # (an RNN's: a
            error = forward_error(e, batch, unwrap(model), first, input_shape,  # ValueError)
                                  find_unused, which)
            if error is not e:
                raise error from None
        _forward_failed(task, e, batch, first, which)
        raise


# (torch's BatchNorm in training, given one value per channel: one sample of no spatial size)
_ONE_VALUE = "Expected more than 1 value per channel when training"


def _one_value_per_channel(e: ValueError, model: nn.Module, batch: Any) -> str:
    """The one line for a BatchNorm in training given a batch of one sample (torch's
    ValueError, a traceback at the end of the epoch before): data.batch_size=1, or the
    epoch's last batch where the training samples per rank leave one over."""
    got = str(e).rsplit("got input size ", 1)[-1]
    head = (f"model: {type(model).__name__}'s BatchNorm needs more than one value per channel "
            f"in training and got {got}")
    samples = batch_size(batch)
    if samples > 1:  # (the model made the one row itself: batch fixes would not help; 0: a
        # batch of no tensor, whose size is not known, is taken as one sample)
        return (f"{head} from a batch of {samples} samples ({describe(batch)}): the model "
                "reduces or reshapes its batch to one row before that BatchNorm; a "
                "normalisation that takes one row (LayerNorm, GroupNorm), or the BatchNorm "
                "before that reduction")
    return (f"{head}, a batch of one sample ({describe(batch)}): "
            "data.batch_size=1, or the last batch of an epoch, which holds the training "
            "samples per rank left over a multiple of data.batch_size; a data.batch_size that "
            "leaves none or more than one over, data.drop_last=true (leaves that one out), or "
            "a normalisation that takes one sample (LayerNorm, GroupNorm)")


def _note_once(e: Exception, line: str) -> None:
    """`line` under `e`'s traceback, unless `e` is said in one line already (ConfigError) or
    carries a line of Stoker's (a note from deeper down)."""
    if not isinstance(e, ConfigError) and not stoker_notes(e):
        _note(e, line)


def _forward_failed(task: Task, e: Exception, batch: Any, first: bool, which: str) -> None:
    """Notes on an error of the task's own forward what it was given (`first` batch only)."""
    if first:
        _note_once(e, f"stoker: task {task.label}: its forward failed on {which}, given "
                      f"{describe(batch)}: does the task's forward take the batches the data "
                      "(data=...) yields?")


def loss_failed(task: Task, e: Exception, output: Any, batch: Any) -> None:
    """Notes on an error the task's loss raised on the run's first batch (a loss of one's
    own, whose traceback stays) what it was given, as a failing first forward says."""
    _note_once(e, f"stoker: task {task.label}: its loss failed on the first batch, given the "
                  f"model's output {describe(output)} and the batch {describe(batch)}: do the "
                  "loss, the model's output and the data's targets fit together?")


# models whose integer `labels` are classes of config.num_labels (Hugging Face's heads)
_CLASSIFIERS = ("ForSequenceClassification", "ForTokenClassification",
                "ForImageClassification", "ForAudioClassification")


def out_of_range(batch: Any, model: nn.Module, cpu_only: bool = False) -> Optional[str]:
    """Why a batch's integers cannot index the model: token ids (a dict batch's `input_ids`,
    a sequence batch's inputs of int64 or int32) past the rows of the embedding the model
    names as its input's (`get_input_embeddings`, as Hugging Face's models and Stoker's
    Transformer do: a tokenizer of a larger vocabulary than the model's vocab_size), or a
    Hugging Face classifier's `labels` past its config's num_labels; None where neither is
    the case or nothing says which table the ids index (`cpu_only`: only tensors in host
    memory are read). Both were an IndexError deep in the model's code on a CPU, a
    device-side assert on CUDA; under task=model_loss the classification task's target check
    does not run."""
    if isinstance(batch, Mapping):
        entries = [(repr(k), k, t) for k, t in batch.items() if k in ("input_ids", "labels")]
    elif isinstance(batch, (list, tuple)) and batch:
        entries = [("item 0", None, batch[0])]  # (inputs, target): the inputs
        labels = _positional_labels(model, batch)
        if labels is not None:  # (task=model_loss: the items are the forward's arguments)
            entries.append((f"item {labels} ('labels')", "labels", batch[labels]))
    else:
        entries = [("the batch", None, batch)]
    ints = [(name, k, t) for name, k, t in entries if isinstance(t, torch.Tensor)
            and t.dtype in (torch.int64, torch.int32) and t.numel()
            and not (cpu_only and t.device.type != "cpu")]
    if not ints:
        return None
    embedding = _input_embedding(model)
    if embedding is not None:
        rows = embedding.num_embeddings
        for name, k, t in ints:
            if k == "labels":
                continue
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= rows:
                where = next((n for n, m in model.named_modules() if m is embedding), "")
                return (f"data: the batch's {name} holds ids from {lo} to {hi}, but the "
                        f"model's input embedding ({where or type(embedding).__name__}) has "
                        f"{rows} rows: ids must be from 0 to {rows - 1} (does the tokenizer's "
                        "vocabulary fit the model's vocab_size?)")
        said = _past_positions(batch, model, ints, cpu_only)
        if said is not None:
            return said
    config = getattr(model, "config", None)
    classes = getattr(config, "num_labels", None)
    if isinstance(classes, int) and (classes > 1 or type(model).__name__.endswith(
            "ForTokenClassification")) and type(model).__name__.endswith(
            _CLASSIFIERS) and getattr(config, "problem_type", None) in (
            None, "single_label_classification"):
        for name, k, t in ints:
            if k != "labels":
                continue
            bad = t[(t != -100) & ((t < 0) | (t >= classes))]
            if bad.numel():
                return (f"data: the batch's 'labels' holds class {int(bad[0])}, but "
                        f"{type(model).__name__} has {classes} labels (its config's "
                        f"num_labels): labels must be from 0 to {classes - 1} (-100 leaves one "
                        "out); give the model's config num_labels=<the data's class count>")
    return None


def _past_positions(batch: Any, model: nn.Module, ints: Sequence[Tuple[str, Any, torch.Tensor]],
                    cpu_only: bool = False) -> Optional[str]:
    """Why the batch's token sequences are too long for the model's learned position
    embedding (`_position_table`), or None. The rows a batch asks of the table: the largest
    of its own `position_ids` plus one where it gives them (packed sequences, each from 0),
    else its sequences' length, counted from the table's padding row plus one over the
    tokens that are not padding where the table has one (RoBERTa's: positions from 2).
    `cpu_only`: position_ids in device memory are not read (nor judged by the length)."""
    table = _position_table(model)
    if table is None:
        return None
    where, rows, key, pad = table
    fits = rows if pad is None else rows - pad - 1  # (tokens a sequence can hold)
    given = batch.get("position_ids") if isinstance(batch, Mapping) else None
    if isinstance(given, torch.Tensor) and given.numel() and not given.is_floating_point():
        if cpu_only and given.device.type != "cpu":
            return None
        if int(given.max()) >= rows:
            return (f"data: the batch's 'position_ids' go up to {int(given.max())}, but the "
                    f"model's position embedding ({where}) has {rows} rows (its config's "
                    f"{key}): give positions below {rows}, or the model's config "
                    f"{key}={int(given.max()) + 1} or more")
        return None
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    for name, k, t in ints:
        if k == "labels" or t.dim() < 2:
            continue
        tokens = int((t != pad_id).sum(-1).max()) if pad is not None and isinstance(
            pad_id, int) else t.shape[-1]
        if tokens > fits:
            return (f"data: the batch's {name} holds sequences of {tokens} tokens, but the "
                    f"model's position embedding ({where}) has {rows} rows (its config's "
                    f"{key}" + (f"; positions from {pad + 1} on" if pad is not None else "")
                    + f"): give sequences of at most {fits} tokens (a tokenizer's max_length "
                    f"with truncation) or the model's config {key}={tokens + rows - fits} or "
                    "more")
    return None


def _position_table(model: nn.Module) -> Optional[Tuple[str, int, str, Optional[int]]]:
    """(its name, its rows, the config key, its padding row) of a Hugging Face model's
    learned position embedding, whose rows bound a sequence's length (GPT-2's wpe, BERT's
    position_embeddings: a longer one was an IndexError traceback); None where the model has
    none of its config's size (rotary positions, as Llama's, take any length)."""
    config = getattr(model, "config", None)
    key = next((k for k in ("n_positions", "max_position_embeddings")
                if isinstance(getattr(config, k, None), int) and getattr(config, k) > 0), None)
    if key is None:
        return None
    limit = getattr(config, key)
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and module.num_embeddings == limit and (
                "position" in last or last == "wpe"):
            return name, limit, key, module.padding_idx
    return None


def _positional_labels(model: nn.Module, batch: Sequence[Any]) -> Optional[int]:
    """Which item of a sequence batch a Hugging Face classifier takes as its `labels` when the
    batch is its positional arguments (ConvNext's second, ViT's third); None for other
    models, or where the items do not bind to its forward."""
    if not type(model).__name__.endswith(_CLASSIFIERS):
        return None
    try:
        names = list(inspect.signature(model.forward).bind_partial(*batch).arguments)
    except (TypeError, ValueError):
        return None
    return names.index("labels") if "labels" in names else None


def head_mismatch(model: nn.Module, classes: Any) -> Optional[str]:
    """A warning where a Hugging Face classifier's head (its config's num_labels) is not the
    data's class count (data.num_classes) under task=model_loss, whose loss is the model's own:
    a larger head trained silently on classes no sample has; a smaller one failed at the first
    label past it, but for a head of one, which Hugging Face trains as a regression (the
    warning said it would fail). task=classification refuses them all at its first step."""
    config = getattr(unwrap(model), "config", None)
    heads = getattr(config, "num_labels", None)
    if not type(unwrap(model)).__name__.endswith(_CLASSIFIERS) or not isinstance(heads, int) \
            or not isinstance(classes, int) or classes < 2 or heads == classes or \
            getattr(config, "problem_type", None) not in (None, "single_label_classification"):
        return None
    name = type(unwrap(model)).__name__
    if heads == 1 and not name.endswith("ForTokenClassification"):
        # (Hugging Face's sequence, image and audio classifiers regress on one label; its
        # token classifiers take the cross-entropy over it, and label 1 is past it)
        return (f"model: {name} has 1 label (its config's num_labels), which Hugging Face "
                f"trains as a regression (mean squared error on the labels as numbers), and "
                f"the data {classes} classes (data.num_classes): give the model's config "
                f"num_labels={classes} to classify them")
    return (f"model: {name} has {heads} labels (its config's num_labels) and the data "
            f"{classes} classes (data.num_classes): "
            + ("its head scores classes no sample has" if heads > classes else
               "a label past its head fails the run")
            + f"; give the model's config num_labels={classes}")


def _input_embedding(model: nn.Module) -> Optional[nn.Embedding]:
    """The embedding the model's token ids index, where the model says which
    (`get_input_embeddings`); None else (a model's one table may be a class embedding, or
    one of categorical features: which the inputs index is not known)."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        found = get() if callable(get) else None
    except Exception:  # noqa: BLE001  (a model that does not implement it)
        found = None
    return found if isinstance(found, nn.Embedding) else None


_CONV_DTYPE = re.compile(r"Input type \((?:double|float|c10::\w+|long|int)\) and (?:bias|weight) "
                         r"type")


def _names_dtypes(text: str) -> bool:
    """Whether a forward's error is about dtypes: "dtype" (a Linear's, an RNN's), or a
    convolution's "Input type (double) and bias type (float)" (not its device mismatch,
    "Input type (torch.cuda.FloatTensor)")."""
    return "dtype" in text or _CONV_DTYPE.search(text) is not None


def forward_error(e: Exception, batch: Any, model: nn.Module, first: bool,
                  input_shape: Optional[Any], find_unused: bool,
                  which: str = "the first batch") -> Exception:
    """What a forward pass's RuntimeError (or an RNN's dtype ValueError) is reported as: a
    one-line ConfigError for the mistakes it can name (a `first` batch of the run the model
    cannot take, parameters DDP found unused), else `e` itself. `model` is the bare model
    (not its DDP wrapper)."""
    text = str(e)
    embedding = "'indices'" in text and "Long" in text  # an embedding given float ids
    sizes = any(w in text for w in ("shape", "size"))
    if first and (embedding or sizes or _names_dtypes(text)):
        # the first batch of the run: inputs that do not fit the model are a
        # configuration mismatch (data.input_shape, the model's arguments), not a crash
        return ConfigError(f"model: {type(model).__name__} cannot take {which} "
                           f"({describe(batch)}): {text.splitlines()[0]}; "
                           + _input_fix(text, embedding, batch, model, input_shape))
    unused = "find_unused_parameters" in text or "did not receive grad" in text
    if unused and not find_unused:
        return ConfigError(
            "trainer.ddp.find_unused_parameters=false: some of the model's parameters "
            "got no gradient in a step (unused outputs or branches), which DDP cannot "
            "reduce; set trainer.ddp.find_unused_parameters=true")
    return e


def _input_fix(text: str, embedding: bool, batch: Any, model: nn.Module,
               input_shape: Optional[Any]) -> str:
    """What to change when the first batch does not fit the model (`text`: the error)."""
    params = {p.dtype for p in model.parameters() if p.is_floating_point()}
    floats = {t.dtype for t in tensors_in(batch) if t.is_floating_point()} - params
    if embedding:
        return ("token ids must be integers: make the dataset return int64 tensors "
                "(torch.as_tensor(ids, dtype=torch.long))")
    if _names_dtypes(text) and floats and len(params) == 1:
        return (f"the batch holds {', '.join(sorted(str(d)[6:] for d in floats))} inputs "
                f"and the model's parameters are {', '.join(str(d)[6:] for d in params)}: "
                "make the dataset return tensors of the model's dtype (numpy arrays are "
                "float64: torch.as_tensor(x, dtype=torch.float32))")
    if input_shape is None:  # (nothing of the data config sized the model)
        return ("do the batch's sizes fit the model's arguments? (a sequence longer than its "
                "position embeddings, another feature count than its first layer's)")
    return f"check data.input_shape={list(input_shape)} and the model's arguments"

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

The built-in tasks (conf/task/: Classification, Regression, LanguageModel, ModelLoss) live in
trainer/tasks.py. A task of your own subclasses `Task` and overrides what differs; see README
"Bring your own".
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import sysconfig
from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from trainer.config import ConfigError, first_line
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


# the project's own packages: code raising there is not the user's
_PROJECT = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), d)
                 + os.sep for d in ("trainer", "data", "scripts"))


def raised_in_own_code(e: BaseException, not_the_projects: bool = False) -> str:
    """` (raised at FILE:LINE)` where the innermost frame of `e` is code of one's own (not an
    installed package's, nor Python's; with `not_the_projects`, nor Stoker's own): there the
    refusal may be a bug, and that is where."""
    frames = _frames(e, not_the_projects)
    return f" (raised at {frames[-1][0]}:{frames[-1][1]})" if frames and \
        frames[-1][2] == "own" else ""


def _frames(e: BaseException, not_the_projects: bool) -> List[Tuple[str, int, str]]:
    """(path, line, whose) of each frame of `e`'s traceback, outermost first; whose:
    "installed" (an installed package's, or Python's), "other" (generated code, `<string>`;
    with `not_the_projects`, Stoker's own), else "own"."""
    installed = tuple({os.path.abspath(v) + os.sep for k, v in sysconfig.get_paths().items()
                       if k in ("stdlib", "platstdlib", "purelib", "platlib")})
    frames = []
    tb = e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        path = os.path.abspath(name)
        whose = "installed" if path.startswith(installed) else "other" if name.startswith(
            "<") or (not_the_projects and path.startswith(_PROJECT)) else "own"
        frames.append((path, tb.tb_lineno, whose))
        tb = tb.tb_next
    return frames


def raised_in_users_code(e: BaseException) -> str:
    """For an OSError raised in the user's own code (a model's forward, a dataset's
    `__getitem__`; not Stoker's, an installed package's nor Python's): ` (ConnectionError
    raised at FILE:LINE)`, for its one line; for one an installed package raised, called
    from the user's code (Pillow's UnidentifiedImageError): ` (PIL.UnidentifiedImageError
    from a call at FILE:LINE)`; "" else. Its line alone ("metrics server went away", "cannot
    identify image file") named neither its type nor where it came from."""
    if not isinstance(e, OSError):
        return ""
    frames = _frames(e, not_the_projects=True)
    if not frames or frames[-1][2] == "other":
        return ""
    if frames[-1][2] == "own":
        return f" ({type(e).__name__} raised at {frames[-1][0]}:{frames[-1][1]})"
    caller = next((f for f in reversed(frames) if f[2] != "installed"), None)
    if caller is None or caller[2] != "own":
        return ""
    kind = type(e).__name__ if type(e).__module__ == "builtins" else \
        f"{type(e).__module__.split('.')[0]}.{type(e).__name__}"
    return f" ({kind} from a call at {caller[0]}:{caller[1]})"


def _note(e: BaseException, line: str) -> None:
    """A line under an error's traceback (Python 3.11's notes) saying what Stoker gave the
    code that raised it."""
    if hasattr(e, "add_note"):
        e.add_note(line)


def stoker_notes(e: BaseException) -> List[str]:
    """The lines of Stoker's (`_note`, "stoker: ...") under an error's traceback, without
    their prefix (notes of other code's left out)."""
    return [str(n)[len("stoker:"):].strip() for n in getattr(e, "__notes__", ())
            if str(n).startswith("stoker:")]


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


METRIC_KINDS = "e.g. a torchmetrics.Metric, or a class of your own"


def _described(given: Any) -> str:
    """What a configured metric turned out to be, named as the user gave it (a function given
    `_partial_: true` is a partial of Hydra's own class: its name said nothing)."""
    func = given.func if isinstance(given, functools.partial) else given
    name = f"{getattr(func, '__module__', None) or '?'}.{getattr(func, '__qualname__', '?')}"
    if isinstance(given, functools.partial) and isinstance(func, type):
        return f"{name} given _partial_: true (a class left unbuilt: leave _partial_ out)"
    if isinstance(given, functools.partial):
        return f"{name} given _partial_: true (a function waiting for its arguments)"
    if isinstance(given, type):
        return f"{name} (a class, not an object of it)"
    if inspect.isroutine(given):
        return f"{name} (a function)"
    return type(given).__name__


def _key_meant(option: str, key: Any, batch: Mapping) -> str:
    """`did you mean task.<option>=<entry>?` where `key` misspells one of the dict batch's
    entries ("" where none is near)."""
    from trainer.spelling import meant

    near = meant(key, [k for k in batch if isinstance(k, str)]) if isinstance(key, str) else None
    return f"did you mean task.{option}={near}?" if near else ""


class Task:
    """Base of every task. Subclasses override `loss` (and usually `count`, `metric_inputs`).

    `metrics`: name -> torchmetrics.Metric (built by Hydra from `task.metrics.<name>`), logged
    as `val_<name>`. `input_key`/`target_key`: for dict batches, the entry fed to the model
    (null: every entry but the target, as keyword arguments) and the target's entry.
    `output_key`: the attribute or entry holding the predictions in a model output that is
    not a tensor (Hugging Face outputs carry `.logits`).
    """

    name = "task"
    whole_batch = False  # the model is given the whole batch (task=model_loss), not split's
    _call_checked = False  # the first call of the model was checked (`call`)
    _sequence_said = False  # which tensor of a tuple output is the predictions was said

    def __init__(self, metrics: Optional[Mapping[str, Any]] = None,
                 input_key: Optional[str] = None, target_key: str = "labels",
                 output_key: str = "logits"):
        metrics = {k: v for k, v in (metrics or {}).items() if v is not None}
        for key, metric in metrics.items():
            # (reset too: each validation starts with it, so one without failed only after
            # the first epoch's training)
            if key == "loss":
                raise ConfigError("task.metrics.loss: the name is val_loss's, which every task "
                                  "logs; give the metric another name")
            if not all(callable(getattr(metric, name, None))
                       for name in ("update", "compute", "reset")):
                raise ConfigError(f"task.metrics.{key}: {_described(metric)} is not a metric "
                                  f"with update/compute/reset ({METRIC_KINDS})")
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
        inputs, target = self.split(batch)
        if type(inputs) is torch.Tensor and self._call_checked:
            return model(inputs)  # the common case, before the slower Mapping check
        if isinstance(inputs, Mapping):
            return self.call(model, kwargs=inputs, hint="set task.input_key to the batch entry "
                             "the model takes, or task.target_key to the target's entry")
        swapped = isinstance(inputs, torch.Tensor) and isinstance(target, torch.Tensor) and \
            target.dim() > inputs.dim() and target.is_floating_point() and \
            not inputs.is_floating_point()
        return self.call(model, args=(inputs,), also=(
            f" (and the target {describe(target)}: are the dataset's (inputs, target) in that "
            "order?)" if swapped else ""))

    def count(self, batch: Any) -> Count:
        """Units the loss of `batch` averages over; the batch's samples by default."""
        return batch_size(batch)

    def counts_tokens(self) -> bool:
        """Whether `count` counts tokens: the run then also logs tokens per second."""
        return False

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        """The mean loss over `count(batch)` units (a 0-d tensor that autograd can use)."""
        raise NotImplementedError(f"{type(self).__name__} must define loss(output, batch)")

    def metric_inputs(self, output: Any, batch: Any) -> Tuple[Any, Any]:
        """(preds, target) for the metrics' `update`."""
        return self.predictions(output), self.split(batch)[1]

    def derived(self, values: Dict[str, float]) -> Dict[str, float]:
        """Values computed from the validation results (e.g. perplexity from the loss)."""
        return {}

    def derived_values(self, values: Dict[str, float]) -> Dict[str, float]:
        """`derived(values)`, checked: a mapping of names to numbers, in one line if not."""
        found = self.derived(values)
        if not isinstance(found, Mapping) or not all(
                isinstance(k, str) and isinstance(v, (int, float, torch.Tensor))
                and not isinstance(v, bool) for k, v in found.items()):
            raise self.error(f"{type(self).__name__}.derived(values) returned no mapping of "
                             "names to numbers", found,
                             expected="a dict such as {'val_ppl': 12.3}")
        return dict(found)

    def update_metrics(self, output: Any, batch: Any) -> None:
        """Feeds every metric this batch's `metric_inputs`; a metric that refuses them is one
        line naming it."""
        preds, target = self._metric_pair(output, batch)
        for name, metric in self.metrics.items():
            self._update(name, metric, preds, target)

    def _metric_pair(self, output: Any, batch: Any) -> Tuple[Any, Any]:
        pair = self.metric_inputs(output, batch)
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise self.error(f"{type(self).__name__}.metric_inputs(output, batch) returned no "
                             "(preds, target) pair", pair,
                             expected="a tuple (preds, target) for the metrics' update")
        return pair[0], pair[1]

    def _update(self, name: str, metric: Any, preds: Any, target: Any,
                trial: bool = False) -> None:
        """`metric.update`: inputs it refuses at first are one line (the task and the metric,
        or the data, do not fit); a failure after it took validation inputs is its own code's,
        whose traceback stays. `trial`: the first training batch's check, which counts for
        neither."""
        took = self.__dict__.setdefault("_took", set())  # (metrics that took inputs once)
        try:
            metric.update(preds, target)
            if not trial:
                took.add(name)
        except (ValueError, TypeError, RuntimeError) as e:
            if name in took:
                _note(e, f"stoker: task.metrics.{name}: {type(metric).__name__}.update() "
                         f"failed, given {describe((preds, target))}, after it had taken "
                         "such inputs")
                raise
            raise TaskError(f"task.metrics.{name}: {type(metric).__name__} refused the "
                            f"task's metric inputs ({describe((preds, target))}): "
                            f"{first_line(e)}"
                            f"{raised_in_own_code(e)}{_classes_last(e, preds, target)}") from None
        except Exception as e:  # inside the metric's own code: its traceback stays
            _note(e, f"stoker: task.metrics.{name}: {type(metric).__name__}.update() failed, "
                     f"given {describe((preds, target))}")
            raise

    monitored: Optional[str] = None  # trainer.checkpoint.monitor (check_keys)

    def compute_metric(self, name: str, metric: Any) -> Dict[str, float]:
        """The metric's values over the whole validation set, by the key each is logged as
        (`values_of`)."""
        try:
            value = metric.compute()
        except Exception as e:
            failed = self.__dict__.get("_compute_failed", {}).get(name)
            # on one batch and on the whole set alike: not a metric that needs more samples;
            # a bug of its own (its traceback stays) or inputs it does not fit (named here)
            again = (" over the validation set as on the first training batch, given "
                     f"{failed[1]}: does the metric take these? (a binary metric takes one "
                     "score per sample, a multiclass one a score per class)"
                     if failed is not None and type(e) is failed[0] else "")
            _note(e, f"stoker: task.metrics.{name}: {type(metric).__name__}.compute() "
                     f"failed{again}")
            raise
        return self.values_of(name, metric, value)

    def values_of(self, name: str, metric: Any, value: Any) -> Dict[str, float]:
        """What metric `name` computed, by the key each number is logged as: `val_<name>` for
        one number; for a dict (torchmetrics' ClasswiseWrapper, MetricCollection,
        MeanAveragePrecision) `val_<name>_<entry>` for each entry that is one number (nested
        dicts joined alike), the others left out (said once). The keys are kept
        (`metric_keys`)."""
        values = (self._entries(name, metric, value) if isinstance(value, Mapping)
                  else {f"val_{name}": self._one_number(name, metric, value)})
        self.__dict__.setdefault("_metric_keys", {})[name] = list(values)
        return values

    def metric_keys(self, name: str) -> List[str]:
        """The keys metric `name` was last logged under (`val_<name>` before it computed)."""
        return self.__dict__.get("_metric_keys", {}).get(name, [f"val_{name}"])

    def entry_metrics(self, key: str) -> List[str]:
        """The metrics whose dict entry `key` could be (`val_<name>_<entry>`)."""
        return [n for n in self.metrics if key.startswith(f"val_{n}_")]

    def _one_number(self, name: str, metric: Any, value: Any) -> float:
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            how = _reduced_by(name, metric)
            raise TaskError(f"task.metrics.{name}: {type(metric).__name__} computed "
                            f"{describe(value)}, not one number; " + (
                                f"configure it to reduce to one{how}" if how else
                                "a run logs metrics of one number (a matrix, per-class "
                                "values: compute it over the saved model's outputs, README "
                                "\"Using the model outside Stoker\")")
                            + (", or log one per class: wrap it in torchmetrics.wrappers."
                               "ClasswiseWrapper" if hasattr(metric, "average") else ""))
        number = _number(value)
        if number is None:
            raise TaskError(f"task.metrics.{name}: {type(metric).__name__} computed "
                            f"{describe(value)}, not one number (nor a dict of them)")
        return number

    def _entries(self, name: str, metric: Any, value: Mapping) -> Dict[str, float]:
        """A dict-valued metric's entries that are one number (a 0-d tensor, a Python or
        NumPy number; not a bool), by key; the others (a MeanAveragePrecision's `classes`, a
        list of one) left out, said once. Two entries of one key (`a_b`, and `b` in `a`)
        are one line."""
        found: Dict[str, float] = {}
        left: Dict[str, str] = {}  # (key: what it holds)
        todo = [(f"val_{name}", value)]
        while todo:
            prefix, mapping = todo.pop(0)
            for entry, v in mapping.items():
                key = f"{prefix}_{entry}"
                if isinstance(v, Mapping):
                    todo.append((key, v))
                    continue
                if key in found or key in left:
                    raise TaskError(f"task.metrics.{name}: {type(metric).__name__} computed "
                                    f"two entries logged as {key} (one nested in a dict): "
                                    "rename one")
                number = None if isinstance(v, bool) or (isinstance(v, torch.Tensor) and (
                    v.dim() != 0 or v.dtype == torch.bool)) else _number(v)
                if number is None:
                    left[key] = describe(v)
                else:
                    found[key] = number
        said = self.__dict__.setdefault("_left_out_said", set())
        if (left or not found) and name not in said:
            said.add(name)
            from trainer import distributed  # (lazy: the task module is imported first)

            if distributed.rank() == 0:
                per_class = any(held.startswith("tensor(") and "float" in held
                                and not held.startswith("tensor(1,)") for held in left.values())
                log.warning("task.metrics.%s: %s computed %s: left out of the logs%s%s", name,
                            type(metric).__name__,
                            "entries that are not one number, " + ", ".join(
                                f"{k} ({held})" for k, held in left.items()) if left
                            else "an empty dict",
                            f" (logged: {', '.join(found)})" if found else "",
                            "; values per class are logged one by one through torchmetrics."
                            "wrappers.ClasswiseWrapper (in a MetricCollection too)"
                            if per_class else "")
        return found

    def check_keys(self) -> None:
        """The metrics' keys as last computed (`metric_keys`), checked: one logged by two
        metrics (metric a's entry b and a metric a_b, both val_a_b), or a monitored key
        (trainer.checkpoint.monitor) that the metrics it could belong to, all computed,
        do not log (an entry they do not have, or a metric's own key where it computes a
        dict: best.pt and early stopping would never see a value), is one line."""
        computed = self.__dict__.get("_metric_keys", {})
        owner: Dict[str, str] = {"val_loss": "the loss", **{
            k: "the task's derived values" for k in self.derived_keys()}}
        for name, keys in computed.items():
            for key in keys:
                if key in owner:
                    raise TaskError(f"task.metrics.{name}: its value {key} is logged by "
                                    f"{owner[key]} too; give the metric another name")
                owner[key] = f"task.metrics.{name}"
        key = self.monitored
        could = [n for n in self.metrics if key == f"val_{n}"] + \
            self.entry_metrics(key) if key else []
        if not could or key in owner or any(n not in computed for n in could):
            return
        from trainer.spelling import closest  # (a failure's path)

        logged = [k for n in could for k in computed[n]]
        # (of a class's entry named by its index alone, `val_f1_3`: the one entry ending so)
        ends = [k for n in could if key.startswith(f"val_{n}_") for k in computed[n]
                if k.endswith(key[len(f"val_{n}"):])]
        meant = closest(key, logged) or (ends[0] if len(ends) == 1 else None)
        raise TaskError(f"trainer.checkpoint.monitor={key}: "
                        + ", ".join(f"task.metrics.{n} ({type(self.metrics[n]).__name__})"
                                    for n in could)
                        + " logs " + ", ".join(logged)
                        + (f" (did you mean {meant}?)" if meant else "")
                        + ("; it computes a dict: monitor one of its entries"
                           if key == f"val_{could[0]}" else ""))

    def derived_keys(self) -> Dict[str, Optional[bool]]:
        """The keys `derived` adds (val_ppl), with their better direction."""
        return {}

    def higher_is_better(self) -> Dict[str, Optional[bool]]:
        """Every validation key this task logs, with its better direction where known. A
        metric named as a derived key is one line (its value was replaced by the derived one
        without a word)."""
        keys: Dict[str, Optional[bool]] = {"val_loss": False}
        for name, metric in self.metrics.items():
            keys[f"val_{name}"] = getattr(metric, "higher_is_better", None)
        derived = self.derived_keys()
        taken = next((k for k in derived if k in keys), None)
        if taken is not None:
            raise ConfigError(f"task.metrics.{taken[4:]}: the name is {taken}'s, which task "
                              f"{self.label} derives from the validation results; give the "
                              "metric another name")
        return {**keys, **derived}

    # -- helpers for subclasses --------------------------------------------------------------
    def call(self, model: nn.Module, args: tuple = (), kwargs: Optional[Mapping] = None,
             hint: str = "", also: str = "") -> Any:
        """`model(*args, **kwargs)`; on the first call, arguments the model's `forward` cannot
        take are reported in one line (with `hint`) instead of a traceback from inside it, and
        a failure inside it gets a note naming what it was given (and `also`)."""
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
                _note(e, f"stoker: task {self.label}: the model's first forward failed, given "
                         f"{describe(got)}{also}: do the data (data=...) and the model "
                         "(model=...) fit together?")
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
                                     f"'{self.input_key}' (task.input_key)", batch,
                                     fix=_key_meant("input_key", self.input_key, batch))
                return batch[self.input_key], target
            return {k: v for k, v in batch.items() if k != self.target_key}, target
        raise self.error("a batch it cannot unpack", batch,
                         f"(inputs, target) or a dict with the target key '{self.target_key}' "
                         "(task.target_key)" + ("" if self.name == "model_loss" else
                                                "; or task=model_loss if the model computes "
                                                "its loss"),
                         fix=_key_meant("target_key", self.target_key, batch)
                         if isinstance(batch, Mapping) else "")

    def predictions(self, output: Any) -> torch.Tensor:
        """The prediction tensor inside a model output (a tensor, `.logits`, ["logits"], or a
        sequence's first tensor of one dimension or more: (loss, logits) gives the logits)."""
        if isinstance(output, torch.Tensor):
            return output
        found = getattr(output, self.output_key, None)
        if found is None and isinstance(output, Mapping):
            found = output.get(self.output_key)
        if found is None and isinstance(output, (list, tuple)):
            found = next((t for t in output if isinstance(t, torch.Tensor) and t.dim()), None)
            if not self._sequence_said:
                self._sequence_said = True
                self._say_sequence(output, found)
        if not isinstance(found, torch.Tensor):
            raise self.error("a model output it cannot read", output,
                             f"a tensor, or an output with a '{self.output_key}' tensor "
                             "(task.output_key)")
        return found

    def _say_sequence(self, output: Sequence[Any], taken: Optional[torch.Tensor]) -> None:
        """Once a run: which of several tensors in a tuple or list output was taken as the
        predictions (a model returning (features, logits) trained on its features, exit 0,
        where the loss took their width for classes)."""
        others = [t for t in output if isinstance(t, torch.Tensor) and t.dim() and t is not taken]
        if taken is None or not others:
            return
        at = next(i for i, t in enumerate(output) if t is taken)
        log.warning("task %s: the model's output is %s; its element %d, %s, the first of one "
                    "dimension or more, is taken as the predictions: a model whose "
                    "predictions come later (features, logits) should return them alone, or "
                    "first, or in a dict or an attribute named by task.output_key ('%s')",
                    self.label, describe(output), at, describe(taken), self.output_key)

    @property
    def label(self) -> str:
        """How messages name the task: its config name, or a task of one's own by its class."""
        return type(self).__name__ if self.name == Task.name else self.name

    def error(self, what: str, got: Any, expected: str = "", fix: str = "") -> TaskError:
        text = f"task {self.label}: {what}: got {describe(got)}"
        return TaskError(text + (f"; expected {expected}" if expected else "")
                         + (f"; {fix}" if fix else ""))

    def to(self, device: torch.device) -> "Task":
        for metric in self.metrics.values():
            if isinstance(metric, nn.Module):
                metric.to(device)
        return self


def _classes_last(e: Exception, preds: Any, target: Any) -> str:
    """What to do with sequence scores (batch, steps, classes), classes last as the built-in
    tasks give them, that a metric refused for their shape (torchmetrics' ValueError): its
    multiclass metrics read the classes in dimension 1 ("" for other inputs and errors)."""
    if not (isinstance(e, ValueError) and isinstance(preds, torch.Tensor)
            and isinstance(target, torch.Tensor) and preds.dim() > 2
            and target.shape == preds.shape[:-1]):
        return ""
    return ("; the task gives sequence scores with the classes last, where torchmetrics' "
            "multiclass metrics read them in dimension 1: trainer.metrics.Accuracy reads them "
            "last, or a task of your own whose metric_inputs returns (preds.flatten(0, -2), "
            "target.flatten()) (README \"A task and a metric of your own\")")


def _number(value: Any) -> Optional[float]:
    """`value` as one float (a 1-element tensor, a Python or NumPy number), else None."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 else None
    if isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _reduced_by(name: str, metric: Any) -> str:
    """The argument of `metric` (torchmetrics' names) that reduces its value to one number,
    as an override: a per-class average, a regression's multioutput, its num_outputs."""
    if hasattr(metric, "multioutput"):  # (R2Score, ExplainedVariance)
        return f" (task.metrics.{name}.multioutput=uniform_average)"
    if isinstance(getattr(metric, "num_outputs", None), int):  # (MeanAbsoluteError, ...)
        return f" (task.metrics.{name}.num_outputs=1: one value over every output)"
    if hasattr(metric, "average"):  # (classification metrics)
        return f" (task.metrics.{name}.average=macro)"
    return ""


def __getattr__(name: str) -> Any:
    """The built-in tasks under their former module (`_target_: trainer.task.Classification`
    in a config written before they moved to trainer/tasks.py)."""
    if name in ("Classification", "LanguageModel", "Regression", "ModelLoss"):
        from trainer import tasks
        return getattr(tasks, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Building the user's components from `_target_` nodes, with one-line errors.

`build(node, key, offered)` checks the node's keys against the target's signature before
calling it: a key the target does not take is a typo named in one line (with the keys it does
take), a required argument nobody gives is named too. `offered` values (the data config's
`input_shape` and `num_classes`, a dataset's `split`) are passed only where the target's
signature names them and the node does not set them, so a torchvision or Hugging Face class
never receives an argument it does not know.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from trainer import argvalues, spelling
from trainer.config import ConfigError, first_line, plain

RESERVED = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
_OURS = ("data", "trainer", "tests")  # Stoker's top-level packages


def target_of(node: Any, key: str) -> Callable:
    """The callable a `_target_` node names; ConfigError if it is missing or not importable."""
    if not isinstance(node, (DictConfig, dict)) or "_target_" not in node:
        shown = OmegaConf.to_container(node) if isinstance(node, DictConfig) else node
        raise ConfigError(f"{key}: needs a _target_ (an importable class or function), got "
                          f"{shown!r}")
    return locate(str(node["_target_"]), f"{key}._target_")


def locate(path: str, key: str) -> Callable:
    """The object at a dotted path (`pkg.module.Class`), importing the longest module prefix;
    ConfigError naming `key` and the reason when there is none."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue  # this prefix is no module: try a shorter one
            raise ConfigError(f"{key}={path}: importing {module_name} failed: {e}") from None
        except Exception as e:  # an error inside the user's module
            raise ConfigError(f"{key}={path}: importing {module_name} failed: "
                              f"{type(e).__name__}: {e}") from None
        for j, attr in enumerate(parts[i:], start=i):
            if not hasattr(obj, attr):
                owner = ".".join(parts[:j])
                # a package, and more names after this one: a module was meant
                if j == i and j < len(parts) - 1 and hasattr(obj, "__path__"):
                    meant = _meant_module(obj, attr)  # (a misspelling, not a package of
                    raise ConfigError(  # one's own that Stoker's of that name hides)
                        f"{key}={path}: no module named '{owner}.{attr}' (and {owner} has no "
                        f"attribute '{attr}')" + (f"; did you mean {owner}.{meant}?" if meant
                                                  else _shadowed(owner) if j == 1 else "")
                    ) from None
                meant = _meant(obj, attr)
                raise ConfigError(f"{key}={path}: {owner} has no attribute '{attr}'"
                                  + (f" (did you mean {owner}.{meant}?)" if meant else "")
                                  + (_shadowed(owner) if j == 1 else "")) from None
            obj = getattr(obj, attr)
        if inspect.ismodule(obj):  # (Hydra's words: "Expected a callable target, got '<module")
            names = [n for n, v in vars(obj).items() if not n.startswith("_") and
                     (inspect.isclass(v) or inspect.isfunction(v))
                     and getattr(v, "__module__", None) == obj.__name__]
            raise ConfigError(f"{key}={path}: a module, not a class or function in it"
                              + (f" (it defines {', '.join(names[:8])}"
                                 f"{', ...' if len(names) > 8 else ''})" if names else ""))
        return obj
    meant = _meant_top(parts[0])
    raise ConfigError(f"{key}={path}: no module named '{parts[0]}' ("
                      + (f"did you mean {meant}? " if meant else "")
                      + "is it installed, or in the directory you run from?)")


def _meant(owner: Any, attr: str) -> Optional[str]:
    """The public name of `owner` that `attr` misspells (`Adamw` for AdamW, `MLPP`), or the
    one name that is `attr` and a capitalised word more (a class renamed so: torchmetrics'
    `F1`, now `F1Score`), or None."""
    try:
        names = [n for n in dir(owner) if not n.startswith("_")]
    except Exception:  # noqa: BLE001  (a module's own __dir__ that fails)
        return None
    longer = [n for n in names if len(attr) >= 2 and n.startswith(attr)
              and n[len(attr)].isupper() and n[len(attr):].isalnum()]
    return spelling.meant(attr, names) or (longer[0] if len(longer) == 1 else None)


def _meant_module(package: Any, attr: str) -> Optional[str]:
    """The module of `package` (or public name in it) that `attr` misspells, or None."""
    try:
        names = {m.name for m in pkgutil.iter_modules(package.__path__)}
        names.update(n for n in dir(package) if not n.startswith("_"))
    except Exception:  # noqa: BLE001  (a namespace or a package of odd making)
        return None
    return spelling.meant(attr, sorted(names))


def _meant_top(name: str) -> Optional[str]:
    """The importable top-level module (on sys.path) that `name` misspells (`troch`), or
    None."""
    return spelling.meant(name, sorted({m.name for m in pkgutil.iter_modules()}))


def _shadowed(top: str) -> str:
    """Where the package `top` is one of Stoker's own (data, trainer, tests), what
    that means for a package of the user's by that name: Python finds Stoker's first."""
    ours = Path(__file__).resolve().parents[1]
    if top not in _OURS:
        return ""
    return (f"; '{top}' is Stoker's own package ({ours / top}), which a package of yours "
            f"named {top} cannot replace: rename yours")


def parameters(target: Callable) -> Optional[Dict[str, inspect.Parameter]]:
    """The named parameters `target` accepts, or None when that cannot be known: a function
    taking **kwargs, or no readable signature. A class whose __init__ passes **kwargs on to
    its base (`class Mine(MLP): def __init__(self, *a, **kw)`) takes its bases' parameters too.
    A wrapped __init__ whose wrapper takes **kwargs that the function it shows does not (the
    Hugging Face configs' `@strict(accept_kwargs=True)`: `BertConfig(num_labels=2)`) is one
    that cannot be known.
    """
    found: Dict[str, inspect.Parameter] = {}
    for fn in _inits(target):
        try:
            params = inspect.signature(fn).parameters
            outer = inspect.signature(fn, follow_wrapped=False).parameters \
                if hasattr(fn, "__wrapped__") else params
        except (TypeError, ValueError):
            return None
        if _takes_any(outer) and not _takes_any(params):
            return None
        for n, p in params.items():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self":
                found.setdefault(n, p)
        if not _takes_any(params):
            return found
    return None


def _takes_any(params: Mapping[str, inspect.Parameter]) -> bool:
    """Whether a signature's parameters take any keyword (**kwargs)."""
    return any(p.kind == p.VAR_KEYWORD for p in params.values())


def _inits(target: Callable):
    """The callables whose signatures describe `target`'s arguments, most derived first."""
    if not inspect.isclass(target):
        yield target
        return
    for cls in target.__mro__:
        if "__init__" in vars(cls):
            if cls is object:
                return
            yield cls.__init__


def accepts(target: Callable, name: str) -> bool:
    """True if `target` (or, through **kwargs, a base class) names the parameter `name`."""
    params = parameters(target)
    if params is not None:
        return name in params
    try:
        return name in inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False


def missing_key(key: str, node: Any, arg: str) -> Optional[str]:
    """A line for an override of a key `arg` that the `_target_` node at `key` lacks
    (`optim.lrr=1e-3`, where Hydra says only that the key is not there): its target takes no
    such argument, with the ones it takes, or it does and `+key.arg=...` adds it. None when
    the node has no target, or its target or what it takes cannot be told."""
    try:
        params = parameters(target_of(node, key))
    except ConfigError:
        return None
    if params is None:
        return None
    name = node["_target_"]
    if arg not in params:
        return _no_argument(key, name, arg, params)
    return (f"{key}.{arg}: not in the config of {key} yet; {name} takes it: add it with "
            f"+{key}.{arg}=...")


def _no_argument(key: str, name: str, arg: str, params: Dict[str, inspect.Parameter]) -> str:
    """The line for an argument `arg` that the target `name` at `key` does not take, with the
    one it misspells where there is one (`layer` for `layers`)."""
    meant = spelling.closest(arg, params)
    return (f"{key}.{arg}: {name} takes no argument '{arg}' "
            + (f"(did you mean {key}.{meant}? " if meant else "(")
            + f"it takes: {', '.join(params) or 'no arguments'})")


def _checked(node: Any, key: str, offered: Optional[Dict[str, Any]], hint: str,
             kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Checks `node`'s keys against its target's parameters; returns the arguments `build`
    passes besides the node's own (`offered` ones the target takes, and `kwargs`)."""
    target = target_of(node, key)
    name = node["_target_"]
    params = parameters(target)
    given = [k for k in node if k not in RESERVED]
    if params is not None:
        unknown = [k for k in given if k not in params]
        if unknown:
            # (the hint is for keys left from the group's other choice, not for a misspelling)
            misspelt = spelling.closest(unknown[0], params) is not None
            raise ConfigError(_no_argument(key, name, unknown[0], params)
                              + ("" if misspelt else hint))
        argvalues.check(node, key, name, params, given)
    else:
        spelling.check_keyword_config(target, name, node, given, key, _inits(target))
    extra = {k: v for k, v in (offered or {}).items()
             if v is not None and k not in given and params is not None and k in params}
    extra.update(kwargs)
    if params is not None and not node.get("_partial_", False) and "_args_" not in node:
        missing = [n for n, p in params.items() if p.default is p.empty
                   and n not in given and n not in extra]
        if missing:
            # (a key the node lacks is added with +: Hydra's config is closed to new keys)
            arg = f"+{key}.{missing[0]}=..."
            where = f"data.{missing[0]} or {arg}" if missing[0] in (offered or {}) else arg
            if missing[0] == "num_classes" and missing[0] in (offered or {}):
                where = ("data.num_classes (the classes of a classification) or "
                         f"+{key}.num_classes=N (its outputs: 1 for one regression target)")
            raise ConfigError(f"{key}: {name} needs '{missing[0]}': set {where}")
    return extra


def _inner_nodes(node: Any, key: str) -> List[Tuple[str, Any]]:
    """The `_target_` nodes Hydra builds inside `node` (in its values, or in a mapping of them
    such as a task's metrics), deepest first, each with its key."""
    if node.get("_recursive_", True) is False:
        return []  # (its inner nodes stay configs: the target builds them itself)
    found: List[Tuple[str, Any]] = []
    for k, value in node.items():
        if k in RESERVED or not OmegaConf.is_dict(value):
            continue
        inner = [(f"{key}.{k}", value)] if "_target_" in value else \
            [(f"{key}.{k}.{n}", v) for n, v in value.items()
             if OmegaConf.is_dict(v) and "_target_" in v]
        for where, child in inner:
            found += [*_inner_nodes(child, where), (where, child)]
    return found


def _check_inner(node: Any, key: str) -> None:
    """The `_target_` nodes inside `node`, checked as `build` checks a node, each named by its
    own key."""
    for where, child in reversed(_inner_nodes(node, key)):
        _checked(child, where, None, "", {})


def build(node: Any, key: str, offered: Optional[Dict[str, Any]] = None, hint: str = "",
          **kwargs: Any) -> Any:
    """`instantiate(node, **kwargs)` after checking its keys (see the module doc), and those
    of the `_target_` nodes inside it (a task's `metrics.<name>`), each named by its own key.
    A `_partial_: true` node is not checked for missing arguments: its caller passes them.
    `hint` ends the message about an unknown key."""
    extra = _checked(node, key, offered, hint, kwargs)
    _check_inner(node, key)
    if isinstance(node, (dict, DictConfig)) and "_convert_" not in node:
        # plain lists and dicts, not OmegaConf's containers: a library that checks the types
        # of its arguments refuses a ListConfig (a Hugging Face config's `hidden_sizes`)
        extra["_convert_"] = "all"
    try:
        return instantiate(node, **extra)
    except InstantiationException as e:
        if isinstance(e.__cause__, ConfigError):  # a component's own check of its arguments
            raise e.__cause__ from None
        where = _inner_key(node, key, str(e))
        if where is None or e.__cause__ is None:
            raise
        cause = e.__cause__  # an inner node's target refused its arguments: name its key
        called = _CALLED.match(str(e)).group(1)
        inner = dict(_inner_nodes(node, key)).get(where)
        misspelt = spelling.misspelt_required(
            cause, None if inner is None else [str(k) for k in inner if k not in RESERVED])
        if misspelt:  # (a target taking **kwargs took the misspelt key, then missed the other)
            raise ConfigError(f"{where}.{misspelt[0]}: {called} needs '{misspelt[1]}', which it "
                              f"was not given (did you mean {where}.{misspelt[1]}?)") from None
        target = _target_or_none(inner, where)
        raise ConfigError(f"{where}: {called} refused its arguments "
                          f"({type(cause).__name__}: {first_line(cause)})"
                          + spelling.unexpected_meant(cause, target, where)
                          + _not_a_metric(where, target, cause)) from None


def _not_a_metric(where: str, target: Optional[Callable], cause: BaseException) -> str:
    """What to say where a task's metric names a function that missed its arguments as the
    task was built: a function such as sklearn's f1_score, which wants the samples, is no
    metric (a factory of metrics failing on its own arguments is said as it is)."""
    if not where.startswith("task.metrics.") or not inspect.isroutine(target) or not (
            isinstance(cause, TypeError) and "missing" in str(cause)):
        return ""
    from trainer.task import METRIC_KINDS

    return (f"; a function is not a metric: give an object with update/compute/reset "
            f"({METRIC_KINDS})")


def _target_or_none(node: Any, key: str) -> Optional[Callable]:
    """The target of a `_target_` node, or None where there is none to find."""
    try:
        return None if node is None else target_of(node, key)
    except ConfigError:
        return None


_CALLED = re.compile(r"Error in call to target '([^']+)'")


def _inner_key(node: Any, key: str, message: str) -> Optional[str]:
    """The key of the `_target_` node inside `node` whose call failed (Hydra names the
    target's qualified name), None for `node` itself or where it is not known."""
    called = _CALLED.match(message)
    if called is None:
        return None
    full = re.search(r"^full_key: (\S+)$", message, re.MULTILINE)  # Hydra's, relative to node
    if full is not None and f"{key}.{full.group(1)}" in dict(_inner_nodes(node, key)):
        return f"{key}.{full.group(1)}"
    for where, child in _inner_nodes(node, key):
        try:
            target = target_of(child, where)
        except ConfigError:
            continue
        name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
        if called.group(1) in (name, str(child["_target_"])):
            return where
    return None


# words torch's optimizers use for their arguments in "Invalid ..." messages
_ALIASES = {"learning rate": "lr", "epsilon": "eps", "beta": "betas", "momentum": "momentum",
            "weight_decay": "weight_decay", "weight decay": "weight_decay",
            "dampening": "dampening"}


def call(fn: Callable, key: str, node: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a partial built from `node`), with a ValueError or TypeError it
    raises about its arguments turned into one line naming the config key."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, TypeError) as e:
        if not raised_in_torch_optim(e):
            raise  # a bug in the user's own factory keeps its traceback
        text = first_line(e)
        lowered = text.lower()
        names = [k for k in node if k not in RESERVED]
        named = next((k for k in names if k in lowered), None) or next(
            (v for w, v in _ALIASES.items() if w in lowered and v in names), None)
        where = f"{key}.{named}={node[named]}" if named else key
        raise ConfigError(f"{where}: {node.get('_target_', key)} refused it: {text}") from None


def raised_in_torch_optim(e: BaseException, innermost: bool = True) -> bool:
    """True when the innermost frame of `e` is torch's optimizer or scheduler code, where
    torch checks argument values ("Invalid learning rate"); with `innermost=False`, when any
    frame is (an allocation inside an optimizer's step)."""
    tb, files = e.__traceback__, []
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename.replace("\\", "/"))
        tb = tb.tb_next
    return any("/torch/optim/" in name for name in (files[-1:] if innermost else files))


def build_callable(node: Any, key: str) -> Optional[Callable]:
    """A callable from a `_target_` node: a function named with no arguments is used as it is
    (no `_partial_` needed); a class or a node with arguments is instantiated (a partial with
    `_partial_: true`). None for a null node."""
    if node is None:
        return None
    target = target_of(node, key)
    given = [k for k in node if k not in RESERVED]
    if inspect.isfunction(target) and not given:
        return target
    params = parameters(target) if inspect.isfunction(target) else None
    if params is not None and not node.get("_partial_", False) and "_args_" not in node:
        # (the function itself, called with the arguments given: what it is called with
        # later, a batch's samples, is missing)
        missing = [n for n, p in params.items() if p.default is p.empty and n not in given]
        if missing and missing[0] == next(iter(params)):
            # (its first argument, the samples; a factory missing another of its own
            # arguments alone is told so by build)
            more = "".join(f" and +{key}.{n}=..." for n in missing[1:])
            raise ConfigError(f"{key}: {node['_target_']} takes '{missing[0]}' when it is "
                              f"called, and {', '.join(given)} from the config: set "
                              f"+{key}._partial_=true to bind those" +
                              (f" (with{more[4:]}, which it takes too)" if more else ""))
    obj = build(node, key)
    if not callable(obj):
        raise ConfigError(f"{key}: {node['_target_']} built a {type(obj).__name__}, which is "
                          "not callable; name a function, or set _partial_: true")
    return obj


def build_model(cfg: Any) -> Any:
    """The user's model (`cfg.model`) as a run builds it, offered `data.input_shape` and
    `data.num_classes` where its `_target_` takes them; ConfigError for one that is no
    torch.nn.Module."""
    import torch

    d = cfg.get("data") or {}
    offered = {"input_shape": None if d.get("input_shape") is None else list(d.input_shape),
               "num_classes": d.get("num_classes")}
    try:
        model = build(cfg.model, "model", offered, hint="; model=custom starts from no keys "
                                                        "but _target_")
    except InstantiationException as e:  # (a size of the model's too big for the machine)
        if e.__cause__ is None or not says_no_memory(e.__cause__):
            suspect = _unlike_its_default(cfg.model, e.__cause__)
            if suspect is None:
                raise
            raise ConfigError(suspect) from None
        raise ConfigError(_too_big(cfg.model, offered, e.__cause__)) from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model._target_={cfg.model._target_}: builds a "
                          f"{type(model).__name__}, not a torch.nn.Module")
    meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()]
                 if t.is_meta), None)
    if meta is not None:  # (its move to the device raised "Cannot copy out of meta tensor")
        raise ConfigError(f"model._target_={cfg.model._target_}: its {meta} is on the meta "
                          "device, a shape with no data; build the model with its weights "
                          "(or materialise them, e.g. to_empty() then their initialisation)")
    return model


def _unlike_its_default(node: Any, cause: BaseException) -> Optional[str]:
    """Where a model's constructor failed with a TypeError or ValueError and exactly one of the
    arguments the config gave is of another kind than its default (`+model.hidden=abc` for a
    `hidden=32`: a string where a number goes; a float where an int goes, for a TypeError),
    the line naming that key, its value and its default; None else (the error's own line
    names only the code that raised it). Not judged: nulls, nodes Hydra builds (`_target_`),
    parameters whose annotation admits other kinds (`hidden: int | list`), and an error whose
    words name another key it was given."""
    if not isinstance(cause, (TypeError, ValueError)):
        return None
    try:
        target = target_of(node, "model")
        params = inspect.signature(target).parameters
    except (ConfigError, TypeError, ValueError):
        return None
    odd = []
    for key in node:
        param = params.get(str(key))
        if key in RESERVED or param is None or param.default is inspect.Parameter.empty \
                or param.default is None or _takes_more_kinds(param):
            continue
        value = node[key]
        if value is None or OmegaConf.is_dict(value) or isinstance(value, dict):
            continue
        value, default = plain(value), param.default
        if argvalues.is_number(default) or isinstance(default, bool):
            # (the rule argvalues.check holds torch's own targets to, before the call; and a
            # float for an int, where the call's error is a TypeError)
            unlike = argvalues._not_like_default(value, param, sized=False) is not None or (
                type(default) is int and isinstance(value, float)
                and isinstance(cause, TypeError))
        elif isinstance(default, str):
            unlike = not isinstance(value, str)
        elif isinstance(default, (list, tuple)):
            unlike = not isinstance(value, (list, tuple))
        else:
            unlike = isinstance(value, bool)
        if unlike:
            odd.append((key, value, default))
    if len(odd) != 1:
        return None
    key, value, default = odd[0]
    text = str(cause).lower()
    named = [str(k) for k in node if k not in RESERVED and str(k).lower() in text]
    if named and str(key) not in named:  # (the error names another key it was given)
        return None
    return (f"model.{key}={_as_given(value)}: {node['_target_']} failed with it "
            f"({type(cause).__name__}: {first_line(cause)}); its default is "
            f"{_as_given(default)}, {_kind(default)}, where {_as_given(value)} is "
            f"{_kind(value)}")


def _takes_more_kinds(param: inspect.Parameter) -> bool:
    """Whether the parameter's annotation admits other kinds than its default's (a number's
    `int | str`, a string's `str | list`): then its default says nothing of its kind."""
    if argvalues.is_number(param.default) or isinstance(param.default, bool):
        return argvalues._takes_other_kinds(param)
    text = argvalues._annotation(param) or ""
    return any(word in text for word in ("int", "float", "bool", "list", "List", "tuple",
                                         "Tuple", "Sequence", "Any", "Callable", "object",
                                         "Union", "Mapping", "dict", "Dict"))


def _as_given(value: Any) -> str:
    """`value` as a command line's override gives it (true, [1, 2], abc)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_as_given, value)) + "]"
    return str(value)


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        type(value), "a list" if isinstance(value, (list, tuple)) else
        _a(type(value).__name__))


def _a(noun: str) -> str:
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


_NO_MEMORY = re.compile(r"can't allocate memory|out of memory|^MemoryError", re.IGNORECASE)


def says_no_memory(e: BaseException) -> bool:
    """Whether e is an allocation that failed: torch's allocators on the CPU and on CUDA, or
    Python's own MemoryError (its type alone)."""
    return bool(_NO_MEMORY.search(f"{type(e).__name__}: {e}"))
_ASKED = re.compile(r"allocate (\d+) bytes|allocate ([\d.]+ [KMGTP]?i?B)")


def _too_big(node: Any, offered: Dict[str, Any], cause: BaseException) -> str:
    """The one line for a model whose building ran out of memory: what it asked for, and the
    sizes it was built with (the data config's that it took, its node's own numbers)."""
    asked = _ASKED.search(str(cause))
    amount = "" if asked is None else \
        f" (it asked for {asked.group(2) or _bytes(int(asked.group(1)))} at once)"
    params = parameters(target_of(node, "model")) or {}
    sizes = [f"data.{k}={v}" for k, v in offered.items()
             if v is not None and k in params and k not in node]
    for k, v in node.items():
        value = plain(v)
        if argvalues.is_number(value) or (isinstance(value, list) and value
                                          and all(map(argvalues.is_number, value))):
            sizes.append(f"model.{k}={value}")
    return (f"model._target_={node['_target_']}: building the model ran out of memory{amount}; "
            f"are its sizes right? {', '.join(sizes) or 'its node sets none'}")


def _bytes(count: int) -> str:
    """A byte count in binary units: 5120000000000 -> '4.7 TiB'."""
    if count < 1024:
        return f"{count} bytes"
    n = float(count)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024
        if n < 1024:
            break
    return f"{n:.1f} {unit}"

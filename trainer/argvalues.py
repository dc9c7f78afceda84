"""A `_target_` node's values checked against the parameters of torch's and Stoker's own
targets, before the call: a number where the default is one (a learning rate), true or false
for a switch, as many numbers as a tuple default has (an optimizer's betas), null only where
the annotation takes None. A user's own class may take other kinds than its defaults show, so
its values are left to it."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from trainer.config import ConfigError


def check(node: Any, key: str, name: str, params: Dict[str, inspect.Parameter],
          given: List[str]) -> None:
    """Raises a one-line ConfigError for the first of `given` (keys of `node`, whose target
    `name` has `params`) whose value is not of the kind its parameter takes."""
    # torch's and Stoker's own signatures are known; a user's own class may take other
    # kinds than its defaults show (hidden=128 or [128, 64]), and would have no way round
    known = name.startswith(("torch.", "trainer."))
    optim = name.startswith("torch.optim.")  # fixed-length tuples (betas); models' vary
    for k in given if known else ():
        wrong = None if not optim and _takes_other_kinds(params[k]) else \
            _not_like_default(node[k], params[k], sized=optim)
        if wrong:
            given_text = "null" if node[k] is None else node[k]  # as the user wrote it
            if wrong == "a number" and _numeric_text(node[k]):  # ("1e-3" in quotes)
                given_text = repr(node[k])
                wrong = (f"a number, not the text {given_text} (quoted, in the override "
                         f"or a YAML file: write {key}.{k}={node[k]} unquoted)")
            raise ConfigError(f"{key}.{k}={given_text}: must be {wrong} ({name}'s default is "
                              f"{params[k].default})")


def is_number(value: Any) -> bool:
    """An int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _annotation(param: inspect.Parameter) -> Optional[str]:
    """The parameter's annotation as text ('float', 'bool | None'), None where it has none."""
    return None if param.annotation is param.empty else str(param.annotation)


def _takes_other_kinds(param: inspect.Parameter) -> bool:
    """Whether the parameter's annotation admits more than numbers (Conv2d's padding takes
    "same" or a tuple besides its default 0): then its default says nothing of its kind."""
    text = _annotation(param) or ""
    return any(word in text for word in ("str", "Any", "tuple", "Tuple", "list", "List",
                                         "Sequence", "_size", "Callable", "object"))


def _numeric_text(value: Any) -> bool:
    """Whether `value` is a string that reads as a number ('1e-3' quoted)."""
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def _not_like_default(value: Any, param: inspect.Parameter, sized: bool) -> Optional[str]:
    """What `value` must be, given a parameter whose default is a number (a learning rate) or,
    with `sized` (torch's optimizers), a tuple of numbers (betas: as many as the default has),
    when it is not that; None when it fits or nothing is known. A null is refused only where
    the annotation says the parameter takes no None (AdamW's `weight_decay: float`); without
    an annotation it is left to the callee (some take None for "off")."""
    default = param.default
    if isinstance(default, bool):  # a switch: "maybe" or 1 would pass as truthy
        if isinstance(value, bool):
            return None
        text = _annotation(param)
        if value is None and (text is None or "None" in text or "Optional" in text):
            return None
        return "true or false"
    if value is None:
        text = _annotation(param)
        takes_none = text is None or "None" in text or "Optional" in text
        return None if takes_none or not is_number(default) else "a number, not null"
    if is_number(default) and not is_number(value):
        return "a number"
    if sized and isinstance(default, tuple) and default and all(map(is_number, default)):
        values = list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) \
            else None
        if values is None or not all(map(is_number, values)) or len(values) != len(default):
            return f"{len(default)} numbers"
    return None

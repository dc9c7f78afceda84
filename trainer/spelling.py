"""Misspelt keys: `closest` tells a misspelling (letters within a word) from another word, and
`check_keyword_config` holds a Hugging Face config's keys, which it takes all and keeps as
attributes, to the settings the class has; `misspelt_required` and `unexpected_meant` find the
argument a key misspells in a target's own refusal (one taking **kwargs)."""
from __future__ import annotations

import difflib
import inspect
import logging
import re
from typing import Any, Callable, Iterable, List, Optional, Tuple

from trainer import distributed
from trainer.config import ConfigError, plain

log = logging.getLogger(__name__)


def closest(name: str, names: Iterable[str], short_words: bool = True) -> Optional[str]:
    """The one of `names` that `name` misspells: the same words (split at `_`) but for letters
    within one (`num_hiden_layers`, `lrr`), not a word for another (`sep_token_id` is no
    misspelt `pad_token_id`, nor `bos` of `eos`); None if none is, or if two are as close
    (`Conv` of Conv1d, Conv2d, Conv3d). `short_words`: also a word of 4 letters one letter
    off (`sise` for size), which a word for another can be too (`bias`, `bins`): for a hint,
    not for a refusal."""
    words, names = name.split("_"), list(names)
    if short_words:  # (under the ratio below: 0.75 for 4 letters)
        near = [n for n in names if _word_one_edit(words, n.split("_"))]
        if len(near) == 1:
            return near[0]
    found = []
    for other in difflib.get_close_matches(name, names, n=3, cutoff=0.8):
        theirs = other.split("_")
        if len(theirs) != len(words):  # (an underscore left out or added: the same letters)
            if other.replace("_", "") == name.replace("_", ""):
                return other
            continue
        if all(a == b or difflib.SequenceMatcher(None, a, b).ratio() >= 0.75
               for a, b in zip(words, theirs)):
            found.append((difflib.SequenceMatcher(None, name, other).ratio(), other))
    if len(found) > 1 and found[0][0] == found[1][0]:
        return None  # (a guess between equals)
    return found[0][1] if found else None


def meant(name: str, names: Iterable[str], *also: str) -> Optional[str]:
    """The one of `names` that `name` means: one of the same letters in another case (`Adamw`
    for AdamW; or of one of `also`, `val_r2` for r2), else the one it misspells (`closest`);
    None if none is."""
    names, wanted = list(names), {n.lower() for n in (name, *also)}
    same = [n for n in names if n.lower() in wanted]
    return same[0] if same else closest(name, names)


def _word_one_edit(words: List[str], theirs: List[str]) -> bool:
    """The one word that differs is one edit away: of 4 letters or more, or two neighbours
    swapped in a word of 3 (`mpl` for mlp; `bos` is a word, not a misspelt `eos`)."""
    differ = [(a, b) for a, b in zip(words, theirs) if a != b]
    if len(words) != len(theirs) or len(differ) != 1:
        return False
    a, b = differ[0]
    if min(len(a), len(b)) >= 4:
        return _one_edit(a, b)
    return len(a) == len(b) == 3 and a != b and sorted(a) == sorted(b) and _one_edit(a, b)


def _one_edit(a: str, b: str) -> bool:
    """`a` and `b` differ by one letter changed, added, left out, or two letters swapped."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def check_keyword_config(target: Callable, name: str, node: Any, given: List[str], key: str,
                         inits: Iterable[Callable]) -> None:
    """A Hugging Face config takes any keyword and keeps it as an attribute, so a misspelt
    setting (`num_hiden_layers`) built a model of the default size, silently: one that
    misspells a setting of the class is refused, naming it; another the config does not read
    (it stays an attribute of its own) is kept, with a warning. Token ids (`sep_token_id`) are
    kept as they are: tokenizers' and generation's, which configs carry."""
    if not (inspect.isclass(target) and any(
            c.__name__ in ("PretrainedConfig", "PreTrainedConfig")
            and c.__module__.startswith("transformers.") for c in target.__mro__)):
        return
    try:
        default = target()
        known = set(default.to_dict()) | set(getattr(target, "attribute_map", {}))
        for fn in inits:  # (the __init__s of the class and its bases)
            known |= set(inspect.signature(fn).parameters) - {"self", "kwargs"}
    except Exception:  # noqa: BLE001  (one that needs arguments: nothing to compare with)
        return
    for k in given:
        if k in known or hasattr(default, k) or k.endswith("_token_id") or \
                _read_by(target, k, node[k]):
            continue
        close = closest(k, sorted(known), short_words=False)  # (a refusal: no guess)
        if close:
            raise ConfigError(f"{key}.{k}: {name} has no setting '{k}'; did you mean "
                              f"{close}? (it would be kept as an extra attribute, and "
                              f"{close} left at its default, {getattr(default, close, None)!r})")
        if distributed.rank() == 0:  # (0 outside a process group too)
            log.warning("%s.%s: not a setting %s reads; kept on the config as an extra "
                        "attribute, for code that reads it (is it misspelt?)", key, k, name)


def _read_by(target: Callable, k: str, value: Any) -> bool:
    """Whether the config class reads keyword `k` (turns it into settings of its own, as
    Llama's reads rope_theta into rope_parameters) rather than keeping it as it is."""
    try:
        return not hasattr(target(**{k: plain(value)}), k)
    except Exception:  # noqa: BLE001  (a value it refuses: the build says so, named)
        return True


def misspelt_required(cause: BaseException,
                      given: Optional[List[str]]) -> Optional[Tuple[str, str]]:
    """(the key given, the argument it misspells) where `cause` is a TypeError for a required
    argument missing (`num_classes`) that one of the keys `given` misspells (`num_clases`)."""
    text = str(cause)
    if not isinstance(cause, TypeError) or "missing" not in text or given is None:
        return None
    missing = re.findall(r"'(\w+)'", text.split("missing", 1)[1])
    for key in given:
        meant = closest(key, missing)
        if meant:
            return key, meant
    return None


_UNEXPECTED = re.compile(r"Unexpected keyword arguments?: `?(\w+)`?")


def unexpected_meant(cause: BaseException, target: Optional[Callable], where: str) -> str:
    """"; did you mean <where>.<argument>?" where `cause` refuses a keyword (torchmetrics'
    "Unexpected keyword arguments: `multioutpt`", its classes taking **kwargs) that misspells
    an argument `target` names itself (besides its **kwargs); "" else."""
    found = _UNEXPECTED.search(str(cause))
    if found is None or target is None:
        return ""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return ""
    meant = closest(found.group(1), [n for n, p in params.items()
                                              if p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                            p.KEYWORD_ONLY)])
    return f"; did you mean {where}.{meant}?" if meant else ""

"""How an error reads as one line: Hydra's and OmegaConf's reports of a bad override, group
choice or value condensed to the key, what would be valid, and the spelling it was close to;
an OS error with the override that named its path. `cli.fail` prints it."""
from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import List, Optional

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from data.workerdeath import files_line, out_of_files
from trainer import components, spelling

# Hydra hints that do not apply to a typed schema or to this command line
# a config group's choices: the files that start with _ are shared bases, not choices
_OPTIONS = re.compile(r"(Available options in '[^']+': )(\S+(?: \S+)*)$")
_NOISE = re.compile(r"\s*To append to your config use \S+|,? set env var HYDRA_FULL_ERROR=1 to "
                    r"see chained exception\.?")


def _lines(text: str) -> List[str]:
    text = str(text)
    if "Original Traceback (most recent call last)" in text:
        # a loader worker's error, re-raised with the worker's traceback in its message: the
        # last line says what went wrong
        head = text.splitlines()[0].strip().rstrip(".")  # "Caught X in DataLoader worker ..."
        last = [ln.strip() for ln in text.splitlines() if ln.strip()][-1]
        return [f"{last} ({head[len('Caught '):] if head.startswith('Caught ') else head})"]
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Config search path") or line.startswith("Set the environment"):
            break
        if line and not line.startswith(("reference_type", "object_type", "full_key")):
            out.append(line)
    return out


def _schema_keys(e: OmegaConfBaseException) -> Optional[List[str]]:
    """The keys of the schema (a dataclass) a key was not found in; None for a node of none."""
    obj = getattr(e, "object_type", None)
    if isinstance(obj, type) and dataclasses.is_dataclass(obj):
        return [f.name for f in dataclasses.fields(obj)]
    return None


def _node_keys(e: OmegaConfBaseException) -> Optional[List[str]]:
    """The keys a config node of no schema has, for a key it lacks; None where not known."""
    node = getattr(e, "parent_node", None)
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else None


def _missing_key(e: OmegaConfBaseException, key: Optional[str], text: str) -> str:
    """What to add to the line of a key the config lacks: the keys there are (the schema's, or
    the node's own), the one it misspells, and, in a node of no schema, how to add a key."""
    schema = _schema_keys(e)
    names = schema if schema is not None else _node_keys(e)
    where, _, arg = (key or "").rpartition(".")
    if schema is not None:
        said = " (valid keys: " + ", ".join(schema) + ")"
    else:
        shown = [k for k in names or () if not k.startswith("_")]
        said = f" ({where} has: {', '.join(shown)})" if shown and where else ""
    close = spelling.closest(arg, names) if names and where else None
    if close:
        said += f"; did you mean {where}.{close}?"
    if "not in struct" in text:  # (a node of no schema: a key of one's own may be new)
        said += " (a key the config does not have yet is added with +key=value)"
    return said


_LEXER = "LexerNoViableAltException: "


def _unquoted(text: str) -> Optional[str]:
    """Hydra's lexer refusing a character of an override (a non-ASCII letter in a path), which
    it shows with a caret under a copy of the override: the character, and the quoting that
    takes it."""
    lines = text.splitlines()
    if len(lines) < 2 or not lines[0].startswith(_LEXER) or not lines[1].strip() == "^":
        return None
    override, at = lines[0][len(_LEXER):], lines[1].index("^") - len(_LEXER)
    key, eq, value = override.partition("=")
    # (in the key, or in a list or sweep, whose elements are quoted one by one: Hydra's words)
    if not eq or not len(key) < at < len(override) or any(c in value for c in "'\",[]{}"):
        return None
    return (f"{override}: Hydra's override grammar does not take {override[at]!r} unquoted; "
            f"quote the value: {key}=\"{value}\" (in a shell: '{key}=\"{value}\"')")


# Hydra's and OmegaConf's wrappers around an error raised by the user's or our own code: the
# wrapped message follows as the cause, so the wrapper is cut to what it adds
_CALL = re.compile(r"^Error in call to target '([^']+)': \w+\(.*\)$")
_COMPOSING = re.compile(r": \w+ raised while composing config: ")
_RESOLVING = re.compile(r"^\w+ raised while resolving interpolation: ")


def describe(e: BaseException) -> str:
    """One line for an exception and its causes, naming the key where one is known."""
    parts: List[str] = []
    cur: BaseException | None = e
    while cur is not None:
        unquoted = _unquoted(str(cur))
        if unquoted:
            return unquoted
        lines = _lines(str(cur))
        if isinstance(cur, OSError) and cur.filename and cur.strerror and \
                getattr(cur, "filename2", None) is None:
            lines = [_os_error(cur)]
        if out_of_files(cur):  # ("[Errno 24] Too many open files": what to change)
            lines = [files_line()]
        key = getattr(cur, "full_key", None)
        text = _NOISE.sub("", " ".join(lines)).strip().rstrip(".")
        override = getattr(cur, "override", None)
        if isinstance(override, str) and override and override not in text:
            # (Hydra's grammar error names no override: `mismatched input '=' ...`)
            text = f"{override}: {text}"
        text = _OPTIONS.sub(lambda m: m.group(1) + " ".join(
            o for o in m.group(2).split() if not o.startswith("_")), text)
        text = _choice_meant(text)
        call = _CALL.match(text)
        if call and cur.__cause__ is not None:
            text = call.group(1)
        if _RESOLVING.match(text):  # the key is where the interpolation is, not the mistake
            text = _RESOLVING.sub("", text) + (f" (while resolving {key})" if key else "")
            key = None
        if key and key not in text:
            text += f" (key: {key})"
        if isinstance(cur, OmegaConfBaseException) and "not in struct" in text and key:
            where, _, arg = key.rpartition(".")
            said = components.missing_key(where, getattr(cur, "parent_node", None), arg) \
                if where else None
            if said:  # (a _target_ node: what its target takes, not Hydra's wording)
                return said
        composing = _COMPOSING.search(text)
        if composing and cur.__cause__ is None and \
                isinstance(cur.__context__, OmegaConfBaseException):
            # a config file of one's own with a misspelt key: Hydra raised while handling it
            text = text[:composing.start()] + ": " + text[composing.end():]
            if " not in " in text:
                text += _missing_key(cur.__context__,
                                     getattr(cur.__context__, "full_key", None), text)
        if isinstance(cur, OmegaConfBaseException) and " not in " in text:
            text += _missing_key(cur, key, text)
        text = _package_line(_group_added_twice(_group_to_choose(
            _primary_config(text, str(cur)))))
        text = _override_unmatched(_blamed_file(text, str(cur)), str(cur))
        if text and text not in parts:
            parts.append(text)
        cur = cur.__cause__
    return _null_refused(": ".join(parts)) or type(e).__name__


_MISSING = re.compile(r"^Missing mandatory value: ([\w.]+)$")


def _group_to_choose(text: str) -> str:
    """OmegaConf's `Missing mandatory value: sched` for a config group left without a choice
    (`~sched`), with the choices it has."""
    missing = _MISSING.match(text)
    if not missing:
        return text
    try:
        from hydra.core.global_hydra import GlobalHydra

        loader = GlobalHydra.instance().config_loader()
        options = loader.get_group_options(missing.group(1).replace(".", "/"))
    except Exception:  # noqa: BLE001  (no Hydra composing: OmegaConf's words)
        return text
    if not options:
        return text
    return (f"{text} (a config group: choose one, {missing.group(1)}="
            f"{'|'.join(o for o in options if not o.startswith('_'))})")


_PRIMARY = re.compile(r"^Cannot find primary config '([^']+)'\. Check that it's in your config "
                      r"search path$")


def _primary_config(text: str, report: str) -> str:
    """Hydra's `Cannot find primary config 'trian'` (`--config-name`), with the configs in the
    folders of the search path its report lists (it named none) and the one it misspells."""
    missing = _PRIMARY.match(text)
    if not missing:
        return text
    options = sorted({f.stem for folder in _search_folders(report)
                      for f in folder.glob("*.yaml") if not f.name.startswith("_")})
    if not options:
        return text
    meant = spelling.closest(missing.group(1), options)
    return (f"--config-name {missing.group(1)}: no such config in the config search path "
            f"(it has: {', '.join(options)})" + (f"; did you mean {meant}?" if meant else ""))


def _search_folders(report: str) -> List[Path]:
    """The folders of the config search path: those Hydra's report lists (its own and the
    schema's left out), else those the command names (the script's `conf/`, `--config-dir`,
    `hydra.searchpath`)."""
    found = re.findall(r"provider=(?!hydra,|schema,)[^,]+, path=file://(.+)$", report,
                       flags=re.MULTILINE)
    if not found:
        args = sys.argv[1:]
        found = [str(Path(sys.argv[0]).resolve().parent / "conf")]
        found += [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--config-dir", "-cd")]
        found += [a.partition("=")[2] for a in args if a.startswith("--config-dir=")]
        found += [p for a in args if a.lstrip("+").startswith("hydra.searchpath=")
                  for p in re.findall(r"file://([^,\]'\"]+)", a)]
    return [Path(f.strip()) for f in found if Path(f.strip()).is_dir()]


_IN_CHOICE = re.compile(r"^In '([\w/]+)': (Could not find '([\w/]+)/([\w.-]+)')")


def _blamed_file(text: str, report: str) -> str:
    """Hydra blames the primary config (`In 'train': Could not find 'data/synthtic'`) for a
    choice misspelt in a config file of one's own (an experiment's defaults list): the file
    that makes the choice, where the command line does not."""
    found = _IN_CHOICE.match(text)
    if not found:
        return text
    group, choice = found.group(3), found.group(4)
    key = group.replace("/", ".")
    if any(a.lstrip("+~").partition("=")[::2] == (key, choice) for a in sys.argv[1:]):
        return text  # (the command's own choice)
    entry = re.compile(rf"^\s*-\s*(?:override\s+)?/?{re.escape(group)}\s*:\s*"
                       rf"{re.escape(choice)}\s*(?:#.*)?$", re.MULTILINE)
    for folder in _search_folders(report):
        for path in sorted(folder.rglob("*.yaml")):
            try:
                if not entry.search(path.read_text()):
                    continue
            except (OSError, UnicodeDecodeError):
                continue
            named = path.relative_to(folder).with_suffix("").as_posix()
            text = (f"In '{named}' ({path}): {found.group(2)}" + text[found.end():])
            return re.sub(rf"; did you mean {re.escape(key)}=([\w.-]+)\?$",
                          rf"; did you mean {group}: \1 there?", text)
    return text


_UNMATCHED = re.compile(r"Could not override '(\w+)'\. No match in the defaults list$")


def _override_unmatched(text: str, report: str) -> str:
    """Hydra's `In 'experiment/mine': Could not override 'dat'. No match in the defaults
    list`, with the config groups there are and the one it misspells."""
    found = _UNMATCHED.search(text)
    if not found:
        return text
    groups = sorted({d.name for folder in _search_folders(report) for d in folder.iterdir()
                     if d.is_dir() and not d.name.startswith(("_", "."))})
    if not groups:
        return text
    meant = spelling.closest(found.group(1), groups)
    return (f"{text} (the groups: {', '.join(groups)})"
            + (f"; did you mean {meant}?" if meant else ""))


_NOT_FOUND = re.compile(r"Could not find '([\w/]+)/([\w.-]+)' Available options in '[^']+': "
                        r"(\S+(?: \S+)*)$")


def _choice_meant(text: str) -> str:
    """Hydra's `Could not find 'task/regresion' Available options in 'task': ...` with the
    choice it misspells, as a misspelt key is said."""
    found = _NOT_FOUND.search(text)
    if not found:
        return text
    meant = spelling.closest(found.group(2), found.group(3).split())
    return f"{text}; did you mean {found.group(1).replace('/', '.')}={meant}?" if meant else text


_NOT_OPTIONAL = re.compile(r"^Error merging override (\S+)=null: field '([\w.]+)' is not "
                           r"Optional$")


def _null_refused(text: str) -> str:
    """Hydra's `Error merging override data.cache=null: field 'data.cache' is not Optional`
    with the key's default, where the schema has one: the value that turns a feature off
    (`none`, `0`, `false`) is what a user reaching for null looks for."""
    refused = _NOT_OPTIONAL.match(text)
    if not refused:
        return text
    from omegaconf import OmegaConf

    from trainer.config import TrainConfig

    key = refused.group(2)
    try:
        default = OmegaConf.select(OmegaConf.structured(TrainConfig), key,
                                   throw_on_missing=True)
    except OmegaConfBaseException:
        default = None
    shown = "" if default is None or isinstance(default, (dict, list, DictConfig)) else (
        f" (the schema's default is "
        f"{str(default).lower() if isinstance(default, bool) else default})")
    return f"{refused.group(1)}=null: {key} takes a value, not null{shown}"


_TWICE = re.compile(r"^(\S+) appears more than once in the final defaults list$")


def _group_added_twice(text: str) -> str:
    """Hydra's `data appears more than once in the final defaults list` for a command's
    `+data=digits` (the + adds a group the config has chosen already): with the override to
    write instead."""
    twice = _TWICE.match(text)
    if not twice:
        return text
    group = twice.group(1)
    added = next((a for a in sys.argv[1:] if a.startswith(f"+{group}=")), None)
    if added is None:
        return text
    return (f"{added}: {text} (the config chooses a {group} already: write "
            f"{added.lstrip('+')}, without the +, to choose it)")


def _os_error(e: OSError) -> str:
    """The path and what went wrong there, after the override that named it: a folder to make
    (hydra.run.dir, data.cache_dir) fails where the OS says so, not in our checks."""
    path = str(e.filename)
    if isinstance(e, (FileExistsError, NotADirectoryError)):  # where a folder was to be made
        blocker = next((p for p in [Path(path), *Path(path).parents]
                        if p.is_symlink() and not p.exists()), None)
        said = (f"{path}: a file is in the way where a folder must be ({e.strerror})"
                if blocker is None else
                f"{path}: {blocker} is a link to {os.readlink(blocker)}, which does not exist "
                "(or leads back to itself); make that folder, or give another path")
    else:
        said = f"{path}: {e.strerror}"
    override = _override_of(path)
    if override is None:
        return said
    return f"{override}: {said.removeprefix(override.partition('=')[2] + ': ')}"


def _override_of(path: str) -> str | None:
    """The command line's `key=value` whose value is `path` or a folder above it (the
    nearest), if any; values that are the working folder or the root name no one."""
    target = os.path.abspath(path)
    found, depth = None, -1
    for arg in sys.argv[1:]:
        key, eq, value = arg.lstrip("+~").partition("=")
        if not eq or not value or "=" in key or "," in value:
            continue
        folder = os.path.abspath(value)
        if folder in (os.getcwd(), os.sep):
            continue
        # (a path under the value: only a folder the run writes into, hydra.run.dir,
        # data.cache_dir; a dataset's root is not where outputs/ goes)
        under = key.endswith("dir") and target.startswith(folder.rstrip(os.sep) + os.sep)
        if (target == folder or under) and len(folder) > depth:
            found, depth = f"{key}={value}", len(folder)
    return found


def _package_line(text: str) -> str:
    """Hydra's `Could not override 'data@experiment.data'` for a config of one's own under a
    group (experiment/) that overrides other groups without `# @package _global_`."""
    found = re.search(r"Could not override '(\w+)@(\w+)\.\1'", text)
    if not found:
        return text
    return (f"{text} (a config under {found.group(2)}/ that overrides other groups' choices "
            "needs '# @package _global_' as its first line, as conf/experiment/*.yaml have)")

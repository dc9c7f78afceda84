"""Turns configuration mistakes into one line on stderr and exit code 2.

Hydra prints composition errors over several lines (or a traceback for errors in the task).
`exit_on_error` asks Hydra to re-raise instead (HYDRA_FULL_ERROR) and condenses whatever
describes a bad override, group choice or value into one line naming the key. Genuine bugs
keep their full traceback. A user who sets HYDRA_FULL_ERROR=1 gets Hydra's own output.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, List, NoReturn, Optional

from hydra.errors import HydraException
from torch.distributed.elastic.multiprocessing.errors import record
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from trainer.checkpoint import CheckpointError
from trainer.saver import writing_in_background
from trainer.config import ConfigError
from trainer import components, resumeargs, spelling, stamp
from trainer.distributed import LaunchError, detect

EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def exit_now(code: int) -> NoReturn:
    """Ends the process with `code` after Python's exit handlers ran (the logs flushed, a
    sweep's kept record settled), skipping the interpreter's and C++'s teardown: threads still
    inside torch (a checkpoint writer, a backend waiting on a lost peer) abort it there."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit(code: int) -> NoReturn:
    """SystemExit(code), for a run stopped at once (a second Ctrl-C or signal); `exit_now`
    where a checkpoint is still being written on its background thread. (The status is
    written; the write's temporary file goes at the run's next start.)"""
    if writing_in_background():
        exit_now(code)
    raise SystemExit(code)


class SignalledAgain(BaseException):
    """A second preemption signal (SIGTERM, SIGUSR1) while the first waits for the step to
    end: the step is stuck (a dataset read that never returns, say), so stop at once. A
    BaseException, as KeyboardInterrupt: no `except Exception` in user code swallows it."""

    def __init__(self, signum: int):
        import signal

        super().__init__(signal.Signals(signum).name)
        self.code = 128 + signum  # as a shell reports a process ended by that signal
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
        text = _package_line(_group_added_twice(_group_to_choose(text)))
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


USER_ERRORS = (ConfigError, CheckpointError, LaunchError, HydraException,
               OmegaConfBaseException)


def fail(e: BaseException, code: int = EXIT_CONFIG, any_rank: bool = False) -> NoReturn:
    """Prints `e` as one line (rank 0 only: every rank meets the same error; `any_rank`: an
    error of this rank's own, such as a lost peer, which rank 0 may be the one unable to say;
    and under torchrun a rank's own error that rank 0 did not meet: liveness.unmet_by_rank_0)
    and exits `code` (2: a configuration, data or checkpoint problem).

    Raised inside a Hydra task, SystemExit passes Hydra's job runner without its extra
    "Error executing job" line.
    """
    rank = getattr(e, "said_by_its_rank", None)  # an error of that rank's own (runner.train)
    env = detect()
    if getattr(e, "said_early", False):  # (rank 0, before it left the group: runner.train)
        pass
    elif any_rank or rank is not None:
        say(e)
    elif env.is_main:
        say(e)
        if env.world_size > 1:
            from trainer.liveness import mark_said  # (lazy: it imports the data pipeline)

            mark_said(env)
    elif not getattr(e, "rank0_asked", False):  # met before the group, or after it
        from trainer.liveness import OWN_WAIT_S, rank0_said

        if not rank0_said(env, OWN_WAIT_S):
            e.said_by_its_rank = env.rank
            say(e)
    reap_children()
    raise SystemExit(code)


def say(e: BaseException) -> None:
    """Prints `e`'s one line on stderr (`fail`'s; runner.train's rank 0 says it early)."""
    from trainer.task import raised_in_users_code  # (lazy: the task imports torch)

    rank = getattr(e, "said_by_its_rank", None)
    said = describe(e) + raised_in_users_code(e)
    said = said if rank is None else f"rank {rank}: {said}"
    print(f"stoker: error: {said}{resumeargs.took()}", file=sys.stderr, flush=True)


def reap_children() -> None:
    """Kills this process's loader workers: one that is stopped (SIGSTOP) or stuck would
    otherwise hold the exit for ever, as Python joins its children on the way out."""
    import multiprocessing
    import signal

    children = multiprocessing.active_children()
    if children and hasattr(signal, "SIGCHLD"):
        # the DataLoader's SIGCHLD handler would report each killed worker as a new error
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    from data.loader import kill_with_children  # (lazy: torch comes with it)

    for child in children:
        kill_with_children(child)  # SIGKILL: also ends a stopped process
        child.join(timeout=5)


def wants_traceback() -> bool:
    """True when the user set HYDRA_FULL_ERROR=1: then errors keep their full traceback."""
    return os.environ.get("STOKER_TRACEBACK") == "1"


def import_from_cwd() -> None:
    """`_target_`s name the user's own modules: they import from where the command is run, as
    with `python -m` (Python itself puts only the script's folder on the path)."""
    if os.getcwd() not in sys.path:
        sys.path.insert(1, os.getcwd())


_COMMAND: List[bool] = []  # [True] in train.py's own process (exit_on_error), not a library call
_COMPLETE: List[int] = []  # the pid of a process whose run completed (complete())
_ENDING = ("SIGTERM", "SIGUSR1", "SIGHUP", "SIGINT")


def complete() -> None:
    """The run is complete and its status.json says so: a SIGTERM, SIGUSR1, SIGHUP or Ctrl-C
    in the second or so the process still takes to end (its workers, its logs, the
    interpreter's own teardown) no longer kills it (exit 143 beside a status of "completed":
    a scheduler requeued the finished job). Until Python's exit handlers, the first such
    signal is let pass and the process ends 0 as it would have, and a second ends it at once,
    0; from the last exit handler on they are ignored (Python's teardown puts back the
    default action of a signal it handled, not of one ignored). Only in train.py's own
    process outside a sweep (a sweep's next job is for a signal to stop), from the main
    thread."""
    import signal
    import threading

    if not _COMMAND or threading.current_thread() is not threading.main_thread():
        return
    from trainer.sweep import in_sweep

    if in_sweep():
        return
    pid, seen = os.getpid(), []

    def ending(signum, frame) -> None:
        if os.getpid() != pid:  # (a process forked from this one: not its to decide)
            return
        if seen or threads_left(locked=False):  # (the exit would wait on for threads of the
            os._exit(0)                           # user's code)
        seen.append(signum)

    for name in _ENDING:
        sig = getattr(signal, name)
        if signal.getsignal(sig) != signal.SIG_IGN:  # (nohup: SIGHUP stays ignored)
            signal.signal(sig, ending)
    _COMPLETE[:] = [pid]


def threads_left(locked: bool = True) -> List[Any]:
    """The threads Python's exit waits for (alive, not daemons) besides the main one and the
    workers of thread pools, which the exit ends itself (torch.compile leaves some): threads
    the user's code started, since Stoker's own are daemons. `locked=False` reads the table
    of threads without its lock (a signal handler's: the lock may be held by the code the
    signal interrupted)."""
    import threading
    from concurrent.futures import thread as pools

    threads = threading.enumerate() if locked else list(threading._active.values())
    pooled = set(getattr(pools, "_threads_queues", {}).keys())
    return [t for t in threads if t is not threading.main_thread() and not t.daemon
            and t not in pooled and t.is_alive()]


def _say_threads_left() -> None:
    """After a complete run, the threads of the user's code that the exit waits for, in one
    line: the process sat silent after `done:` (ten minutes, once), and let the first SIGTERM
    pass; one now ends it (complete())."""
    left = threads_left()
    if left and _COMPLETE and _COMPLETE[0] == os.getpid():
        names = ", ".join(t.name for t in left[:3]) + (", ..." if len(left) > 3 else "")
        print(f"stoker: the run is complete; the process waits for {len(left)} thread"
              f"{'' if len(left) == 1 else 's'} of your code to end ({names}; not daemon "
              "threads): a Ctrl-C or SIGTERM ends it now", file=sys.stderr, flush=True)


def _ignored_once_complete() -> None:
    """The last of the exit handlers (registered first): see complete()."""
    import signal

    if _COMPLETE and _COMPLETE[0] == os.getpid():
        for name in _ENDING:
            signal.signal(getattr(signal, name), signal.SIG_IGN)


atexit.register(_ignored_once_complete)


def exit_on_error(main: Callable[[], None]) -> None:
    """Runs a @hydra.main function; composition errors exit 2 with one line from rank 0."""
    _COMMAND[:] = [True]
    if os.environ.get("HYDRA_FULL_ERROR"):
        os.environ["STOKER_TRACEBACK"] = "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own report
    _escape_what_the_console_cannot_show()
    _check_flag_order(sys.argv[1:])
    _check_search_path(sys.argv[1:])
    # (before Hydra composes: a run resumed in place keeps the overrides it was launched with)
    try:
        sys.argv[1:] = resumeargs.with_runs_own(sys.argv[1:])
    except ConfigError as e:  # (its record unreadable)
        fail(e)
    import_from_cwd()
    # under torchrun, record() writes a crash's traceback where the agent reports it; the
    # errors said in one line are turned into SystemExit inside it, which it does not record
    # (torchrun printed a rank's whole traceback for a misspelt key)
    record(lambda: _one_line_errors(main))()
    _say_threads_left()


def _escape_what_the_console_cannot_show() -> None:
    """A console of a non-UTF-8 locale (LC_ALL=C, without Python's UTF-8 mode) could not
    encode a line naming a non-ASCII path, nor a UTF-8 one a path's bytes that are not UTF-8:
    logging printed its traceback and lost the line (train.log is UTF-8 whatever the
    locale). Such characters are written escaped instead."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) in ("strict", "surrogateescape") and \
                hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def _check_flag_order(args: List[str]) -> None:
    """-m (--multirun) between overrides: Hydra's argument parser takes the overrides before it
    and refuses the ones after it with its whole usage block; one line says where it goes."""
    flags = [i for i, a in enumerate(args) if a in ("-m", "--multirun")]
    overrides = [i for i, a in enumerate(args) if "=" in a and not a.startswith("-")]
    if flags and any(i < flags[0] for i in overrides) and any(i > flags[0] for i in overrides):
        fail(ConfigError(f"{args[flags[0]]} (a sweep) goes before the overrides, not among "
                         f"them: python train.py {args[flags[0]]} "
                         + " ".join(a for a in args if a != args[flags[0]])))


_SEARCH_ITEM = re.compile(r"file://([^,\]'\"]+)")


def _check_search_path(args: List[str]) -> None:
    """A `hydra.searchpath` folder that is not there: Hydra printed a raw warning naming it,
    then blamed the config that folder was to give (`Could not find 'experiment/mine'`)."""
    for arg in args:
        key, _, value = arg.lstrip("+").partition("=")
        if key != "hydra.searchpath":
            continue
        for path in _SEARCH_ITEM.findall(value):
            if not os.path.isdir(path.strip()):
                fail(ConfigError(f"{arg}: {path.strip()} is not a folder (a config folder of "
                                 "your own, given as file:///its/absolute/path)"))


def _package_line(text: str) -> str:
    """Hydra's `Could not override 'data@experiment.data'` for a config of one's own under a
    group (experiment/) that overrides other groups without `# @package _global_`."""
    found = re.search(r"Could not override '(\w+)@(\w+)\.\1'", text)
    if not found:
        return text
    return (f"{text} (a config under {found.group(2)}/ that overrides other groups' choices "
            "needs '# @package _global_' as its first line, as conf/experiment/*.yaml have)")


def _ctrl_c_kept(main: Callable[[], None]) -> None:
    """A Ctrl-C met inside library code can surface as another error: omegaconf's clean-up
    failed on the config it left half-built and said `'NoneType' object has no attribute
    '_invalidate_flags_cache' (key: defaults)`, exit 2. An error raised while a
    KeyboardInterrupt was being handled is the interrupt."""
    try:
        main()
    except Exception as e:
        if _met_a_ctrl_c(e):
            raise KeyboardInterrupt from e
        raise


def _met_a_ctrl_c(e: BaseException) -> bool:
    seen, todo = set(), [e]
    while todo:
        e = todo.pop()
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        todo += [c for c in (e.__cause__, e.__context__) if c is not None and id(c) not in seen]
    return False


def _one_line_errors(main: Callable[[], None]) -> None:
    try:
        _ctrl_c_kept(main)
    except USER_ERRORS as e:
        if wants_traceback():
            reap_children()
            raise
        fail(e)
    except OSError as e:  # Hydra cannot create the run dir (read-only, a file in the way)
        if wants_traceback():
            reap_children()
            raise
        fail(e, code=1)
    except RuntimeError as e:
        if wants_traceback() or 'Could not detect "srun"' not in str(e):
            reap_children()
            raise
        # submitit's SLURM executor, built by hydra/launcher=slurm, on a machine without SLURM
        stamp.nothing_launched()  # (the sweep dir Hydra made goes at exit)
        fail(ConfigError("hydra/launcher=slurm: this machine has no SLURM (no srun on the "
                         "PATH); submit from a cluster's login node, or leave the launcher out "
                         "to run the sweep here"))
    except SystemExit:  # (a sweep job's crash ends the sweep so: ending.end_sweep)
        # loader workers forked under the run's SIGTERM handler would outlive the
        # terminate() that Python's exit sends them, and the exit waits on them for ever
        reap_children()
        raise
    except SignalledAgain as e:
        reap_children()
        if wants_traceback():
            raise
        if detect().is_main:
            print(f"stoker: stopped at once on a second {e}, without a checkpoint (the step "
                  "did not end; the checkpoints written stay)", file=sys.stderr, flush=True)
        _exit(e.code)
    except KeyboardInterrupt:  # a second Ctrl-C (the first stops at a step with a checkpoint)
        reap_children()
        if wants_traceback():
            raise
        if detect().is_main:
            print("stoker: interrupted", file=sys.stderr, flush=True)
        _exit(EXIT_INTERRUPTED)
    except BaseException:  # a traceback: still, no stopped worker may hold the exit
        reap_children()
        raise

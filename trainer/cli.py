"""Turns configuration mistakes into one line on stderr and exit code 2.

Hydra prints composition errors over several lines (or a traceback for errors in the task).
`exit_on_error` asks Hydra to re-raise instead (HYDRA_FULL_ERROR) and prints whatever
describes a bad override, group choice or value as one line naming the key (the wording:
trainer.oneline), from one rank, and ends the process and its loader workers. Genuine bugs
keep their full traceback. A user who sets HYDRA_FULL_ERROR=1 gets Hydra's own output.
"""
from __future__ import annotations

import atexit
import os
import re
import sys
from typing import Any, Callable, List, NoReturn

import yaml
from hydra.errors import HydraException
from torch.distributed.elastic.multiprocessing.errors import record
from omegaconf.errors import OmegaConfBaseException

from trainer.checkpoint import CheckpointError
from trainer.saver import writing_in_background
from trainer.config import ConfigError
from trainer import resumeargs, stamp
from trainer.distributed import detect
from trainer.launchvars import LaunchError
from trainer.oneline import describe

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
# the pid of a process whose run completed, or stopped with its checkpoint (complete()), and
# its exit code
_COMPLETE: List[int] = []
_ENDING = ("SIGTERM", "SIGUSR1", "SIGHUP", "SIGINT")


def complete(code: int = 0) -> None:
    """The run is complete and its status.json says so (`code` 0), or it stopped on a signal
    or Ctrl-C with its checkpoint (`code` 75 or 130; Preemption.__exit__): a SIGTERM, SIGUSR1,
    SIGHUP or Ctrl-C in the second or so the process still takes to end (its workers, its
    logs, the interpreter's own teardown) no longer kills it (exit 143 beside a status of
    "completed" or "preempted": a scheduler requeued the finished job, or took a stopped one
    for killed; a second signal soon after the first lost the stop's line). Until Python's
    exit handlers, the first such signal is let pass and the process ends with `code` as it
    would have, and a second ends it at once, `code`; from the last exit handler on they are
    ignored (Python's teardown puts back the default action of a signal it handled, not of
    one ignored). Only in train.py's own process, from the main thread; a completed one
    outside a sweep (a sweep's next job is for a signal to stop; a stopped one ends it)."""
    import signal
    import threading

    if not _COMMAND or threading.current_thread() is not threading.main_thread():
        return
    from trainer.sweep import in_sweep

    if code == 0 and in_sweep():
        return
    pid, seen = os.getpid(), []

    def ending(signum, frame) -> None:
        if os.getpid() != pid:  # (a process forked from this one: not its to decide)
            return
        if seen or threads_left(locked=False):  # (the exit would wait on for threads of the
            os._exit(code)                        # user's code)
        seen.append(signum)

    for name in _ENDING:
        sig = getattr(signal, name)
        if signal.getsignal(sig) != signal.SIG_IGN:  # (nohup: SIGHUP stays ignored)
            signal.signal(sig, ending)
    _COMPLETE[:] = [pid, code]


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
    if left and _COMPLETE == [os.getpid(), 0]:
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


# where Hydra reads a config file: a YAML error raised through one is that file's syntax
_CONFIG_READERS = ("config_repository.py", "config_source.py")


def _config_file_syntax(e: BaseException) -> "str | None":
    """A YAML syntax error in a config file Hydra was reading (conf/, a hydra.searchpath of
    one's own), as one line naming the file, line and column; None for any other error (a
    YAML file one's own code reads keeps its traceback)."""
    import traceback

    if not any(
            os.path.basename(frame.filename).endswith(_CONFIG_READERS)
            and f"{os.sep}hydra{os.sep}" in frame.filename
            for frame in traceback.extract_tb(e.__traceback__)):
        return None
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or not problem:
        return "a config file is not valid YAML: " + " ".join(str(e).split())
    line = f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {problem}"
    context, at = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        line += f" ({context}" + (f" that begins at line {at.line + 1}, column {at.column + 1}"
                                  if at is not None and at.name == mark.name else "") + ")"
    return line


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
    except yaml.YAMLError as e:  # a config file Hydra read is not valid YAML
        line = _config_file_syntax(e)
        if line is None or wants_traceback():
            reap_children()
            raise
        fail(ConfigError(line))
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
            print(f"stoker: stopped at once on a second {e}, without a checkpoint (before "
                  "the step, or the validation after it, ended; the checkpoints written stay)",
                  file=sys.stderr, flush=True)
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

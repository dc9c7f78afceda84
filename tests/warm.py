"""Warm starts for the suite's `python train.py` runs (`helpers.bounded`, test_resilience's
`start_and_wait`): a process that has imported torch (and torch._dynamo, which torch's
optimizers import when the first one is built), Hydra, OmegaConf and the TensorBoard records a
run writes forks each run instead of a new interpreter importing them again, about 5 s of CPU
a run on a 2-core machine, where the suite starts hundreds. The forked run is what
`python train.py ARGS` is from its first line on: train.py run as `__main__` with its own
argv, working dir, environment (the sitecustomize of `helpers.STACKS` read again under it),
stdio, session and exit code.

torchrun's agent (`python -m torch.distributed.run ARGS`) is forked likewise, as `-m` runs it,
and so are its ranks but the last (`_Ranks`): copies of the agent forked before it starts, each
the agent's child as torchrun's own ranks are, started as `python -u train.py ARGS` would be.
The last local rank of a job of two or more starts as torchrun starts it, a new interpreter
with a string-hash seed of its own.

A run is forked only from a warm process that started as its own interpreter would: with the
same PYTHON*, locale, torch and thread variables. The first such environment a pytest worker
asks for gets a warm process at once, another one (OMP_NUM_THREADS=1, say) on its second run,
up to MAX_WARM of them; until then its runs start cold. So do runs with a preexec_fn, or not
of train.py itself or torchrun (another `-m module`), and every run where the suite's
environment holds STOKER_TEST_COLD=1.

The warm process (`python -m tests.warm FD`) forks, for each request on its socket, a keeper
that forks the run and reports the run's pid and then its exit code on the request's own
socket; the warm process itself stays single-threaded and never waits (its keepers are reaped
by SIGCHLD being ignored). It ends when the suite's end of its socket closes.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.py")
TORCHRUN = ["-m", "torch.distributed.run"]


def _is_train(arg: str) -> bool:
    """Whether the path `arg` names this train.py (TRAIN is resolved already)."""
    return os.path.realpath(arg) == TRAIN


# what an interpreter reads as it starts (or torch and its OpenMP runtime as they are
# imported): a run whose values differ from the warm process's starts cold (KMP_ is the Intel
# runtime's, which a library in the suite's process sets; torch's Linux wheels use GNU's)
_STARTUP = ("PYTHON", "LC_", "LANG", "TORCH", "OMP_", "MKL_", "CUDA", "NCCL")
MAX_WARM = 3
_servers: Dict[tuple, "_Warm"] = {}  # (by the startup environment they were started with)
_asked: Dict[tuple, int] = {}
_failed = False


def _startup_env(env: Dict[str, str]) -> Dict[str, str]:
    # (inductor, which the warm process does not import, reads its variables when used:
    # torch sets TORCHINDUCTOR_CACHE_DIR in the suite's environment once a test compiles)
    return {k: v for k, v in env.items()
            if k.startswith(_STARTUP) and not k.startswith("TORCHINDUCTOR_")}


class WarmRun:
    """The part of subprocess.Popen that the suite uses, for a forked run: pid, args,
    returncode, communicate(timeout) (text, both pipes, or stderr in stdout's and None for
    it; again after a timeout), poll, wait, send_signal, kill; and `warm`, the pid of the warm
    process it was forked from."""

    def __init__(self, args: List[str], pid: int, status: socket.socket, out: int,
                 err: Optional[int], warm: int):
        self.args, self.pid, self.returncode, self.warm = args, pid, None, warm
        self._status = status
        self._sel = selectors.DefaultSelector()
        self._merged = err is None
        self._chunks = {fd: [] for fd in (out, err) if fd is not None}
        for fd in self._chunks:
            os.set_blocking(fd, False)
            self._sel.register(fd, selectors.EVENT_READ)

    def communicate(self, timeout: Optional[float] = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._sel.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for key, _ in self._sel.select(left):
                data = os.read(key.fd, 65536)
                if data:
                    self._chunks[key.fd].append(data)
                else:
                    self._sel.unregister(key.fd)
                    os.close(key.fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        # (as Popen's text mode reads them: the locale's UTF-8, universal newlines)
        out, *err = (b"".join(c).decode().replace("\r\n", "\n").replace("\r", "\n")
                     for c in self._chunks.values())
        return out, None if self._merged else err[0]

    def poll(self) -> Optional[int]:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self.wait()  # (its exit code, or the keeper's end, is there to read)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (an ended run's pid may be another process's by now)
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self._status.settimeout(timeout)
            try:
                data = self._status.recv(4)
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self.returncode = struct.unpack("i", data)[0] if len(data) == 4 else -9
            self._status.close()
        return self.returncode


class _Warm:
    """The suite's handle of one warm process."""

    def __init__(self, env: Dict[str, str]):
        self.sock, theirs = socket.socketpair()
        # (without the suite's STOKER_TEST_ variables: STACKS' sitecustomize reads them as
        # each run starts, and would read them as the warm process starts, for all its runs)
        env = {k: v for k, v in env.items() if not k.startswith("STOKER_TEST_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm", str(theirs.fileno())],
                                     cwd=ROOT, env=env, pass_fds=[theirs.fileno()],
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.sock.settimeout(120)  # (its imports: seconds)
        if self.sock.recv(5) != b"ready":
            raise OSError("the warm process did not start")
        self.sock.settimeout(None)
        self.lock = threading.Lock()  # (one request at a time on the socket)
        atexit.register(self.close)

    def start(self, cmd: List[str], cwd, env: Dict[str, str], merged: bool,
              default_signals) -> WarmRun:
        mine, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = (None, out_w) if merged else os.pipe()
        module = cmd[2] if cmd[1] == "-m" else None
        argv = cmd[3:] if module else cmd[1:]
        request = {"argv": argv, "module": module, "cwd": str(cwd), "env": env,
                   "default_signals": [int(s) for s in default_signals]}
        try:
            with self.lock:
                _send(self.sock, request, [theirs.fileno(), out_w, err_w])
        finally:
            for fd in {out_w, err_w}:
                os.close(fd)
            theirs.close()
        mine.settimeout(60)
        data = mine.recv(4)
        if len(data) != 4:
            raise OSError("the warm process forked no run")
        pid = struct.unpack("i", data)[0]
        return WarmRun(cmd, pid, mine, out_r, err_r, self.proc.pid)

    def close(self) -> None:
        try:
            self.sock.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def start(cmd: List[str], cwd, env: Dict[str, str], preexec_fn=None, merged: bool = False,
          default_signals=()):
    """The run `cmd` forked from the warm process, or None where it must start cold.
    `merged`: its stderr into its stdout's pipe (Popen's stderr=STDOUT); `default_signals`:
    signals it takes at their default disposition whatever the suite's (what a cold run's
    preexec_fn would set)."""
    global _failed
    if (_failed or preexec_fn is not None or os.environ.get("STOKER_TEST_COLD") == "1"
            or len(cmd) < 2 or cmd[0] != sys.executable
            or not (cmd[1] == TRAIN or cmd[1:3] == TORCHRUN)):
        return None
    key = tuple(sorted(_startup_env(env).items()))
    server = _servers.get(key)
    try:
        if server is None or server.proc.poll() is not None:
            _asked[key] = _asked.get(key, 0) + 1
            others = [k for k in _servers if k != key]
            if (others and _asked[key] < 2) or len(others) >= MAX_WARM:
                return None
            server = _servers[key] = _Warm(env)
        return server.start(cmd, cwd, env, merged, default_signals)
    except OSError as e:  # (no warm process: every run starts cold, said once)
        _failed = True
        print(f"tests.warm: runs start cold: {e}", file=sys.stderr)
        return None


# ---- the warm process -------------------------------------------------------------------

_STDIO: Dict[str, tuple] = {}  # (its standard streams' encoding and errors, as it started)


def _serve(fd: int) -> None:
    import hydra  # noqa: F401
    import omegaconf  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (an optimizer's constructor imports it)
    # what rank 0 of every run imports for its TensorBoard events (trainer/logging.py): 0.1 s
    import tensorboard.compat.proto.event_pb2  # noqa: F401
    import tensorboard.compat.proto.summary_pb2  # noqa: F401
    import tensorboard.summary.writer.record_writer  # noqa: F401

    _STDIO.update({name: (getattr(sys, name).encoding, getattr(sys, name).errors)
                   for name in ("stdin", "stdout", "stderr")})
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its keepers: reaped as they end
    sock.sendall(b"ready")
    while True:
        got = _receive(sock)
        if got is None:
            return  # the suite ended
        if os.fork() == 0:
            sock.close()
            _keep(*got)
        for f in got[1:]:
            os.close(f)


def _send(sock: socket.socket, request: dict, fds: List[int]) -> None:
    """`request` and three file descriptors, as `_receive` reads them."""
    body = json.dumps(request).encode()
    socket.send_fds(sock, [struct.pack("Q", len(body)) + body], fds)


def _receive(sock: socket.socket) -> Optional[tuple]:
    """(request, fd, fd, fd) sent by `_send`, or None when the other end closed first."""
    try:
        head, fds, _, _ = socket.recv_fds(sock, 8, 3)
    except OSError:
        return None
    if len(head) < 8 or len(fds) != 3:
        return None
    size = struct.unpack("Q", head)[0]
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return (json.loads(body), *fds)


def _keep(request: dict, status_fd: int, out: int, err: int) -> None:
    """The keeper: forks the run, says its pid, waits for it, says its exit code."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        status = socket.socket(fileno=status_fd)
        pid = os.fork()
        if pid == 0:
            status.close()
            _run(request, out, err)
        os.close(out)
        os.close(err)
        status.sendall(struct.pack("i", pid))
        _, raw = os.waitpid(pid, 0)
        status.sendall(struct.pack("i", os.waitstatus_to_exitcode(raw)))
        code = 0
    finally:
        os._exit(code)


def _run(request: dict, out: int, err: int, stdin: Optional[int] = None) -> None:
    """The run, as `python train.py ARGS` would start it in a session of its own (its stdin
    /dev/null, or `stdin`). A torchrun rank's request (`_Ranks`) also holds "unbuffered"
    (`python -u`) and "ignored" (the signals its agent ignores, which a new interpreter
    finds ignored; every other one at its default)."""
    code = 1
    try:
        if os.getsid(0) != os.getpid():  # (a rank's copy has a session of its own already)
            os.setsid()
        null = os.open(os.devnull, os.O_RDONLY) if stdin is None else stdin
        for fd, to in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, to)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # the standard streams as an interpreter opens them (its create_stdio: PYTHONUNBUFFERED
        # or -u, written through; else line-buffered to a terminal, and stderr always; the
        # encoding and errors of this process's own, which started with the same locale)
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED")) or request.get("unbuffered", False)
        for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
            raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
            raw.name = f"<{name}>"
            size = os.fstat(fd).st_blksize  # (io.open's buffer: the file's block size)
            size = size if size > 1 else io.DEFAULT_BUFFER_SIZE
            buffered = raw if unbuffered and fd else (io.BufferedReader(raw, size) if fd == 0
                                                      else io.BufferedWriter(raw, size))
            encoding, errors = _STDIO[name]
            stream = io.TextIOWrapper(buffered, encoding=encoding, errors=errors, newline="\n",
                                      line_buffering=not unbuffered and (raw.isatty() or fd == 2),
                                      write_through=unbuffered)
            stream.mode = "r" if fd == 0 else "w"
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        if "ignored" in request:
            _signals_of_a_new_interpreter(set(request["ignored"]))
        else:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in request["default_signals"]:
            signal.signal(sig, signal.SIG_DFL)
        import runpy

        if request.get("module") == TORCHRUN[1]:
            _Ranks.ready(request)  # (before its stacks' sitecustomize: the ranks run their own)
        stacks = ROOT / "tests" / "stacks" / "sitecustomize.py"
        if str(stacks.parent) in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            runpy.run_path(str(stacks))  # (as it read its environment at start-up)
        module = request.get("module")
        if module:  # (`-m`: the working dir first on the path; argv[0] the module's file)
            sys.argv = ["-m", *request["argv"]]
            sys.path[0] = os.getcwd()
        else:
            sys.argv = list(request["argv"])
            sys.path[0] = str(ROOT)  # (the script's folder, as `python train.py` puts it)
        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException as e:  # noqa: BLE001  (as the interpreter reports it)
            sys.excepthook(type(e), e, e.__traceback__)
            if isinstance(e, KeyboardInterrupt):  # (the interpreter ends by the signal)
                sys.stderr.flush()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            code = 1
        # the interpreter's exit: its threads that are no daemons waited for, its exit
        # handlers, then its streams flushed
        threading._shutdown()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    finally:
        os._exit(code)


# the signals a handler of faulthandler's may hold (PYTHONFAULTHANDLER): left as they are
_FATAL = {signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT, signal.SIGBUS, signal.SIGILL}


def _signals_of_a_new_interpreter(ignored: set) -> None:
    """Every signal as a new interpreter started by Popen finds and sets it: those `ignored`
    by its parent stay ignored, every other one at its default (Popen's exec), then Python's
    own: SIGPIPE and SIGXFSZ ignored, SIGINT raising KeyboardInterrupt unless ignored.
    faulthandler's registrations (STACKS' SIGUSR2) are undone: the run registers its own."""
    import faulthandler

    for sig in signal.valid_signals() - _FATAL - {signal.SIGKILL, signal.SIGSTOP}:
        try:
            faulthandler.unregister(sig)
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        except (OSError, ValueError, RuntimeError):  # (one the C library keeps for itself)
            pass
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class _Rank:
    """What torchrun's agent keeps of a rank it started (a subprocess.Popen's pid, args,
    returncode, poll, wait, send_signal, terminate, kill), for a rank that one of its
    `_Ranks` copies became: its own child, waited for as Popen waits for one."""

    def __init__(self, args: List[str], pid: int):
        self.args, self.pid, self.returncode = args, pid, None
        self.stdin = self.stdout = self.stderr = None

    def _reaped(self, flags: int) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # (reaped elsewhere: as Popen says then)
                pid, status = self.pid, 0
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> Optional[int]:
        return self._reaped(os.WNOHANG)

    def wait(self, timeout: Optional[float] = None) -> int:
        if timeout is None:
            return self._reaped(0)
        deadline, delay = time.monotonic() + timeout, 0.0005
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(min(delay, left, 0.05))
            delay *= 2
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Ranks:
    """Warm ranks for torchrun's agent, itself a warm run: before it starts (while it is one
    thread), it forks a copy of itself for each local rank but the last of its first start
    (for the one of a job of one), which waits in a session of its own. torchrun's
    `Popen([python, "-u", train.py, ARGS], env=..., start_new_session=True)` of a rank then
    sends that rank's argv, working dir, environment, standard streams and ignored signals
    to a waiting copy, which runs it as `_run` runs a run; the rank is the agent's child, as
    torchrun's own are (the run stamp, launch id and parent-death signal read the agent as
    the parent).

    The copies share the warm process's string-hash seed, so the last local rank of a job of
    two or more starts as torchrun starts it, a new interpreter with a seed of its own: an
    order of a set of strings that differs between processes still differs between the
    ranks of every such job. So do the ranks torchrun starts again (--max-restarts: no copy
    is left), one that is not `python -u` of this train.py, and one whose startup
    environment differs from the agent's other than by torchrun's own TORCHELASTIC_ and
    TORCH_NCCL_ variables (read as they are used): an OMP_NUM_THREADS=1 that torchrun sets
    where the agent found none, say (the suite sets it). A copy that waits ignores the
    signals a test may send every process of the job; copies left waiting end as the agent
    does (their socket's other end closes). Where they cannot be forked, the ranks start
    cold."""

    _RUNTIME = ("TORCHELASTIC_", "TORCH_NCCL_")
    _IGNORED_WHILE_WAITING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                              signal.SIGUSR1)

    @classmethod
    def ready(cls, request: dict) -> None:
        count = cls._asked(request["argv"], request["env"])
        if count and len(os.listdir("/proc/self/task")) == 1:  # (a fork of one thread only)
            try:
                cls(count, request["env"]).replace_popen()
            except OSError:  # (no process or socket to be had: cold ranks)
                pass

    @staticmethod
    def _asked(argv: List[str], env: Dict[str, str]) -> int:
        """How many copies torchrun's `argv` asks for: its local ranks but the last, or its
        one; 0 where its script is not this train.py or its --nproc-per-node (or torchrun's
        PET_NPROC_PER_NODE) is no number."""
        import argparse

        script = next((i for i, arg in enumerate(argv)
                       if not arg.startswith("-") and _is_train(arg)), None)
        if script is None:
            return 0
        parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False,
                                         exit_on_error=False)
        parser.add_argument("--nproc-per-node", "--nproc_per_node",
                            default=env.get("PET_NPROC_PER_NODE", "1"))
        try:
            nproc = int(parser.parse_known_args(argv[:script])[0].nproc_per_node)
        except (argparse.ArgumentError, ValueError):
            return 0
        return nproc - 1 if nproc > 1 else max(0, nproc)

    def __init__(self, count: int, env: Dict[str, str]):
        self.env, self.waiting = dict(env), []  # (pid, socket) of each copy
        for _ in range(count):
            mine, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                mine.close()
                for _, other in self.waiting:
                    other.close()
                self._wait(theirs)
            theirs.close()
            self.waiting.append((pid, mine))

    def replace_popen(self) -> None:
        """torchrun's Popen of a rank: `start`, else Popen."""
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler)

        handler = subprocess_handler.SubprocessHandler
        popen, ranks = handler._popen, self

        def _popen(self, args, env):
            proc = ranks.start(list(args), env, self._stdout, self._stderr)
            return popen(self, args, env) if proc is None else proc

        handler._popen = _popen

    @staticmethod
    def _wait(sock: socket.socket) -> None:
        """A copy: waits for its rank's request (or the agent's end), then runs it."""
        try:
            for sig in _Ranks._IGNORED_WHILE_WAITING:  # (until it is a rank)
                signal.signal(sig, signal.SIG_IGN)
            os.setsid()
            got = _receive(sock)
            if got is not None:
                sock.close()
                request, stdin, out, err = got
                _run(request, out, err, stdin)
        finally:
            os._exit(0)

    def start(self, args: List[str], env: Dict[str, str], stdout, stderr) -> Optional[_Rank]:
        """The rank `args` run by a waiting copy, or None where it must start cold."""
        if (not self.waiting or len(args) < 3 or args[:2] != [sys.executable, "-u"]
                or not _is_train(args[2])
                or int(env.get("LOCAL_RANK", 0)) == int(env.get("LOCAL_WORLD_SIZE", 1)) - 1 > 0):
            return None
        mine, theirs = _startup_env(self.env), _startup_env(env)
        if any(mine.get(k) != theirs.get(k) for k in set(mine) | set(theirs)
               if not k.startswith(self._RUNTIME)):
            return None
        ignored = [int(sig) for sig in signal.valid_signals()
                   if signal.getsignal(sig) == signal.SIG_IGN]
        try:
            cwd = os.getcwd()
        except OSError:  # (removed: a new interpreter would start in it all the same)
            return None
        request = {"argv": args[2:], "module": None, "cwd": cwd, "env": env,
                   "default_signals": [], "ignored": ignored, "unbuffered": True}
        pid, sock = self.waiting.pop(0)
        try:
            _send(sock, request, [0, stdout.fileno() if stdout else 1,
                                  stderr.fileno() if stderr else 2])
        except OSError:  # (that copy is gone: killed while it waited)
            return None
        finally:
            sock.close()
        return _Rank(args, pid)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))

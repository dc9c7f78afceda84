"""Warm starts for the suite's `python train.py` runs (`helpers.bounded`, test_resilience's
`start_and_wait`): a process that has imported torch (and torch._dynamo, which torch's
optimizers import when the first one is built), Hydra, OmegaConf and the TensorBoard records a
run writes forks each run instead of a new interpreter importing them again, about 5 s of CPU
a run on a 2-core machine, where the suite starts hundreds. The forked run is what
`python train.py ARGS` is from its first line on: train.py run as `__main__` with its own
argv, working dir, environment (the sitecustomize of `helpers.STACKS` read again under it),
stdio, session and exit code.

torchrun's agent (`python -m torch.distributed.run ARGS`) is forked likewise, as `-m` runs it
(its ranks, the agent's children, start as torchrun starts them: new interpreters).

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
        request = json.dumps({"argv": argv, "module": module, "cwd": str(cwd), "env": env,
                              "default_signals": [int(s) for s in default_signals]}).encode()
        try:
            with self.lock:
                socket.send_fds(self.sock, [struct.pack("Q", len(request)) + request],
                                [theirs.fileno(), out_w, err_w])
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

def _serve(fd: int) -> None:
    import hydra  # noqa: F401
    import omegaconf  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (an optimizer's constructor imports it)
    # what rank 0 of every run imports for its TensorBoard events (trainer/logging.py): 0.1 s
    import tensorboard.compat.proto.event_pb2  # noqa: F401
    import tensorboard.compat.proto.summary_pb2  # noqa: F401
    import tensorboard.summary.writer.record_writer  # noqa: F401

    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its keepers: reaped as they end
    sock.sendall(b"ready")
    while True:
        try:
            head, fds, _, _ = socket.recv_fds(sock, 8, 3)
        except OSError:
            return
        if len(head) < 8:
            return  # the suite ended
        size = struct.unpack("Q", head)[0]
        body = b""
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                return
            body += chunk
        if os.fork() == 0:
            sock.close()
            _keep(json.loads(body), *fds)
        for f in fds:
            os.close(f)


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


def _run(request: dict, out: int, err: int) -> None:
    """The run, as `python train.py ARGS` would start it in a session of its own."""
    code = 1
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, to in ((null, 0), (out, 1), (err, 2)):
            os.dup2(fd, to)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # the standard streams as an interpreter opens them (PYTHONUNBUFFERED: write-through)
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        for fd, name, errors in ((0, "stdin", "strict"), (1, "stdout", "strict"),
                                 (2, "stderr", "backslashreplace")):
            raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
            buffered = raw if unbuffered and fd else (io.BufferedReader(raw) if fd == 0 else
                                                      io.BufferedWriter(raw))
            stream = io.TextIOWrapper(buffered, encoding="utf-8", errors=errors,
                                      line_buffering=fd == 2 or (unbuffered and fd == 1),
                                      write_through=unbuffered and fd != 0)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in request["default_signals"]:
            signal.signal(sig, signal.SIG_DFL)
        import runpy

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
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        atexit._run_exitfuncs()
    finally:
        os._exit(code)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))

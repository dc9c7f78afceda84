"""Preemption signals before the run's own handler: exit 75 and its line, also while the main
thread waits in C++; released, they are the caller's again, and nothing is left behind."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import ROOT


def _script(body: str, *, stdin=None, env=None):
    code = "import os, signal, sys, time\nfrom trainer import startsignals\n" + \
        textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, stdin=stdin, env=env)


def test_a_held_signal_ends_the_process_while_the_main_thread_waits_in_cpp():
    """A blocking wait that runs no Python signal handler until it ends (a lock's acquire
    without a timeout: the ranks' rendezvous is another) is ended at once, 75 and the line."""
    out = _script("""
        import threading
        startsignals.hold()
        os.kill(os.getpid(), signal.SIGTERM)
        lock = threading.Lock(); lock.acquire()
        threading.Thread(target=lambda: (time.sleep(30), lock.release())).start()
        lock.acquire()  # (the handler would run here, after 30 s)
        print("went on")
    """)
    assert out.returncode == 75 and "went on" not in out.stdout, out
    assert out.stderr == ("stoker: stopped on a preemption signal before the first step: "
                          "nothing trained, nothing saved; the same command starts it again\n")


def test_only_the_first_rank_says_the_line():
    import os

    for env, said in [({"RANK": "1"}, False), ({"SLURM_PROCID": "2"}, False),
                      ({"SLURM_PROCID": "0"}, True)]:
        base = {k: v for k, v in os.environ.items() if k not in ("RANK", "SLURM_PROCID")}
        out = _script("""
            startsignals.hold()
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(30)
        """, env={**base, **env})
        assert out.returncode == 75 and bool(out.stderr) == said, (env, out)


def test_release_gives_back_the_launchs_handlers_and_stops_acting():
    """What the launch set is returned for the caller to put back (a handler of one's own, the
    default), an ignored signal (nohup's SIGHUP) is left ignored and not held, and a signal
    after the release is the caller's: the process goes on."""
    out = _script("""
        mine = lambda *a: None
        signal.signal(signal.SIGUSR1, mine)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        startsignals.hold()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        held = startsignals.release()
        assert held == {signal.SIGTERM: signal.SIG_DFL, signal.SIGUSR1: mine}, held
        assert startsignals.release() == {}  # (twice: nothing held)
        os.kill(os.getpid(), signal.SIGTERM)  # (the start-up's handler is still set: caller's)
        time.sleep(0.5)
        assert signal.set_wakeup_fd(-1) == -1  # (no wake-up fd left set)
        print("went on")
    """)
    assert out.returncode == 0 and out.stdout == "went on\n", out

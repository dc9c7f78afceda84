"""Imported by every Python process `helpers.bounded` starts (run_cli's and torchrun's: it puts
this folder on PYTHONPATH), and the processes those start: SIGUSR2 then writes the stacks of
all its threads to its stderr, which `bounded` sends to a process tree that outlived its
timeout before killing it. Nothing else changes: no other signal, no output unless SIGUSR2
comes. With STOKER_TEST_SLOW_WRITE_S set, fsync of a temporary file (a checkpoint's, before
its rename) takes that many seconds more: a slow disk, for the tests of waiting on a write."""
import faulthandler
import os
import signal

faulthandler.register(signal.SIGUSR2, all_threads=True)

if os.environ.get("STOKER_TEST_SLOW_WRITE_S"):
    import time

    _fsync, _slow_s = os.fsync, float(os.environ["STOKER_TEST_SLOW_WRITE_S"])

    def _slow_fsync(fd):
        try:
            temporary = os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp")
        except OSError:
            temporary = False
        if temporary:
            time.sleep(_slow_s)
        return _fsync(fd)

    os.fsync = _slow_fsync

"""Imported by every Python process the tests start (tests/helpers.py puts this folder on
PYTHONPATH): SIGUSR2 then writes the stacks of all its threads to its stderr, which a test
whose process hangs past its timeout sends before killing it (`helpers.bounded`). Nothing
else changes: no other signal, no output unless SIGUSR2 comes."""
import faulthandler
import signal

faulthandler.register(signal.SIGUSR2, all_threads=True)

"""Imported by every Python process `helpers.bounded` starts (run_cli's and torchrun's: it puts
this folder on PYTHONPATH), and the processes those start: SIGUSR2 then writes the stacks of
all its threads to its stderr, which `bounded` sends to a process tree that outlived its
timeout before killing it. Nothing else changes: no other signal, no output unless SIGUSR2
comes."""
import faulthandler
import signal

faulthandler.register(signal.SIGUSR2, all_threads=True)

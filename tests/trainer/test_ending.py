"""trainer/ending.py: the exit code and status line of a run's ending."""
from __future__ import annotations

from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError
from trainer.ending import exit_code, status_error
from trainer.windowlog import NonFiniteLoss
from trainer.resilience import Preempted


def test_exit_codes_say_what_ended_the_process():
    assert [exit_code(SystemExit(c)) for c in (None, 0, 3, "bye")] == [0, 0, 3, 1]
    assert exit_code(None) == 0
    assert exit_code(ConfigError("x")) == exit_code(CheckpointError("x")) == 2  # the user's
    assert exit_code(NonFiniteLoss("x")) == exit_code(RuntimeError("x")) == 1
    assert exit_code(OSError("disk full")) == 1
    assert exit_code(KeyboardInterrupt()) == 130
    assert exit_code(Preempted("x")) == 75 and exit_code(Preempted("x", code=130)) == 130


def test_status_lines_keep_a_crashs_type_and_a_workers_origin():
    from torch._utils import KeyErrorMessage  # how the DataLoader re-raises a worker's KeyError

    worker = KeyError(KeyErrorMessage(
        "Caught KeyError in DataLoader worker process 0.\nOriginal Traceback (most recent call "
        "last):\n  File \"x.py\", line 1\nKeyError: 'lbl'\n"))
    assert status_error(worker) == "KeyError: 'lbl' (KeyError in DataLoader worker process 0)"
    assert status_error(KeyError("lbl")) == "KeyError: 'lbl'"
    assert status_error(RuntimeError("boom")) == "RuntimeError: boom"  # a crash: its type
    assert status_error(ConfigError("data.batch_size=0: must be > 0")) == \
        "data.batch_size=0: must be > 0"  # a mistake the run names: its line alone
    assert status_error(SystemExit(3)) == "SystemExit(3)"

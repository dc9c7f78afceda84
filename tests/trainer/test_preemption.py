"""Preemption signals and Ctrl-C turned into a flag the ranks agree on; a second signal while
the step has not ended stops at once. Whole runs under signals: tests/trainer/test_resilience.py."""
from __future__ import annotations

import signal

import pytest


def test_a_second_signal_once_the_step_ended_lets_the_checkpoint_be_written(monkeypatch):
    """SLURM's SIGUSR1 before the limit, then SIGTERM at it, while the preemption checkpoint
    is being written: the write goes on (only a step that never ends is cut short)."""
    from trainer import preemption
    from trainer.cli import SignalledAgain
    from trainer.distributed import DistEnv

    env = DistEnv()
    clock = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    stop, waiting = preemption.Preemption(env), preemption.Preemption(env)
    for p in (stop, waiting):
        p._handle(signal.SIGUSR1, None)
    assert stop.agreed()  # the step boundary: stopping, with a checkpoint
    clock[0] += 5  # the second signal comes later than a second
    stop._handle(signal.SIGTERM, None)  # no SignalledAgain: the save finishes
    with pytest.raises(SignalledAgain):  # still inside the step: stop at once
        waiting._handle(signal.SIGTERM, None)


@pytest.mark.parametrize("saving,line", [
    (True, "stoker: stopping at the end of this step with a checkpoint (Ctrl-C again to stop "
           "at once, without one)"),
    (False, "stoker: stopping at the end of this step (Ctrl-C again to stop at once)")])
def test_the_first_ctrl_c_promises_a_checkpoint_only_when_one_will_be_saved(capfd, saving,
                                                                           line):
    from trainer.distributed import DistEnv
    from trainer.preemption import Preemption

    preemption = Preemption(DistEnv(), saving=saving)
    preemption._handle(signal.SIGINT, None)
    assert preemption.requested and capfd.readouterr().err.splitlines() == [line]

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


@pytest.mark.parametrize("saving,built,line", [
    (True, True, "stoker: stopping at the end of this step with a checkpoint (Ctrl-C again to "
                 "stop at once, without one)"),
    (False, True, "stoker: stopping at the end of this step (Ctrl-C again to stop at once)"),
    # while the run is built (a dataset's __init__): it promised a checkpoint, then said
    # "nothing saved"
    (True, False, "stoker: stopping once the run is built, before its first step, with "
                  "nothing to save (Ctrl-C again to stop at once)")])
def test_the_first_ctrl_c_promises_a_checkpoint_only_when_one_will_be_saved(capfd, saving,
                                                                           built, line):
    from trainer.distributed import DistEnv
    from trainer.preemption import Preemption

    preemption = Preemption(DistEnv(), saving=saving)
    if built:
        preemption.stop_before_training()  # (no signal yet: the steps begin)
    preemption._handle(signal.SIGINT, None)
    assert preemption.requested and capfd.readouterr().err.splitlines() == [line]


def test_the_start_up_hold_is_taken_over_and_held_again_for_a_sweeps_next_job():
    """train.py's start-up hold (trainer/startsignals.py) gives way to the run's handlers and
    its launch's handlers come back at the run's end; a sweep's next job run in this process
    holds them again from its start (SweepSummary.on_job_start: a signal while job 2 met its
    ranks ended a rank at -15 without a word), and the sweep's end puts the launch's back."""
    import subprocess
    import sys
    import textwrap

    from tests.helpers import ROOT

    code = textwrap.dedent("""
        import os, signal
        from trainer import startsignals
        from trainer.distributed import DistEnv
        from trainer.preemption import Preemption
        from trainer.sweep import SweepSummary
        summary = SweepSummary()
        summary.on_job_start(None)  # (a process that never held: nothing held)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        startsignals.hold()
        with Preemption(DistEnv()) as p:
            assert signal.getsignal(signal.SIGTERM) == p._handle
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # (the job's end, its report)
        summary.on_job_start(None)
        assert signal.getsignal(signal.SIGTERM) is startsignals._noted  # (job 2, until its run)
        startsignals.put_back()  # (the sweep's end)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        summary.on_job_start(None)
        os.kill(os.getpid(), signal.SIGTERM)  # (job 2 meets its ranks)
        signal.pause()
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 75, out.stderr[-2000:]
    assert out.stderr.endswith("stopped on a preemption signal before the first step: nothing "
                               "trained, nothing saved; the same command starts it again\n")


@pytest.mark.parametrize("phase,signals", [("atexit", 1), ("atexit", 2), ("teardown", 1)])
def test_a_signal_after_the_stop_leaves_its_exit_75_and_its_line(tmp_path, phase, signals):
    """A second SIGTERM 0.05-0.8 s after the first, once the step had ended and the checkpoint
    was written, killed the process in its last second: exit 143 beside a status.json of
    "preempted" 75 (a scheduler took the stopped job for killed), and the resume line was
    lost. Now the first signal after the stop is let pass, and a second ends the process at
    once, 75, as a completed run's (trainer/cli.py complete())."""
    import json
    import os
    import time

    from tests.helpers import signalled_in_its_exit, train_until

    seconds = 6.0
    run_dir = tmp_path / "run"
    with train_until([f"hydra.run.dir={run_dir}", "trainer.max_epochs=1000",
                      "model._target_=tests.helpers.SlowExitMLP", f"+model.phase={phase}",
                      f"+model.seconds={seconds}"], "global batch",
                     stdout=True) as (proc, lines):
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGTERM)  # (the stop; then the signals in its exit)
        code, waited = signalled_in_its_exit(proc, lines, signals)
    assert code == 75, "".join(lines[-40:])
    if signals == 2:  # (at once, not after the exit handler's seconds)
        assert waited < seconds - 1
    assert any("stopped on a preemption signal at step" in ln for ln in lines)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"

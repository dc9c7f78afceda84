"""trainer/ending.py: the exit code and status line of a run's ending."""
from __future__ import annotations

import torch

from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError
from trainer.ending import exit_code, status_error
from trainer.windowlog import NonFiniteLoss
from trainer.preemption import Preempted


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
    # the lines Stoker puts under a crash's traceback (which metric, what it was given) are
    # the record's too: it kept the IndexError's line alone; a note of another's is left out
    crash = IndexError("index 2415 is out of bounds")
    crash.add_note("stoker: task.metrics.auc: BinaryAUROC.compute() failed ...: does the "
                   "metric take these?")
    crash.add_note("a note of a library's own")
    crash.add_note("stoker: in the first validation batch")
    assert status_error(crash) == (
        "IndexError: index 2415 is out of bounds; task.metrics.auc: BinaryAUROC.compute() "
        "failed ...: does the metric take these?; in the first validation batch")


def test_a_resume_past_a_lowered_limit_is_one_line_leaving_the_run_as_it_is(make_cfg, tmp_path,
                                                                           caplog):
    """A run stopped inside its second epoch (a preemption), resumed with
    trainer.max_epochs=1 (or a max_steps below its step): it ended at once, rewriting its last
    checkpoints, a validation row and its status as a run finished at that limit."""
    import os
    import re
    import shutil
    import signal

    import pytest

    from trainer.loop import Callback
    from trainer.runner import train

    class Preempt(Callback):
        def after_step(self, loop):
            if loop.state.step == 30:  # (23 steps an epoch: inside the second)
                os.kill(os.getpid(), signal.SIGTERM)

    run = tmp_path / "run"
    quick = ["trainer.progress_bar=false", "data.num_workers=0", "sched=constant"]
    with pytest.raises(Preempted):
        train(make_cfg(*quick, "trainer.max_epochs=5", run_dir=run), callbacks=[Preempt()])
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for limit, said in [("trainer.max_epochs=1", r"trainer.max_epochs=1: the run is at epoch "
                         r"1 step (\d+) already, past it; its files are left as they are; give "
                         r"trainer.max_epochs=2 or more to finish its epoch, or "
                         r"trainer.max_steps=\1 to end it where it is$"),
                        ("trainer.max_steps=20", r"trainer.max_steps=20: the run is at step "
                         r"\d+ already, past it; its files are left as they are; give "
                         r"trainer.max_steps=\d+ or more$")]:
        caplog.clear()
        caplog.set_level("INFO", logger="stoker")
        with pytest.raises(ConfigError) as e:
            train(make_cfg(*quick, limit, "trainer.resume=auto", run_dir=run))
        assert re.match(said, str(e.value)), str(e.value)
        # (the resume's lines told of a run with the new limit before the refusal)
        assert "resuming with changed settings" not in caplog.text, caplog.text
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    step = int(re.search(r"step (\d+)", str(e.value)).group(1))
    shutil.copytree(run, tmp_path / "copy")  # the line's way out ends it where it is
    ended = train(make_cfg(*quick, "trainer.max_epochs=1", f"trainer.max_steps={step}",
                           "trainer.resume=auto", run_dir=tmp_path / "copy"))
    assert ended["steps"] == step
    again = train(make_cfg(*quick, "trainer.max_epochs=5", "trainer.resume=auto", run_dir=run))
    assert again["steps"] == 115  # (5 epochs of 23: on from where it stopped)


def test_a_busy_cpu_with_threads_past_one_is_said_and_nothing_else_is():
    """A new user's default job trained 25 to 60 times slower on a CPU other work shared,
    with PyTorch's two threads, and nothing said why (its data wait was 2%)."""
    from trainer.ending import busy_cpu_line

    cpu = torch.device("cpu")
    said = busy_cpu_line(1.8, 3.0, 2, cpu)
    assert said.startswith("the training thread waited for a CPU 60% of its time: other work "
                           "shares this machine's cores, and PyTorch's 2 threads wait on each "
                           "other at every operation") and "OMP_NUM_THREADS=1" in said
    assert busy_cpu_line(0.3, 3.0, 2, cpu) is None  # (seldom queued)
    assert busy_cpu_line(1.8, 3.0, 1, cpu) is None  # (one thread: its fair share of a CPU)
    assert busy_cpu_line(1.8, 3.0, 2, torch.device("meta")) is None  # (not a CPU's step)
    assert busy_cpu_line(None, 3.0, 2, cpu) is None  # (not known: no schedstat)
    assert busy_cpu_line(0.6, 0.9, 2, cpu) is None  # (too short a run to tell)


def test_a_complete_run_names_the_limits_that_would_train_it_on():
    """A run complete at epoch 3 step 69, resumed with smaller limits, said "raise either to
    train on": 2 epochs would not; each limit it reached must pass the run's own."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from trainer.ending import complete_because

    def said(max_epochs, max_steps):
        cfg = OmegaConf.create({"trainer": {"max_epochs": max_epochs, "max_steps": max_steps}})
        state = SimpleNamespace(epoch=3, step=69)
        loop = SimpleNamespace(state=state, stop_reason=lambda: None, reached_limit=lambda: (
            0 < max_steps <= state.step or 0 < max_epochs <= state.epoch))
        return complete_because(cfg, loop)

    assert said(1, -1) == ("trainer.max_epochs=1, trainer.max_steps=-1",
                           "give trainer.max_epochs=4 or more to train on")
    assert said(-1, 60)[1] == "give trainer.max_steps=70 or more to train on"
    assert said(3, 69)[1] == ("give trainer.max_epochs=4 or more and trainer.max_steps=70 or "
                              "more to train on")
    assert said(5, -1) is None

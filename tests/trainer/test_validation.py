"""trainer/validation.py: the validation pass, in its own phase for the heartbeat."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.helpers import read_metrics, summary_of, torchrun
from trainer.config import ConfigError
from trainer.loop import Callback
from trainer.runner import train


def test_validations_collectives_are_in_its_phase_for_the_heartbeat(make_cfg, monkeypatch):
    """A peer lost while ranks sum their validation losses is named as met in validation,
    not in training; training resumes its phase afterwards."""
    from trainer import distributed
    from trainer.loop import Loop

    phases, sum_ = [], distributed.all_reduce_sum
    seen = {}

    def all_reduce_sum(t):
        if "loop" in seen:  # (not the metrics' trial on the first batch: a training step's)
            phases.append(seen["loop"].phase)
        return sum_(t)

    evaluate = Loop.evaluate

    def recording(self, epoch, **kw):
        seen["loop"] = self
        return evaluate(self, epoch, **kw)

    monkeypatch.setattr(distributed, "all_reduce_sum", all_reduce_sum)
    monkeypatch.setattr(Loop, "evaluate", recording)
    train(make_cfg("trainer.max_epochs=1"))
    assert phases and set(phases) == {"validating"} and seen["loop"].phase == "training"



def test_the_sanity_check_is_a_phase_of_its_own_for_the_heartbeat(make_cfg, monkeypatch):
    """A peer lost during the sanity check was said as lost at step 0 (training)."""
    from trainer import validation

    phases, seen = [], {}
    sanity_check, checked_forward = validation.sanity_check, validation.checked_forward

    def recording(loop, loss):
        seen["loop"] = loop
        return sanity_check(loop, loss)

    def forward(*args, **kw):
        phases.append(seen["loop"].phase)
        return checked_forward(*args, **kw)

    monkeypatch.setattr(validation, "sanity_check", recording)
    monkeypatch.setattr(validation, "checked_forward", forward)
    train(make_cfg("trainer.max_steps=2"))
    # (then the validation's batches)
    assert phases[0] == "sanity check" and set(phases[1:]) == {"validating"}
    assert seen["loop"].phase == "training"


FLOAT64_VAL = ("data=custom", "data.input_shape=[1,8,8]", "data.num_classes=10",
               "+data.train_dataset._target_=data.datasets.DigitsDataset",
               "+data.train_dataset.split=train",
               "+data.val_dataset._target_=tests.helpers.Float64Digits",
               "+data.val_dataset.split=val", "trainer.max_steps=2")


class Steps(Callback):
    def __init__(self):
        self.seen = []

    def after_step(self, loop):
        self.seen.append(loop.state.step)


def test_validation_data_the_model_cannot_take_stops_the_run_before_its_first_step(make_cfg,
                                                                                   tmp_path):
    """Only the validation split holds float64 arrays: the sanity check's first validation
    batch names it in one line before any training is spent, and nothing is written."""
    steps = Steps()
    with pytest.raises(ConfigError) as info:
        train(make_cfg(*FLOAT64_VAL), callbacks=[steps])
    text = str(info.value)
    assert text.startswith("model: MLP cannot take the first validation batch "
                           "(trainer.sanity_check) (") and \
        "the batch holds float64 inputs and the model's parameters are float32" in text, text
    assert steps.seen == [] and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_validation_split_the_task_refuses_is_said_as_the_sanity_checks(make_cfg):
    """The task's line alone read as the training split's fault."""
    steps = Steps()
    with pytest.raises(ConfigError) as info:
        train(make_cfg(*FLOAT64_VAL[:-3], "+data.val_dataset._target_=tests.helpers."
                       "ShiftedLabelDigits", "+data.val_dataset.split=val",
                       "trainer.max_steps=2"), callbacks=[steps])
    text = str(info.value)
    assert text.startswith("task classification: a target outside 0..9") and text.endswith(
        "(in the first validation batch (trainer.sanity_check); the training batches passed)")
    assert steps.seen == [] and "\n" not in text


def test_without_the_sanity_check_the_first_validation_says_it_as_trainings_would(make_cfg):
    steps = Steps()
    with pytest.raises(ConfigError) as info:
        train(make_cfg(*FLOAT64_VAL, "trainer.sanity_check=false"), callbacks=[steps])
    assert str(info.value).startswith("model: MLP cannot take the first validation batch (")
    assert steps.seen == [1, 2]  # trained first: the error came at validation


def test_the_sanity_check_leaves_no_trace_in_training(make_cfg, tmp_path):
    """A model that draws random numbers in eval mode too, with dropout in training, and a
    validation loader that draws its workers' seeds: the same losses with and without the
    check, and python's, numpy's and the loader's generator's states as they were when the
    first step ends."""
    runs, generators = {}, []

    class Generator(Callback):
        def after_step(self, loop):
            if loop.state.step == 1:
                generators.append((loop.val_feed.loader.generator.get_state(),
                                   random.getstate(), np.random.get_state()[1]))

    for check in ("true", "false"):
        run_dir = tmp_path / check
        train(make_cfg("model._target_=tests.helpers.DrawingMLP", "model.dropout=0.5",
                       "data.placement=host", "trainer.max_steps=6",
                       "trainer.log_every_n_steps=1", f"trainer.sanity_check={check}",
                       run_dir=run_dir), callbacks=[Generator()])
        runs[check] = [(r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)
                       if r["split"] == "train"]
    assert len(runs["true"]) == 6 and runs["true"] == runs["false"]
    (loader, python, numpy), (loader_off, python_off, numpy_off) = generators
    assert torch.equal(loader, loader_off) and python == python_off
    assert (numpy == numpy_off).all()


def test_the_sanity_checks_time_is_not_trainings(make_cfg, tmp_path):
    """Its validation batch (4 samples of 0.5 s) was counted as training time: throughput 5.6
    times too low, the data-wait share diluted, the first metrics row's too."""
    summary = train(make_cfg("data.dataset._target_=tests.helpers.SlowValDigits",
                             "data.placement=host", "data.num_workers=0",
                             "data.eval_batch_size=4", "trainer.limit_val_batches=1",
                             "trainer.max_steps=3", "trainer.log_every_n_steps=1",
                             run_dir=tmp_path))
    assert summary["run_train_s"] < 2.0  # (the sanity batch alone sleeps 2 s)
    first = next(r for r in read_metrics(tmp_path) if r["split"] == "train")
    assert first["samples_per_s"] > 64 / 2.0, first


def test_validate_only_gives_a_checkpoints_numbers_and_trains_nothing(make_cfg, tmp_path):
    """trainer.validate_only with trainer.init_from: the run's own validation numbers of the
    checkpoint, exactly, with no step, no checkpoint and a summary saying so; the command
    line's last line names the weights and the samples."""
    import json

    from tests.helpers import ROOT, run_cli

    run = train(make_cfg("trainer.max_epochs=2", "sched=constant", run_dir=tmp_path / "run"))
    weights = tmp_path / "run" / "checkpoints" / "last.pt"
    checked = train(make_cfg("trainer.validate_only=true", f"trainer.init_from={weights}",
                             run_dir=tmp_path / "checked"))
    assert (checked["val_loss"], checked["val_acc"]) == (run["val_loss"], run["val_acc"])
    assert checked["steps"] == 0 and checked["validate_only"]
    assert checked["validated_samples"] == 359 and "run_samples_per_s" not in checked
    assert checked["warnings"] == 0  # (no training's: sched.warmup_steps past its 0 steps)
    assert checked["weights"] == str(weights) and checked["checkpoint"] is None
    assert not (tmp_path / "checked" / "checkpoints").exists()
    assert [r["split"] for r in read_metrics(tmp_path / "checked")] == ["val"]
    assert json.loads((tmp_path / "checked" / "status.json").read_text())["status"] \
        == "completed"
    proc = run_cli(["trainer.validate_only=true", f"trainer.init_from={weights}",
                    f"hydra.run.dir={tmp_path / 'cli'}"], cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert f"validated {weights}: val_loss {run['val_loss']:.4f} val_acc " \
           f"{run['val_acc']:.4f} over 359 samples in " in last
    assert "start fresh" not in proc.stdout  # (the weights line: nothing else starts)
    into_run = run_cli(["trainer.validate_only=true", f"trainer.init_from={weights}",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT)
    assert into_run.returncode == 2 and into_run.stderr.startswith(
        f"stoker: error: trainer.validate_only=true: hydra.run.dir={tmp_path / 'run'} holds "
        "a run's files; validate into a new dir (hydra.run.dir=...); nothing was changed")
    # trainer.resume=auto, as scripts/slurm/train.sbatch passes it: nothing to continue
    auto = train(make_cfg("trainer.validate_only=true", f"trainer.init_from={weights}",
                          "trainer.resume=auto", run_dir=tmp_path / "auto"))
    assert auto["val_loss"] == run["val_loss"]


def test_validate_only_without_a_validation_set_is_one_line_leaving_no_dir(make_cfg, tmp_path):
    weights = tmp_path / "w.pt"
    torch.save(torch.nn.Linear(10, 1).state_dict(), weights)
    with pytest.raises(ConfigError, match=r"^trainer.validate_only=true: the data has no "
                                          r"validation set"):
        train(make_cfg("data=custom", "data.input_shape=[10]", "task=regression",
                       "+data.train_dataset._target_=tests.helpers.Diabetes", "model=custom",
                       "+model._target_=torch.nn.Linear", "+model.in_features=10",
                       "+model.out_features=1", "trainer.validate_only=true",
                       f"trainer.init_from={weights}", run_dir=tmp_path / "none"))
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())


def test_validate_only_neither_caches_nor_places_the_training_split(make_cfg, tmp_path, caplog):
    """The training split is built (the loop holds its feed) but never read: it was decoded
    whole into a disk cache, to validate."""
    import logging

    run = train(make_cfg("trainer.max_steps=2", run_dir=tmp_path / "run"))
    weights = tmp_path / "run" / "checkpoints" / "last.pt"
    with caplog.at_level(logging.INFO, logger="stoker"):
        checked = train(make_cfg("trainer.validate_only=true", f"trainer.init_from={weights}",
                                 "data.cache=disk", f"data.cache_dir={tmp_path / 'cache'}",
                                 run_dir=tmp_path / "checked"))
    assert checked["val_loss"] == run["val_loss"]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # (the validation split's alone)
    assert "data: train set: 1438 samples, not read (trainer.validate_only)" in caplog.text


def test_a_stopped_sweep_of_validations_is_told_to_go_into_a_new_dir(make_cfg, tmp_path):
    """Its line said to relaunch with trainer.resume=auto in the same sweep dir, where every
    finished job's dir is then refused (a validation goes into a new dir)."""
    from tests.helpers import ROOT, run_cli

    train(make_cfg("trainer.max_steps=2", run_dir=tmp_path / "run"))
    other = tmp_path / "other.pt"
    torch.save(torch.nn.Linear(3, 2).state_dict(), other)
    proc = run_cli(["-m", "trainer.validate_only=true", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                    f"trainer.init_from={tmp_path / 'run' / 'checkpoints' / 'last.pt'},{other}"],
                   cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "stoker: the sweep stopped at job 1; the jobs after it were not run (once fixed, the "
        "same command in a new hydra.sweep.dir)")


@pytest.mark.parametrize("task", [[], ["model._target_=tests.helpers.SelfLossMLP",
                                       "task=model_loss", "task.count=samples"]])
def test_the_sanity_checks_replay_writes_over_nothing_the_first_step_takes(make_cfg, tmp_path,
                                                                          monkeypatch, task):
    """A model compiled with CUDA graphs hands its backward's gradients (and, with
    task=model_loss, its loss) over in the graphs' memory, which the next replay writes over:
    the sanity check's forward comes between the first backward and the first step. Here the
    replay is NaN written into every gradient and output the first batch's forward and
    backward handed over: the first steps' losses and gradient norms are a run's without the
    check."""
    from trainer.loop import Loop
    from trainer.strategy import unwrap

    handed, init = [], Loop.__init__

    def replay(module, args, out):
        if module.training:
            handed.extend(out.values() if isinstance(out, dict) else [out])
            return
        with torch.no_grad():  # an evaluation's replay
            for t in handed:
                t.fill_(float("nan"))
        handed.clear()

    def replaying(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.replays = self.ledger.copy = True  # (a CPU run replays no graph)
        for p in self.params:
            p.register_post_accumulate_grad_hook(lambda p: handed.append(p.grad))
        unwrap(self.model).register_forward_hook(replay)

    monkeypatch.setattr(Loop, "__init__", replaying)
    runs = {}
    for on in ("true", "false"):
        run_dir = tmp_path / on
        train(make_cfg(*task, "trainer.max_steps=3", "trainer.log_every_n_steps=1",
                       "data.placement=host", f"trainer.sanity_check={on}", run_dir=run_dir))
        runs[on] = [(r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)
                    if r["split"] == "train"]
    assert len(runs["true"]) == 3 and runs["true"] == runs["false"]


@pytest.mark.slow
@pytest.mark.parametrize("failing", [1, 0])
def test_a_validation_failing_on_one_rank_keeps_the_epoch_on_every_rank(tmp_path, failing):
    """Under DDP a rank whose validation shard raised ended at once; its peers, waiting in the
    sums' all-reduce, lost it, and the epoch's training went unsaved ("no checkpoint was
    saved"). The ranks agree on the failure there: every one saves the trained state, the
    failing rank says its error, the others name it, and the mended run resumes from it.
    (Shard sample 150 of rank `failing`: index 300 is rank 0's, 301 rank 1's.)"""
    run_dir = tmp_path / "run"
    common = [f"hydra.run.dir={run_dir}", "data.placement=host", "data.eval_batch_size=32",
              "trainer.max_epochs=2"]
    proc = torchrun(2, [*common, "data.dataset._target_=tests.helpers.FailingValDigits",
                        f"+data.dataset.fail_index={300 + failing}"], cwd=tmp_path)
    err = proc.stdout + proc.stderr
    assert proc.returncode == 1, err[-3000:]
    last = run_dir / "checkpoints" / "last.pt"
    saved = torch.load(last, weights_only=True)
    assert (saved["step"], saved["epoch"], saved["position"]) == (12, 1, 0)
    assert f"validation failed after step 12: the trained state is saved in {last}" in err
    if failing:  # rank 0 names rank 1's error, once for the job
        assert err.count("ended with its peers") == 1 and (
            "stoker: error: rank 0 ended with its peers at step 12 (validating): rank 1 "
            "stopped on its error: ValueError: bad validation sample 301") in err
        assert f"the last good checkpoint is {last}" in err
    else:  # rank 0's own error is the job's (its traceback); no peer's line besides it
        assert "ValueError: bad validation sample 300" in err
        assert "ended with its peers" not in err
    # (the resume keeps the run's overrides: the data is mended by one of its own)
    proc = torchrun(2, [*common, "data.dataset.fail_index=-1", "trainer.resume=auto"],
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary_of(run_dir)["steps"] == 24


@pytest.mark.slow
@pytest.mark.parametrize("failing", [1, -1])
def test_a_metric_whose_compute_fails_under_ddp_keeps_the_epoch_on_every_rank(tmp_path,
                                                                              failing):
    """A metric's compute raising, after the validation's sums, on one rank (a metric that
    does not sync its state) or on every rank alike (one that fails on the whole set): the
    ranks ended with the epoch's training unsaved. They agree on it where they agree on the
    values: every one saves the trained state, and the run resumes from it."""
    run_dir = tmp_path / "run"
    # (before the built-in accuracy, which syncs the ranks in its compute: the failing rank
    # still meets its peers there)
    metric = ["~task.metrics.acc", "+task.metrics.seen._target_=tests.helpers.FailsInCompute",
              f"+task.metrics.seen.rank={failing}", "+task.metrics.acc._target_="
              "trainer.metrics.Accuracy", "trainer.max_epochs=3"]
    proc = torchrun(2, [f"hydra.run.dir={run_dir}", *metric], cwd=tmp_path)
    err = proc.stdout + proc.stderr
    assert proc.returncode == 1, err[-3000:]
    last = run_dir / "checkpoints" / "last.pt"
    saved = torch.load(last, weights_only=True)
    assert (saved["step"], saved["epoch"], saved["position"]) == (24, 2, 0)
    assert f"validation failed after step 24: the trained state is saved in {last}" in err
    if failing == 1:  # rank 0 names rank 1's error, once for the job
        assert err.count("ended with its peers") == 1 and (
            "stoker: error: rank 0 ended with its peers at step 24 (validating): rank 1 "
            "stopped on its error: ValueError: compute failed on rank 1") in err, err[-3000:]
    else:  # rank 0's own error is the job's (its traceback)
        assert "ValueError: compute failed on rank 0" in err
        assert "ended with its peers" not in err
    proc = torchrun(2, [f"hydra.run.dir={run_dir}", *metric, "+task.metrics.seen.at=99",
                        "trainer.resume=auto"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary_of(run_dir)["steps"] == 36


@pytest.mark.slow
def test_a_metric_that_keeps_its_state_per_rank_is_said_once(tmp_path):
    """Under DDP a metric of one's own that does not sum its state over the ranks was logged
    as rank 0's shard's value with no word; one that syncs (the built-in accuracy) is not
    said."""
    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=2",
                        "+task.metrics.seen._target_=tests.helpers.FailsInCompute",
                        "+task.metrics.seen.at=99",
                        "+task.metrics.per._target_=tests.helpers.CountsByName",
                        "+task.metrics.per.at=99"], cwd=tmp_path)
    err = proc.stdout + proc.stderr
    assert proc.returncode == 0, err[-3000:]
    said = [ln for ln in err.splitlines() if "computed other values on the ranks" in ln]
    # a dict-valued one: its first entry that differs (its entry that is no number said
    # once, by rank 0)
    assert len(said) == 2 and said[1].endswith(
        "task.metrics.per: CountsByName computed other values on the ranks (rank 0: 180, "
        "rank 1: 179): it keeps its state per rank, so val_per_seen is rank 0's shard of "
        "the validation set alone (1/2 of it); make it a torchmetrics.Metric (its state by "
        "add_state, with dist_reduce_fx) to have it over the whole set"), said
    assert err.count("CountsByName computed entries that are not one number, val_per_ids "
                     "(tensor(2,) int64)") == 1
    assert summary_of(tmp_path / "run")["val_per_nested_half"] == 90
    assert len(said) == 2 and said[0].endswith(
        "task.metrics.seen: FailsInCompute computed other values on the ranks (rank 0: 180, "
        "rank 1: 179): it keeps its state per rank, so val_seen is rank 0's shard of the "
        "validation set alone (1/2 of it); make it a torchmetrics.Metric (its state by "
        "add_state, with dist_reduce_fx) to have it over the whole set"), said
    assert summary_of(tmp_path / "run")["val_seen"] == 180


@pytest.mark.gpu
@pytest.mark.parametrize("task", [[], ["model._target_=tests.helpers.SelfLossMLP",
                                       "task=model_loss", "task.count=samples"]])
def test_a_model_replaying_cuda_graphs_passes_the_sanity_check_on_cuda(make_cfg, task):
    """Compiled with CUDA graphs (reduce-overhead), the sanity check's replay comes between
    the first backward and the first step: the step still reads its own gradients and loss
    (it met PyTorch's 'accessing tensor output of CUDAGraphs that has been overwritten')."""
    summary = train(make_cfg(*task, "trainer.accelerator=cuda", "trainer.compile.enabled=true",
                             "trainer.compile.mode=reduce-overhead", "trainer.max_epochs=2"))
    assert summary["steps"] == 46 and summary["val_loss"] < 1.0


@pytest.mark.parametrize("when", ["in_the_validation", "before_it", "killed_after_a_save"])
def test_a_signal_stops_a_validation_at_its_next_batch_and_the_resume_takes_it_first(
        make_cfg, tmp_path, monkeypatch, when):
    """A preemption signal during an epoch's validation (or in the epoch's last step, which
    the ranks agree on a step later) let the whole validation run before the checkpoint,
    past a scheduler's grace period on a long one: it stops at its next batch (no loader
    started where the signal came first), the epoch's trained state is saved as its last
    step left it, and the resumed run validates it first: the same rows and weights as a
    run never stopped. So does a run killed in that validation after a save at the epoch's
    last step (trainer.checkpoint.every_n_steps): its loader's generator was saved as the
    epoch's start left it, and the resumed run's next epoch drew this one's worker seeds
    again."""
    import os
    import signal

    from trainer import checkpoint, validation
    from trainer.preemption import Preempted, Preemption

    takes = []

    class Killed(BaseException):  # (as a SIGKILL: nothing after it runs)
        pass

    shard_sums = validation._shard_sums

    def killed(loop, *args):
        if when == "killed_after_a_save" and loop.state.step == 90:
            raise Killed()
        return shard_sums(loop, *args)

    monkeypatch.setattr(validation, "_shard_sums", killed)

    class SignalAt(Callback):  # the epoch's last step, agreed a step later (as under DDP)
        def after_step(self, loop):
            if when == "before_it" and loop.state.step == 90:
                take = loop.val_feed.take
                loop.val_feed.take = lambda *a: takes.append(a) or take(*a)
                os.kill(os.getpid(), signal.SIGTERM)

    agreed = Preemption.agreed
    monkeypatch.setattr(Preemption, "agreed", lambda self, now=False: now and agreed(self, now))

    # (before_it: with workers that draw an augmentation, from seeds the loader's generator
    # gives each epoch's workers: saved as the epoch's draws left it, or the next epoch's
    # drew the same as this one)
    common = ["trainer.max_epochs=3", "data.placement=host", "trainer.progress_bar=false",
              "data.batch_size=16", "data.dataset._target_=tests.helpers.SignalsInValidation",
              *(["data.num_workers=0"] if when == "in_the_validation" else
                ["data.num_workers=2", "data.persistent_workers=false",
                 "+data.dataset.noise=0.5", "+data.dataset.at=99"])]
    signalled = ["+data.dataset.rank=0"] if when == "in_the_validation" else \
        ["trainer.checkpoint.every_n_steps=90"] if when == "killed_after_a_save" else []
    run_dir = tmp_path / "run"
    with pytest.raises(Killed if when == "killed_after_a_save" else Preempted,
                       match=None if when == "killed_after_a_save" else
                       r"^stopped on a preemption signal at step 90;"):
        train(make_cfg(*common, *signalled, run_dir=run_dir), callbacks=[SignalAt()])
    saved = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert (saved["step"], saved["epoch"], saved["position"], saved["validated_step"]) == \
        (90, 0, 1440, -1)
    assert takes == []  # (before_it: the validation's loader never started)
    monkeypatch.undo()
    assert not [r for r in read_metrics(run_dir) if r.get("split") == "val"]
    resumed = train(make_cfg(*common, "trainer.resume=auto", run_dir=run_dir))
    whole = train(make_cfg(*common, run_dir=tmp_path / "whole"))
    rows = [[r for r in read_metrics(d) if r.get("split") == "val"]
            for d in (run_dir, tmp_path / "whole")]
    assert [r["step"] for r in rows[1]] == [90, 180, 270] and rows[0] == rows[1]
    assert resumed["val_loss"] == whole["val_loss"]
    weights = [checkpoint.load(d / "checkpoints" / "last.pt")["model"]
               for d in (run_dir, tmp_path / "whole")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])


def test_a_console_line_shows_twelve_values_and_counts_the_rest():
    """A per-class metric of 100 classes made each epoch's line (and the run's last) 2,000
    characters long: the console shows 12 values, metrics.jsonl all of them."""
    from trainer.validation import values_line

    values = {"val_loss": 0.5, **{f"val_f1_{c}": c / 100 for c in range(100)}}
    line = values_line(values)
    assert line.startswith("val_loss 0.5000 val_f1_0 0.0000 val_f1_1 0.0100 ")
    assert line.endswith("val_f1_10 0.1000 and 89 more (metrics.jsonl)")
    assert values_line({"val_loss": 0.5, "val_acc": 0.25}) == "val_loss 0.5000 val_acc 0.2500"
    assert values_line({}) == ""


@pytest.mark.parametrize("last", ["last_epochs", "after_max_steps"])
def test_a_signal_stops_the_runs_last_validation_too_and_the_resume_completes_the_run(
        make_cfg, tmp_path, last):
    """The run's last validation (its last epoch's, or the one after trainer.max_steps inside
    an epoch) stops at its next batch as an epoch's does: it ran to its end, and a long one
    outlived a scheduler's grace period, losing the last epoch. Its window row is logged
    before it and the checkpoint keeps that row's values: the resumed run validates and
    completes with the same rows, summary and weights as a run never stopped."""
    import json

    from trainer import checkpoint
    from trainer.preemption import Preempted

    limit = ["trainer.max_epochs=2"] if last == "last_epochs" else \
        ["trainer.max_epochs=5", "trainer.max_steps=30"]
    common = [*limit, "data.placement=host", "data.num_workers=0", "trainer.progress_bar=false",
              "trainer.log_every_n_steps=10",
              "data.dataset._target_=tests.helpers.SignalsInValidation"]
    run_dir = tmp_path / "run"
    end = 46 if last == "last_epochs" else 30
    with pytest.raises(Preempted, match=rf"^stopped on a preemption signal at step {end};"):
        train(make_cfg(*common, "+data.dataset.rank=0", "+data.dataset.at=3", run_dir=run_dir))
    saved = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert (saved["step"], saved["validated_step"]) == (end, 23)
    assert saved["last_train"]["train_loss"] > 0
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"
    resumed = train(make_cfg(*common, "trainer.resume=auto", run_dir=run_dir))
    whole = train(make_cfg(*common, run_dir=tmp_path / "whole"))
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    # no training time in the resume (its done line said "0 samples/s", not that it trained
    # nothing: the epoch's end was passed over with a loader pass of no batch)
    assert resumed["run_train_s"] == 0
    rows = [read_metrics(d) for d in (run_dir, tmp_path / "whole")]
    timeless = [[{k: v for k, v in r.items() if k not in ("samples_per_s", "data_wait_frac")}
                 for r in rs] for rs in rows]
    assert [(r["split"], r["step"]) for r in rows[1]][-2:] == [("train", end), ("val", end)]
    assert timeless[0] == timeless[1]
    assert (resumed["steps"], resumed["val_loss"], resumed["train_loss"]) == \
        (whole["steps"], whole["val_loss"], whole["train_loss"])
    weights = [checkpoint.load(d / "checkpoints" / "last.pt")["model"]
               for d in (run_dir, tmp_path / "whole")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])

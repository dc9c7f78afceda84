"""trainer/resumechanges.py: what a resume changes, what of it the checkpoint's state keeps,
and the run's record of the values it used."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import read_metrics
from trainer import checkpoint
from trainer.checkpoint import CheckpointError
from trainer.resumechanges import APPLIED, changes_line, held, resume_changes
from trainer.runner import train


def test_the_resume_line_says_what_the_checkpoint_keeps_and_only_then_what_that_means():
    only = changes_line([f"optim.fused None -> True{APPLIED}", "data.batch_size 64 -> 32"])
    assert only == ("resuming with changed settings: optim.fused None -> True (applied: how the "
                    "optimizer computes, not its state); data.batch_size 64 -> 32")
    kept = changes_line(["optim.lr 0.1 -> 0.2 (kept at 0.1: the checkpoint's optimizer state "
                         "holds it)"])
    assert kept.endswith(". What the checkpoint's optimizer or scheduler state holds continues "
                         "from it, and config.yaml records that; a new run (no trainer.resume) "
                         "applies them")


def test_what_the_state_holds_is_read_from_it():
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    step = torch.optim.lr_scheduler.StepLR(sgd, step_size=5, gamma=0.5)
    state = {"optimizer": sgd.state_dict(), "scheduler": step.state_dict()}
    assert held("optim.lr", state) == (True, 0.1)
    assert held("optim.momentum", state) == (True, 0.9)
    assert held("sched.gamma", state) == (True, 0.5)  # torch's StepLR keeps its gamma
    assert held("sched.warmup_steps", state) == (False, None)  # a shape its state lacks
    assert held("optim.params", state)[0] is False and held("optim._target_", state)[0] is False
    assert held("trainer.max_epochs", state)[0] is False


def test_a_changed_lr_the_checkpoint_kept_is_what_the_run_records(make_cfg, tmp_path, caplog):
    """The run trained on the checkpoint's lr while its config.yaml and checkpoints said the
    new one: a later resume from them named an lr change that never happened."""
    common = ["sched=constant", "trainer.progress_bar=false", "trainer.log_every_n_steps=1"]
    run_dir = tmp_path / "run"
    train(make_cfg(*common, "trainer.max_steps=2", run_dir=run_dir))
    caplog.set_level("INFO", logger="stoker")
    train(make_cfg(*common, "trainer.max_steps=4", "trainer.resume=auto", "optim.lr=0.1",
                   "sched.warmup_steps=1", run_dir=run_dir))
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("resuming with changed settings"))
    assert "optim.lr 0.003 -> 0.1 (kept at 0.003: the checkpoint's optimizer state holds it)" \
        in line and "sched.warmup_steps 0 -> 1; " in line  # (applies: the state lacks it)
    assert "trainer.max_steps 2 -> 4 (the lr schedule spans the new length from its " \
        "position)" in line
    assert [r["lr"] for r in read_metrics(run_dir) if r["split"] == "train"][2:] == [0.003] * 2
    assert OmegaConf.load(run_dir / "config.yaml").optim.lr == 0.003
    saved = checkpoint.load(run_dir / "checkpoints" / "last.pt")["config"]
    assert saved["optim"]["lr"] == 0.003 and saved["sched"]["warmup_steps"] == 1
    caplog.clear()
    train(make_cfg(*common, "trainer.max_steps=5", "sched.warmup_steps=1",
                   f"trainer.resume={run_dir}/checkpoints/last.pt", run_dir=tmp_path / "next"))
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("resuming with changed settings"))
    assert "optim.lr" not in line, line


def test_another_optimizer_is_refused():
    state = {"config": {"optim": {"_target_": "torch.optim.AdamW"}}}
    cfg = OmegaConf.create({"optim": {"_target_": "torch.optim.SGD"}})
    with pytest.raises(checkpoint.CheckpointError, match=r"^optim\._target_=torch\.optim\.SGD: "
                                                         r"the checkpoint holds the state of"):
        resume_changes(state, cfg, 1, 1)


def test_a_resume_under_a_schedule_of_another_kind_is_refused_naming_both(make_cfg, tmp_path,
                                                                         caplog):
    """warmup_cosine's LambdaLR state was loaded into StepLR without a word; StepLR's into a
    LambdaLR failed on `KeyError: 'lr_lambdas'`. Schedules of one kind take each other's, and
    a change of precision or clipping is said with the other changed settings."""
    quick = ["trainer.max_steps=2", "trainer.progress_bar=false"]
    train(make_cfg(*quick, run_dir=tmp_path / "cos"))
    train(make_cfg(*quick, "sched=step", run_dir=tmp_path / "step"))
    for there, now, old in (("cos", "sched=step", "trainer.schedules.warmup_cosine"),
                            ("step", "sched=warmup_cosine", "torch.optim.lr_scheduler.StepLR")):
        path = tmp_path / there / "checkpoints" / "last.pt"
        with pytest.raises(CheckpointError) as e:
            train(make_cfg("trainer.max_steps=4", now, f"trainer.resume={path}",
                           run_dir=tmp_path / f"{there}-2"))
        assert str(e.value).endswith(
            f"the checkpoint's scheduler state is of another kind ({old}'s, holding "
            + ("lr_lambdas" if there == "cos" else "gamma, step_size") + "), which this "
            f"schedule cannot continue; resume with sched._target_={old}, or start a new run "
            f"dir from its weights (trainer.init_from={path})"), e.value
    caplog.set_level("INFO", logger="stoker")
    path = tmp_path / "cos" / "checkpoints" / "last.pt"
    train(make_cfg("trainer.max_steps=4", "sched=constant", "trainer.precision=bf16",
                   "trainer.grad_clip=1.0", f"trainer.resume={path}",
                   run_dir=tmp_path / "constant"))
    line = next(r.getMessage() for r in caplog.records
                if r.getMessage().startswith("resuming with changed settings"))
    assert "trainer.precision fp32 -> bf16" in line and "trainer.grad_clip None -> 1.0" in line


def test_a_key_one_side_lacks_is_unset_there_and_model_settings_are_compared():
    """A key the checkpoint's config lacked was said as `None -> 20.0` where the class's
    default (10.0) had applied; a model setting changed on resume (dropout) was not said."""
    state = {"config": {"optim": {"_target_": "torch.optim.AdamW"},
                        "data": {"dataset": {"_target_": "D"}},
                        "model": {"_target_": "M", "dropout": 0.0, "hidden": [8]}}}
    cfg = OmegaConf.create({"optim": {"_target_": "torch.optim.AdamW"},
                            "data": {"dataset": {"_target_": "D", "noise": 20.0}},
                            "model": {"_target_": "M", "dropout": 0.5}})
    changes, kept = resume_changes(state, cfg, 1, 1)
    assert changes == ["data.dataset.noise (unset) -> 20.0", "model.dropout 0.0 -> 0.5",
                       "model.hidden [8] -> (unset)"] and kept == {}

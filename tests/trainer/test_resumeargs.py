"""trainer/resumeargs.py: a run resumed in its own dir keeps the overrides it was launched with."""
from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, run_cli
from trainer import resumeargs
from trainer.resumeargs import with_runs_own


def launched_with(run_dir, *overrides):
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return run_dir


def test_the_runs_own_overrides_come_where_the_command_leaves_them_out(tmp_path):
    run = launched_with(tmp_path / "run", "model=cnn", "model.width=32", "optim.lr=1e-3",
                        "+model.num_classes=1", "trainer.max_epochs=60", "trainer.resume=auto",
                        "~trainer.early_stopping")
    args = ["--config-name", "train", "trainer.resume=auto", f"hydra.run.dir={run}",
            "trainer.max_epochs=100"]
    assert with_runs_own(args) == [
        "--config-name", "train", "model=cnn", "model.width=32", "optim.lr=1e-3",
        "+model.num_classes=1", "~trainer.early_stopping", "trainer.resume=auto",
        f"hydra.run.dir={run}", "trainer.max_epochs=100"]  # (the command's max_epochs wins)
    assert resumeargs.said() == (
        "resume: the run's own overrides that this command does not set again apply: "
        "model=cnn model.width=32 optim.lr=1e-3 +model.num_classes=1 ~trainer.early_stopping "
        f"(from {run / '.hydra' / 'overrides.yaml'}; a key set on the command line wins)")


def test_a_group_chosen_otherwise_leaves_out_the_runs_settings_inside_it(tmp_path):
    run = launched_with(tmp_path / "run", "model=cnn", "model.width=32", "optim=sgd",
                        "optim.momentum=0.5", "data.batch_size=32")
    args = ["model=mlp", "trainer.resume=auto", f"hydra.run.dir={run}", "optim.lr=0.1"]
    assert with_runs_own(args) == ["optim=sgd", "optim.momentum=0.5", "data.batch_size=32",
                                   *args]
    assert resumeargs.said().endswith("; left out, in a config group chosen otherwise: "
                                      f"model.width=32 (from {run / '.hydra' / 'overrides.yaml'}"
                                      "; a key set on the command line wins)")
    # the same choice again keeps them (they were dropped: the resume then refused the model)
    again = ["model=cnn", "trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(again) == ["model.width=32", "optim=sgd", "optim.momentum=0.5",
                                    "data.batch_size=32", *again]
    # the run's default choice (its .hydra/hydra.yaml), named on the command line: the same
    (run / ".hydra" / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n"
                                               "      sched: warmup_cosine\n")
    (run / ".hydra" / "overrides.yaml").write_text("- sched.warmup_steps=5\n")
    same = ["sched=warmup_cosine", "trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(same) == ["sched.warmup_steps=5", *same]


def test_a_deletion_on_the_command_line_comes_after_the_runs_key(tmp_path):
    """`~model.num_classes` against the run's `+model.num_classes=1`: the carry left the +
    out, and Hydra could then delete no such key; carried first, it is deleted after."""
    run = launched_with(tmp_path / "run", "+model.num_classes=1", "optim.lr=0.1")
    args = ["trainer.resume=auto", f"hydra.run.dir={run}", "~model.num_classes"]
    assert with_runs_own(args) == ["+model.num_classes=1", "optim.lr=0.1", *args]
    assert resumeargs.said().startswith(  # (not said to apply: the next line said it gone)
        "resume: the run's own overrides that this command does not set again apply: "
        "optim.lr=0.1; deleted by the command's ~key: +model.num_classes=1 (from ")


def test_a_flags_value_is_no_override_and_a_sweep_by_its_mode_carries_nothing(tmp_path):
    run = launched_with(tmp_path / "run", "optim.lr=0.1", "hydra_x=1")
    args = ["--config-dir", "conf=x", "trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(args) == ["--config-dir", "conf=x", "optim.lr=0.1", "hydra_x=1",
                                   "trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(["hydra.mode=MULTIRUN", *args[2:]]) == ["hydra.mode=MULTIRUN",
                                                                 *args[2:]]


@pytest.mark.parametrize("how", ["sweep", "no run dir", "another run's checkpoint", "fresh",
                                 "no record", "not a list", "not overrides"])
def test_nothing_is_carried_where_the_command_does_not_resume_a_run_in_place(tmp_path, how):
    run = launched_with(tmp_path / "run", "optim.lr=1e-3")
    args = {"sweep": ["-m", "trainer.resume=auto", f"hydra.run.dir={run}"],
            "no run dir": ["trainer.resume=auto"],
            "another run's checkpoint": [f"trainer.resume={tmp_path / 'other' / 'last.pt'}",
                                         f"hydra.run.dir={run}"],
            "fresh": [f"hydra.run.dir={run}"],
            "no record": ["trainer.resume=auto", f"hydra.run.dir={tmp_path / 'none'}"],
            "not a list": ["trainer.resume=auto", f"hydra.run.dir={run}"],
            "not overrides": ["trainer.resume=auto", f"hydra.run.dir={run}"]}[how]
    if how == "not a list":
        (run / ".hydra" / "overrides.yaml").write_text("optim: {lr: 1}\n")
    if how == "not overrides":
        (run / ".hydra" / "overrides.yaml").write_text("- 'optim.lr=[1,'\n")
    assert with_runs_own(list(args)) == args
    assert resumeargs.said() is None


def test_a_checkpoint_validated_takes_its_runs_overrides(tmp_path):
    """trainer.validate_only of <run>/checkpoints/X.pt: the run's model and data, as it was
    launched (the model=cnn it was trained as was refused as another model's weights)."""
    run = launched_with(tmp_path / "run", "model=cnn", "trainer.max_epochs=3",
                        "trainer.init_from=base.pt")
    args = ["trainer.validate_only=true", f"trainer.init_from={run}/checkpoints/last.pt",
            f"hydra.run.dir={tmp_path / 'checked'}"]
    assert with_runs_own(args) == ["model=cnn", "trainer.max_epochs=3", *args]
    assert resumeargs.said().startswith("trainer.validate_only: the run's own overrides that "
                                        "this command does not set again apply: model=cnn")
    elsewhere = ["trainer.validate_only=true", f"trainer.init_from={tmp_path / 'w.pt'}"]
    assert with_runs_own(elsewhere) == elsewhere


def test_a_checkpoint_inside_the_run_dir_resumes_it_in_place(tmp_path):
    run = launched_with(tmp_path / "run", "optim.lr=1e-3")
    args = [f"trainer.resume={run / 'checkpoints' / 'step-00000010.pt'}", f"hydra.run.dir={run}"]
    assert with_runs_own(args) == ["optim.lr=1e-3", *args]


def test_the_short_resume_command_continues_the_run_it_names(tmp_path):
    """The README's `trainer.resume=auto hydra.run.dir=...` after a run of its own settings:
    it ended at the default trainer.max_epochs=20 (exit 0, an info line), and a run of another
    model was refused for its checkpoint; both continue as launched."""
    run = tmp_path / "run"
    first = run_cli(["model=cnn", "model.channels=[4,8]", "trainer.max_epochs=3", "trainer.max_steps=30",
                     "trainer.progress_bar=false", f"hydra.run.dir={run}"], cwd=ROOT)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(["trainer.resume=auto", f"hydra.run.dir={run}", "trainer.max_steps=40",
                     "trainer.progress_bar=false"], cwd=ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["warnings"] == 0
    assert ("resume: the run's own overrides that this command does not set again apply: "
            "model=cnn model.channels=[4,8] trainer.max_epochs=3 (from ") in again.stdout
    assert "resuming with changed settings: trainer.max_steps 30 -> 40" in again.stdout
    assert "model=cnn" in (run / ".hydra" / "overrides.yaml").read_text()  # (for the next one)
    bad = run_cli(["trainer.resume=auto", f"hydra.run.dir={run}", "trainer.grad_clip=0"],
                  cwd=ROOT)  # (an error names what the launch took: a key may be the run's)
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "(this launch took the run's own overrides model=cnn model.channels=[4,8] "
        "trainer.max_epochs=3 trainer.max_steps=40 trainer.progress_bar=false from "
        f"{run / '.hydra' / 'overrides.yaml'})")
    checked = run_cli(["trainer.validate_only=true", f"hydra.run.dir={tmp_path / 'checked'}",
                       f"trainer.init_from={run / 'checkpoints' / 'last.pt'}"], cwd=ROOT)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert f"val_loss {summary['val_loss']:.4f}" in checked.stdout.strip().splitlines()[-1]
    other = run_cli(["trainer.validate_only=true", f"hydra.run.dir={tmp_path / 'other'}",
                     f"trainer.init_from={run / 'checkpoints' / 'last.pt'}", "model=mlp"],
                    cwd=ROOT)  # (no init_strict=false advice: a model partly as initialised)
    assert other.returncode == 2 and "trainer.init_strict=false" not in other.stderr
    assert ("(its run had other model settings: model._target_=trainer.models.SmallCNN, "
            "model.channels=[4, 8]") in other.stderr and "; trainer.validate_only validates " \
        "the file's model as it is: give the model and data settings its run had" in other.stderr

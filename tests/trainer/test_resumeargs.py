"""trainer/resumeargs.py: a run resumed in its own dir keeps the overrides it was launched with."""
from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, run_cli
from trainer import resumeargs
from trainer.config import ConfigError
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


def test_the_runs_search_path_is_carried_with_the_groups_found_there(tmp_path):
    """A run of `hydra.searchpath=[...] model=mine` resumed in the short form: `model=mine`
    was carried without the search path that finds it (Could not find 'model/mine')."""
    run = launched_with(tmp_path / "run", "model=mine")
    (run / ".hydra" / "hydra.yaml").write_text(  # (where Hydra records its own overrides)
        "hydra:\n  overrides:\n    hydra:\n    - hydra.searchpath=[file:///my/conf]\n"
        f"    - hydra.run.dir={run}\n    - hydra.job.chdir=false\n")
    args = ["trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(args) == ["hydra.searchpath=[file:///my/conf]", "model=mine", *args]
    again = ["hydra.searchpath=[file:///moved/conf]", *args]  # (set again: the command's)
    assert with_runs_own(again) == ["model=mine", *again]


def test_the_runs_config_dir_and_name_are_carried_unless_the_command_gives_its_own(tmp_path):
    """A run launched with `--config-dir mine --config-name exp` resumed in the short form:
    its `model=mine` was not found (Could not find 'model/mine'), and without the config name
    the launch would have composed train.py's own config instead of the run's."""
    run = launched_with(tmp_path / "run", "model=mine")
    (run / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  job:\n    config_name: exp\n  runtime:\n    config_sources:\n"
        "    - {path: hydra.conf, schema: pkg, provider: hydra}\n"
        f"    - {{path: {ROOT / 'conf'}, schema: file, provider: main}}\n"
        "    - {path: /my/conf, schema: file, provider: command-line}\n"
        "    - {path: '', schema: structured, provider: schema}\n")
    args = ["trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(args) == ["--config-name", "exp", "--config-dir", "/my/conf",
                                   "model=mine", *args]
    assert resumeargs.said().startswith(
        "resume: the run's own overrides that this command does not set again apply: "
        "--config-name exp --config-dir /my/conf model=mine (from ")
    for own in (["-cd", "/moved"], ["--config-dir=/moved"], ["--config-dir", "/moved"]):
        assert with_runs_own([*own, *args]) == ["--config-name", "exp", *own, "model=mine",
                                                *args]  # (given again: the command's)
    assert with_runs_own(["-cn", "other", *args]) == ["--config-dir", "/my/conf", "-cn",
                                                      "other", "model=mine", *args]
    plain = launched_with(tmp_path / "plain")  # no override of its own: the flags still come
    (plain / ".hydra" / "overrides.yaml").write_text("[]\n")  # (as Hydra writes none)
    (plain / ".hydra" / "hydra.yaml").write_text(
        "hydra:\n  job:\n    config_name: exp\n  runtime:\n    config_sources: []\n")
    args = ["trainer.resume=auto", f"hydra.run.dir={plain}"]
    assert with_runs_own(args) == ["--config-name", "exp", *args]


def test_a_run_from_a_config_dir_of_its_own_resumes_and_validates_in_the_short_form(tmp_path):
    """The README's short resume and validation commands, given no --config-dir, after a run
    of a config of one's own (a primary config and a model group in a folder beside conf/)."""
    mine = tmp_path / "mine"
    (mine / "model").mkdir(parents=True)
    (mine / "model" / "narrow.yaml").write_text(
        "_target_: trainer.models.MLP\nhidden: [16]\ndropout: 0.0\n"
        "activation_checkpointing: false\n")
    (mine / "short.yaml").write_text(
        "defaults:\n  - train\n  - override model: narrow\n  - _self_\n"
        "trainer:\n  max_epochs: 2\n  progress_bar: false\n")
    run = tmp_path / "run"
    first = run_cli(["--config-dir", str(mine), "--config-name", "short",
                     f"hydra.run.dir={run}"], cwd=ROOT)
    assert first.returncode == 0, first.stderr[-2000:]
    again = run_cli(["trainer.resume=auto", f"hydra.run.dir={run}", "trainer.max_epochs=3"],
                    cwd=ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["warnings"] == 0
    assert f"--config-name short --config-dir {mine}" in again.stdout
    checked = run_cli(["trainer.validate_only=true", f"hydra.run.dir={tmp_path / 'checked'}",
                       f"trainer.init_from={run / 'checkpoints' / 'last.pt'}"], cwd=ROOT)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert f"val_loss {summary['val_loss']:.4f}" in checked.stdout.strip().splitlines()[-1]


def test_a_flags_value_is_no_override_and_a_sweep_by_its_mode_carries_nothing(tmp_path):
    run = launched_with(tmp_path / "run", "optim.lr=0.1", "hydra_x=1")
    args = ["--config-dir", "conf=x", "trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(args) == ["--config-dir", "conf=x", "optim.lr=0.1", "hydra_x=1",
                                   "trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(["hydra.mode=MULTIRUN", *args[2:]]) == ["hydra.mode=MULTIRUN",
                                                                 *args[2:]]


@pytest.mark.parametrize("how", ["sweep", "no run dir", "another run's checkpoint", "fresh",
                                 "no record"])
def test_nothing_is_carried_where_the_command_does_not_resume_a_run_in_place(tmp_path, how):
    run = launched_with(tmp_path / "run", "optim.lr=1e-3")
    args = {"sweep": ["-m", "trainer.resume=auto", f"hydra.run.dir={run}"],
            "no run dir": ["trainer.resume=auto"],
            "another run's checkpoint": [f"trainer.resume={tmp_path / 'other' / 'last.pt'}",
                                         f"hydra.run.dir={run}"],
            "fresh": [f"hydra.run.dir={run}"],
            "no record": ["trainer.resume=auto", f"hydra.run.dir={tmp_path / 'none'}"]}[how]
    assert with_runs_own(list(args)) == args
    assert resumeargs.said() is None


@pytest.mark.parametrize("text,why", [
    ("optim: {lr: 1}\n", "is not a list of overrides Hydra can parse"),
    ("- 'optim.lr=[1,'\n", "is not a list of overrides Hydra can parse"),
    ("- trainer.max_epochs=2\n- {{\n", "cannot be read (while parsing a flow node")])
def test_a_record_that_cannot_be_read_is_one_line_not_the_defaults(tmp_path, text, why):
    """An edited or damaged record was passed over: the run resumed under the defaults (its
    lr, its length), exit 0, and its record was overwritten with the command's alone."""
    run = launched_with(tmp_path / "run", "optim.lr=1e-3")
    record = run / ".hydra" / "overrides.yaml"
    record.write_text(text)
    for args in (["trainer.resume=auto", f"hydra.run.dir={run}"],
                 ["trainer.validate_only=true", f"trainer.init_from={run}/checkpoints/last.pt"]):
        with pytest.raises(ConfigError) as e:
            with_runs_own(args)
        assert str(e.value).startswith(f"{record}: the run's record of its overrides {why}")
        assert str(e.value).endswith("this launch would take the run's own settings from it: "
                                     "mend it (one override a line, '- key=value'), or delete "
                                     "it to give every setting on the command line")


def test_a_deletion_the_run_made_and_the_command_makes_again_deletes_once(tmp_path):
    """A run launched with `~model.dropout` could not be resumed by the command it printed
    itself (with the `~key` again), nor requeued by the SLURM script: Hydra was asked to
    delete the key twice."""
    run = launched_with(tmp_path / "run", "~model.dropout", "data.batch_size=8")
    args = ["data.batch_size=8", "~model.dropout", "trainer.resume=auto", f"hydra.run.dir={run}"]
    assert with_runs_own(args) == args


def test_a_key_the_run_added_and_the_command_sets_again_is_added_with_its_value(tmp_path):
    """`+optim.amsgrad=true` in the record, `optim.amsgrad=false` on the command: Hydra
    refused the plain override of a key the config has not (use '+'), as if the command's
    key did not win."""
    run = launched_with(tmp_path / "run", "+optim.amsgrad=true", "+model.extra=1")
    args = ["optim.amsgrad=false", "~model.extra", "trainer.resume=auto",
            f"hydra.run.dir={run}"]
    assert with_runs_own(args) == ["+model.extra=1", "++optim.amsgrad=false", "~model.extra",
                                   "trainer.resume=auto", f"hydra.run.dir={run}"]


def test_an_error_line_says_when_nothing_of_the_record_was_taken(tmp_path):
    run = launched_with(tmp_path / "run", "+optim.amsgrad=true")
    with_runs_own(["optim=sgd", "trainer.resume=auto", f"hydra.run.dir={run}"])
    assert resumeargs.took() == (f" (this launch took none of the run's own overrides from "
                                 f"{run / '.hydra' / 'overrides.yaml'}; left out, in a config "
                                 "group chosen otherwise: +optim.amsgrad=true)")


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


def test_a_validation_takes_the_checkpoints_run_beside_the_slurm_scripts_resume(tmp_path):
    """`trainer.resume=auto hydra.run.dir=<new>` (what scripts/slurm/train.sbatch passes) was
    taken for a resume in place of the new dir: none of the run's settings, another split and
    loss validated, exit 0."""
    run = launched_with(tmp_path / "run", "data.dataset.val_fraction=0.3")
    args = ["trainer.resume=auto", f"hydra.run.dir={tmp_path / 'checked'}",
            "trainer.validate_only=true", f"trainer.init_from={run}/checkpoints/last.pt"]
    assert with_runs_own(args) == ["data.dataset.val_fraction=0.3", *args]
    assert resumeargs.said().startswith("trainer.validate_only: ")


def test_a_validation_leaves_out_how_the_run_trained(tmp_path):
    """A fine-tuned run's `trainer.init_strict=false` made the validation refuse its own
    checkpoint (it would leave tensors as initialised); a `debug=profile` run's was refused as
    a profile."""
    run = launched_with(tmp_path / "run", "debug=profile", "trainer.init_from=base.pt",
                        "trainer.init_strict=false", "trainer.profile=true",
                        "trainer.fast_dev_run=false", "model.hidden=[8]")
    args = ["trainer.validate_only=true", f"trainer.init_from={run}/checkpoints/last.pt"]
    assert with_runs_own(args) == ["model.hidden=[8]", *args]
    resumed = ["trainer.resume=auto", f"hydra.run.dir={run}"]  # (a resume keeps them all)
    assert with_runs_own(resumed) == ["debug=profile", "trainer.init_strict=false",
                                      "trainer.profile=true", "trainer.fast_dev_run=false",
                                      "model.hidden=[8]", *resumed]


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


def test_a_launch_with_a_record_that_cannot_be_read_ends_in_one_line_leaving_it(tmp_path):
    run = launched_with(tmp_path / "run", "optim.lr=1e-3")
    record = run / ".hydra" / "overrides.yaml"
    record.write_text("- {{\n")
    proc = run_cli(["trainer.resume=auto", f"hydra.run.dir={run}"], cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"stoker: error: {record}: the run's record of its overrides cannot be read"), \
        proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and record.read_text() == "- {{\n"


def test_an_interpolated_override_is_recorded_as_typed_and_carried_so(tmp_path):
    """`+task.metrics.f1.num_classes=${data.num_classes}` was recorded resolved, to None where
    the dataset's `classes` give the count later: its checkpoint's validation then built the
    metric with None."""
    run, checked = tmp_path / "run", tmp_path / "checked"
    metric = ["+task.metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
              "+task.metrics.f1.num_classes=${data.num_classes}"]
    first = run_cli(["data.dataset._target_=tests.helpers.NamedClassesDigits",
                     "data.num_classes=null", *metric, "trainer.max_steps=2",
                     "trainer.progress_bar=false", f"hydra.run.dir={run}"], cwd=ROOT)
    assert first.returncode == 0, first.stderr[-2000:]
    assert metric[1] in (run / ".hydra" / "overrides.yaml").read_text()
    again = run_cli(["trainer.validate_only=true",
                     f"trainer.init_from={run / 'checkpoints' / 'last.pt'}",
                     f"hydra.run.dir={checked}"], cwd=ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((checked / "summary.json").read_text())["val_f1"] >= 0

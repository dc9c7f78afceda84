"""Every option of every config group composes, validates and instantiates."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.helpers import CONF, make_memmap_root
from trainer import schedules
from trainer.components import build
from trainer.checks import _check_trainer, resolve

GROUPS = ["data", "model", "task", "optim", "sched", "trainer", "debug", "experiment"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
# options that need a key of the user's own before they can build anything
USER_OPTIONS = {("model", "custom"): ["model._target_=trainer.models.MLP"],
                ("data", "custom"): ["+data.dataset._target_=data.datasets.DigitsDataset",
                                     "data.input_shape=[1,8,8]", "data.num_classes=10"]}


def test_every_group_has_options():
    assert {g for g, _ in OPTIONS} == set(GROUPS)


def test_help_lists_only_the_options_of_each_group():
    """The keys every task takes are a file the tasks include, outside conf/task/: --help
    listed it as `task: _base`, which gave `task: needs a _target_`."""
    from tests.helpers import run_cli

    proc = run_cli(["--help"])
    assert proc.returncode == 0
    assert "task: classification, language_model, model_loss, regression\n" in proc.stdout
    assert not [g for g in GROUPS for p in (CONF / g).glob("_*.yaml")]


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(make_cfg, tmp_path, group, option):
    overrides = [f"{group}={option}", *USER_OPTIONS.get((group, option), [])]
    if option == "memmap":
        overrides.append(f"data.dataset.root={make_memmap_root(tmp_path / 'mm')}")
    if option == "image_folder":
        from scripts.make_images import write_images

        write_images(tmp_path / "images", count=12, size=20, classes=3)
        overrides += [f"data.dataset.root={tmp_path / 'images'}", "data.dataset.size=16"]
    if option == "shards":
        from data.images import ImageFolder
        from data.shardwriter import write_shards
        from scripts.make_images import write_images

        write_images(tmp_path / "images", count=12, size=20, classes=3)
        for split in ("train", "val"):
            write_shards(ImageFolder(split, str(tmp_path / "images"), size=16),
                         tmp_path / "shards" / split)
        overrides += [f"data.dataset.root={tmp_path / 'shards'}", "data.dataset.size=16"]
    if group == "model" and option == "cnn":
        overrides.append("data=synthetic")  # the CNN needs [C, H, W] images, as both give
    if (group == "model" and option == "transformer") or (group, option) == (
            "task", "language_model"):
        overrides.append("experiment=tokens_transformer")  # the language model reads tokens
    cfg = make_cfg(*overrides)
    spec = resolve(cfg)
    assert spec.device.type == "cpu"
    if group == "data":  # building a dataset is the costly part: only for its own group
        if "num_samples" in cfg.data.dataset:
            cfg.data.dataset.num_samples = 8
        for split in ("train", "val"):
            ds = instantiate(cfg.data.dataset, split=split)
            x, y = ds[0] if hasattr(ds, "__getitem__") else \
                ds.decode(next(ds.samples_in([0], 0, 1)))  # a stream: its first sample
            assert list(x.shape) == list(cfg.data.input_shape)
            assert 0 <= int(y.min()) and int(y.max()) < cfg.data.num_classes
    model = build(cfg.model, "model", {"input_shape": list(cfg.data.input_shape),
                                       "num_classes": cfg.data.num_classes})
    tokens = cfg.model._target_.endswith("Transformer")
    x = torch.zeros(2, *cfg.data.input_shape, dtype=torch.int64 if tokens else torch.float32)
    logits = model(x)
    assert logits.shape[0] == 2 and logits.shape[-1] == cfg.data.num_classes
    task = build(cfg.task, "task")
    regression = cfg.task._target_.endswith("Regression")  # real-valued targets
    y = torch.zeros(logits.shape if regression else logits.shape[:-1],
                    dtype=torch.float32 if regression else torch.int64)
    own_loss = cfg.task._target_.endswith("ModelLoss")  # the model returns its loss
    assert torch.isfinite(task.loss(logits.pow(2).mean() if own_loss else logits, (x, y)))
    optimizer = instantiate(cfg.optim)(model.parameters())
    scheduler = schedules.build(instantiate(cfg.sched), optimizer, total_steps=10)
    optimizer.step()
    scheduler.step()


def test_slurm_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm", "run_dir=x"],
                      return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.tasks_per_node == cfg.hydra.launcher.gpus_per_node


def test_debug_runs_go_to_their_own_folder():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        plain = compose("train", overrides=["run_dir=x"], return_hydra_config=True)
        debug = compose("train", overrides=["run_dir=x", "debug=fdr"], return_hydra_config=True)
    # unresolved: the launch stamp resolves only inside a running job
    assert OmegaConf.to_container(plain.hydra.run)["dir"] == "${stoker_stamp:outputs}"
    assert OmegaConf.to_container(debug.hydra.run)["dir"] == "${stoker_stamp:outputs/debug}"


def test_a_debug_mode_applies_over_an_experiment(tmp_path):
    """`experiment=synthetic_cnn debug=overfit` kept the experiment's 3 epochs (the experiment
    came after the debug mode in the defaults): the overfit ran 12 steps of its 240."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["run_dir=x", "experiment=synthetic_cnn",
                                          "debug=overfit"])
    assert cfg.trainer.max_epochs == 60 and cfg.trainer.overfit_batches == 4
    # an experiment's early stopping is off: it ended an overfit after 20 of its 60 epochs
    assert cfg.trainer.early_stopping.patience == 0
    assert cfg.model._target_ == "trainer.models.SmallCNN" and cfg.data.dataset._target_ \
        == "data.datasets.SyntheticDataset"  # (the experiment's model and data, debugged)
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "patient.yaml").write_text(
        "# @package _global_\ntrainer:\n  checkpoint: {monitor: val_acc}\n"
        "  early_stopping: {patience: 2, min_delta: 0.01}\n")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["run_dir=x", f"hydra.searchpath=[file://{tmp_path}]",
                                          "experiment=patient", "debug=overfit"])
    assert cfg.trainer.early_stopping.patience == 0 and cfg.trainer.max_epochs == 60
    _check_trainer(cfg)  # (its min_delta without patience was refused)

"""Every option of every config group composes, validates and instantiates."""
from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate

from tests.helpers import CONF, make_memmap_root
from trainer import schedules
from trainer.config import resolve

GROUPS = ["data", "model", "optim", "sched", "trainer", "debug", "experiment"]
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]


def test_every_group_has_options():
    assert {g for g, _ in OPTIONS} == set(GROUPS)


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(make_cfg, tmp_path, group, option):
    overrides = [f"{group}={option}"]
    if option == "memmap":
        overrides.append(f"data.dataset.root={make_memmap_root(tmp_path / 'mm')}")
    if group == "model" and option == "cnn":
        overrides.append("data=synthetic")  # the CNN needs [C, H, W] images, as both give
    if group == "model" and option == "transformer":
        overrides.append("data=tokens")  # the language model reads token sequences
    cfg = make_cfg(*overrides)
    spec = resolve(cfg)
    assert spec.device.type == "cpu"
    if group == "data":  # building a dataset is the costly part: only for its own group
        if "num_samples" in cfg.data.dataset:
            cfg.data.dataset.num_samples = 8
        for split in ("train", "val"):
            x, y = instantiate(cfg.data.dataset, split=split)[0]
            assert list(x.shape) == list(cfg.data.input_shape)
            assert 0 <= int(y.min()) and int(y.max()) < cfg.data.num_classes
    model = instantiate(cfg.model)
    tokens = cfg.model._target_.endswith("Transformer")
    logits = model(torch.zeros(2, *cfg.data.input_shape,
                               dtype=torch.int64 if tokens else torch.float32))
    assert logits.shape[0] == 2 and logits.shape[-1] == cfg.data.num_classes
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

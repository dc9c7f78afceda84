"""Shared fixtures: the real config composed with CPU-friendly overrides and a tmp run dir."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, List

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import trainer.config  # noqa: F401  (registers train_schema)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Fast, quiet, single-process, CPU: what every test starts from unless it overrides it.
CPU_OVERRIDES = [
    "trainer.accelerator=cpu",
    "trainer.progress_bar=false",
    "data.num_workers=0",
]


def compose_cfg(run_dir: Path, *overrides: str) -> DictConfig:
    """The real conf/train.yaml composed with CPU overrides, then `overrides`."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[f"run_dir={run_dir}", *CPU_OVERRIDES, *overrides])


@pytest.fixture
def make_cfg(tmp_path) -> Callable[..., DictConfig]:
    def _make(*overrides: str, run_dir: Path | None = None) -> DictConfig:
        return compose_cfg(run_dir or tmp_path / "run", *overrides)

    return _make


def run_cli(args: List[str], cwd: Path = ROOT, timeout: float = 240,
            module: str | None = None, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `python train.py ARGS` (or `python -m module ARGS`) as a user would."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "STOKER_TRACEBACK")}
    env.update({"PYTHONUNBUFFERED": "1", **(env_extra or {})})
    cmd = [sys.executable, "-m", module] if module else [sys.executable, str(ROOT / "train.py")]
    return subprocess.run(cmd + args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def params_of(model: torch.nn.Module) -> List[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_memmap_root(root: Path, n: int = 40, shape=(3, 8, 8), classes: int = 4,
                     dtype: str = "float32") -> Path:
    """A small prepared dataset (as scripts/prepare_data.py writes it) under `root`."""
    import json

    from data.cache import write_arrays
    from data.datasets import SyntheticDataset

    for split in ("train", "val"):
        write_arrays(SyntheticDataset(split, num_samples=n, input_shape=shape,
                                      num_classes=classes, dtype=dtype), root / split)
    (root / "meta.json").write_text(json.dumps(
        {"input_shape": list(shape), "num_classes": classes, "splits": {}}))
    return root

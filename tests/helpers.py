"""Shared test helpers (paths, config composition, process launchers) and test-only
components, reachable by `_target_` from a real `python train.py` process.

Tests import helpers from here, never from conftest.py or another test file; conftest.py keeps
only fixtures and pytest hooks. No pytest import: a `python train.py` process imports this.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import trainer.config  # noqa: F401  (registers train_schema)
from data.datasets import DigitsDataset

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


def make_memmap_root(root: Path, n: int = 40, shape=(3, 8, 8), classes: int = 4,
                     dtype: str = "float32") -> Path:
    """A small prepared dataset (as scripts/prepare_data.py writes it) under `root`."""
    from data.cache import write_arrays
    from data.datasets import SyntheticDataset

    for split in ("train", "val"):
        write_arrays(SyntheticDataset(split, num_samples=n, input_shape=shape,
                                      num_classes=classes, dtype=dtype), root / split)
    (root / "meta.json").write_text(json.dumps(
        {"input_shape": list(shape), "num_classes": classes, "splits": {}}))
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Launching train.py under torchrun, as users do (tests/test_train.py, tests/trainer/test_speed.py).
QUIET = ["trainer.progress_bar=false", "data.num_workers=0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def launch(cmd, cwd, timeout=180, env=None):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "STOKER_"))},
           "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def torchrun(nproc, args, cwd, timeout=180, multirun=False):
    cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", str(ROOT / "train.py"),
                      *(["-m"] if multirun else []), *QUIET, *args]
    return launch(cmd, cwd, timeout)


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_weights(summary):
    return torch.load(summary["checkpoint"], weights_only=True)["model"]


class FailingOnRankDigits(DigitsDataset):
    """Digits whose `fail_index`-th sample raises on rank `fail_rank` (of a torchrun job)."""

    def __init__(self, split: str = "train", fail_rank: int = 1, fail_index: int = 0, **kw):
        super().__init__(split, **kw)
        self.armed = split == "train" and int(os.environ.get("RANK", "0")) == fail_rank
        self.fail_index = fail_index
        self.seen = 0

    def __getitem__(self, i):
        self.seen += 1
        if self.armed and self.seen > self.fail_index:
            raise RuntimeError(f"injected failure on rank {os.environ.get('RANK')}")
        return super().__getitem__(i)


class NaNAfterMLP(__import__("trainer.models", fromlist=["MLP"]).MLP):
    """An MLP whose training forward returns NaN logits from its `nan_after`-th call on."""

    def __init__(self, *args, nan_after: int = 10, **kwargs):
        super().__init__(*args, **kwargs)
        self.nan_after, self.calls = nan_after, 0

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls > self.nan_after:
                out = out * float("nan")
        return out

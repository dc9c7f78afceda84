"""Shared fixtures and pytest hooks: the real config composed with CPU-friendly overrides and a
tmp run dir. Shared helpers live in tests/helpers.py; import them from there."""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Callable

import pytest
import torch
from omegaconf import DictConfig

from tests.helpers import compose_cfg

# A suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT
# ignored and passes that on to every process it starts, whose Ctrl-C then does nothing: the
# tests of Ctrl-C need Python's own handler here and the default in the processes they start.
signal.signal(signal.SIGINT, signal.default_int_handler)

# The suite runs two test processes on two cores (pytest -n 2): torch's intra-op threads, one
# a core in each, would be four busy threads on two cores, each step waiting at its threads'
# barriers (the in-process tests took twice as long). One thread each, and in the processes
# they start (train.py, the scripts; torchrun sets the same for its ranks).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def make_cfg(tmp_path) -> Callable[..., DictConfig]:
    def _make(*overrides: str, run_dir: Path | None = None) -> DictConfig:
        return compose_cfg(run_dir or tmp_path / "run", *overrides)

    return _make


@pytest.fixture(scope="session")
def suite_dir(tmp_path_factory) -> Path:
    """A folder that every pytest worker of this suite run shares (helpers.made_once)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "suite"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    """Every test but the `gpu`-marked ones runs on the CPU, on a GPU machine too, as in CI:
    CUDA is hidden from it and from the processes it starts (train.py, torchrun's ranks, the
    benchmark scripts). Otherwise a 2-rank torchrun test would put its second rank on a GPU
    that a one-GPU machine lacks, and scripts would take CUDA paths the test does not expect."""
    if request.node.get_closest_marker("gpu"):
        return
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

"""Atomic writes, clear errors for bad files, refusal of a foreign model."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer import checkpoint
from trainer.checkpoint import CheckpointError


def test_save_then_load_round_trip(tmp_path):
    path = checkpoint.save({"model": {"w": torch.ones(3)}, "step": 7}, tmp_path / "c" / "a.pt")
    state = checkpoint.load(path)
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.ones(3))
    assert [p.name for p in path.parent.iterdir()] == ["a.pt"]  # no temp file left


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = checkpoint.save({"model": {"w": torch.zeros(2)}, "step": 1}, tmp_path / "last.pt")

    def full_disk(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError):
        checkpoint.save({"model": {"w": torch.ones(2)}, "step": 2}, path)
    monkeypatch.undo()
    assert checkpoint.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.parametrize("content", [b"", b"garbage" * 10, None])
def test_damaged_file_is_one_line_naming_it(tmp_path, content):
    path = tmp_path / "bad.pt"
    if content is None:  # truncated real checkpoint
        checkpoint.save({"model": {"w": torch.randn(1000)}}, path)
        path.write_bytes(path.read_bytes()[:500])
    else:
        path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_foreign_pickle_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"weights": 1}, path)
    with pytest.raises(CheckpointError, match="not a Stoker checkpoint"):
        checkpoint.load(path)


def test_mismatched_model_lists_the_mismatches(tmp_path):
    small, other = nn.Linear(4, 2), nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_model_state(other, {"model": small.state_dict()}, tmp_path / "x.pt")
    msg = str(info.value)
    assert "missing: 0.bias, 0.weight" in msg and "unexpected: bias, weight" in msg
    with pytest.raises(CheckpointError, match="shape mismatch: bias, weight"):
        checkpoint.load_model_state(nn.Linear(4, 3), {"model": small.state_dict()}, "x.pt")


def test_find_resume(tmp_path):
    assert checkpoint.find_resume(None, tmp_path) is None
    assert checkpoint.find_resume("auto", tmp_path) is None  # nothing yet: fresh start
    last = checkpoint.save({"model": {}}, tmp_path / "checkpoints" / "last.pt")
    assert checkpoint.find_resume("auto", tmp_path) == last
    assert checkpoint.find_resume(str(last), tmp_path) == last
    with pytest.raises(CheckpointError, match="trainer.resume=/nope.pt"):
        checkpoint.find_resume("/nope.pt", tmp_path)

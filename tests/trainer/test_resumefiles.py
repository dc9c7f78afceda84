"""trainer/resumefiles.py: which checkpoint a run resumes from (null, auto, a path), and
auto's fall-back past damaged files."""
from __future__ import annotations

import pytest

from tests.helpers import whole
from trainer import checkpoint, resumefiles
from trainer.checkpoint import CheckpointError


def test_find_resume(tmp_path):
    assert resumefiles.find_resume(None, tmp_path) is None
    assert resumefiles.find_resume("auto", tmp_path) is None  # nothing yet: fresh start
    step = checkpoint.save(whole(4), tmp_path / "checkpoints" / "step-00000004.pt")
    path, state, skipped = resumefiles.find_resume("auto", tmp_path)
    assert path == step and state["step"] == 4 and skipped == []
    assert resumefiles.find_resume(str(step), tmp_path)[0] == step
    with pytest.raises(CheckpointError, match="trainer.resume=/nope.pt"):
        resumefiles.find_resume("/nope.pt", tmp_path)
    with pytest.raises(CheckpointError, match=r"^trainer.resume='': is empty \(give a path"):
        resumefiles.find_resume("", tmp_path)  # (not "a directory": the working one)
    # a run dir: how to continue the run in it, or start from one of its files
    with pytest.raises(CheckpointError, match=rf"^trainer.resume={tmp_path}: a directory, not a "
                                              rf"checkpoint file; to continue the run in it: "
                                              rf"trainer.resume=auto hydra.run.dir={tmp_path}, "):
        resumefiles.find_resume(str(tmp_path), tmp_path / "new")


def test_auto_resume_falls_back_past_damaged_files(tmp_path):
    folder = tmp_path / "checkpoints"
    good = checkpoint.save(whole(2), folder / "step-00000002.pt")
    checkpoint.save(whole(4), folder / "step-00000004.pt")
    (folder / "step-00000004.pt").write_bytes(b"truncated")
    (folder / "last.pt").write_bytes(b"")
    path, state, warnings = resumefiles.find_resume("auto", tmp_path)
    assert path == good and state["step"] == 2
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert "last.pt" in warnings[0] and "step-00000004.pt" in warnings[1]


def test_a_damaged_file_under_two_names_is_said_once(tmp_path):
    """last.pt is a hard link of the newest step file: one damaged file was two warnings."""
    folder = tmp_path / "checkpoints"
    good = checkpoint.save(whole(2), folder / "step-00000002.pt")
    (folder / "step-00000004.pt").write_bytes(b"truncated")
    (folder / "last.pt").hardlink_to(folder / "step-00000004.pt")
    path, state, warnings = resumefiles.find_resume("auto", tmp_path)
    assert path == good and len(warnings) == 1
    assert warnings[0].startswith(f"checkpoint {folder / 'last.pt'}: ") and \
        warnings[0].endswith(" (so is step-00000004.pt, the same file)"), warnings

"""The checkpoint writer: retention by step number, last.pt/best.pt links, background writes
and their errors, leftovers of interrupted writes."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import whole
from trainer import checkpoint, resumefiles, saver


def test_leftover_temp_files_are_removed_on_the_next_start(tmp_path):
    folder = tmp_path / checkpoint.CHECKPOINT_DIR
    folder.mkdir()
    (folder / ".step-00000010.pt.abc123.tmp").write_bytes(b"half")
    (folder / ".last.pt.link").write_bytes(b"half")
    keep = checkpoint.save({"model": {}, "step": 1}, folder / "step-00000001.pt")
    saver.Checkpointer(tmp_path, keep_last=3, async_save=False, enabled=True)
    assert sorted(p.name for p in folder.iterdir()) == [keep.name]


def test_checkpointer_keeps_the_last_k_and_links_last_and_best(tmp_path):
    writer = saver.Checkpointer(tmp_path, keep_last=2, async_save=False, enabled=True)
    for step in (1, 2, 3, 4):
        writer.save({"model": {"w": torch.full((2,), float(step))}, "step": step}, step,
                   best=step == 2)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "best.pt", "last.pt", "step-00000003.pt", "step-00000004.pt"]
    assert checkpoint.load(folder / "last.pt")["step"] == 4
    assert checkpoint.load(folder / "best.pt")["step"] == 2  # outlives its step file


def test_an_old_step_file_that_cannot_be_removed_is_a_warning_said_once(tmp_path, monkeypatch,
                                                                         caplog):
    """An immutable old step file failed the run after its new checkpoint was written, in a
    line blaming hydra.run.dir."""
    import errno
    import logging

    real = saver.unlink_quietly

    def immutable(path, failed_write=False):
        if path.endswith("step-00000001.pt"):
            raise PermissionError(errno.EPERM, "Operation not permitted", path)
        real(path, failed_write)

    monkeypatch.setattr(saver, "unlink_quietly", immutable)
    writer = saver.Checkpointer(tmp_path, keep_last=1, async_save=False, enabled=True)
    with caplog.at_level(logging.WARNING, logger="stoker"):
        for step in (1, 2, 3):
            writer.save({"model": {}, "step": step}, step)
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "last.pt", "step-00000001.pt", "step-00000003.pt"]
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"checkpoint: {folder / 'step-00000001.pt'} stays: it cannot be removed "
                    "to keep the newest trainer.checkpoint.keep_last=1 (Operation not "
                    "permitted); step-00000002.pt was written"], said


def test_retention_goes_by_step_number_and_leaves_the_users_own_files(tmp_path):
    """Past step 99,999,999 the names (8 digits, padded) no longer sort as the steps do; and
    a file of the user's named like a checkpoint is neither counted nor removed."""
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    mine = [folder / "step-00000046-keep.pt", folder / "step-manual.pt"]
    for path in mine:
        path.write_bytes(b"the user's")
    writer = saver.Checkpointer(tmp_path, keep_last=2, async_save=False, enabled=True)
    for step in (99_999_998, 99_999_999, 100_000_000, 100_000_001):
        writer.save({"model": {}, "step": step}, step)
    assert [p.name for p in checkpoint.step_files(folder)] == [
        "step-100000000.pt", "step-100000001.pt"]  # the newest two, by number
    assert all(p.read_bytes() == b"the user's" for p in mine)
    assert resumefiles.candidates(tmp_path) == [folder / "last.pt", folder / "step-100000001.pt",
                                               folder / "step-100000000.pt"]


def test_async_save_copies_first_and_writes_in_the_background(tmp_path):
    writer = saver.Checkpointer(tmp_path, keep_last=3, async_save=True, enabled=True)
    w = torch.zeros(1000)
    writer.save({"model": {"w": w}}, 1)
    w += 1  # training goes on: the checkpoint must hold the values at save time
    writer.wait()
    assert torch.equal(checkpoint.load(tmp_path / "checkpoints" / "last.pt")["model"]["w"],
                       torch.zeros(1000))


def test_async_write_errors_surface_on_the_next_wait(tmp_path, monkeypatch):
    writer = saver.Checkpointer(tmp_path, keep_last=3, async_save=True, enabled=True)
    monkeypatch.setattr(checkpoint, "save", lambda *a: (_ for _ in ()).throw(OSError("disk")))
    writer.save({"model": {}}, 1)
    with pytest.raises(OSError, match="disk"):
        writer.wait()


def test_a_folder_in_the_way_of_last_pt_is_one_line_and_leaves_no_link_behind(tmp_path):
    writer = saver.Checkpointer(tmp_path, keep_last=2, async_save=False, enabled=True)
    (writer.folder / checkpoint.LAST).mkdir(parents=True)
    with pytest.raises(checkpoint.CheckpointWriteError,
                       match=r"checkpoint .*last\.pt: cannot point it at step-00000003\.pt \(a "
                             r"folder is in the way\); .*step-00000003\.pt was written"):
        writer.save({"model": {}, "step": 3}, step=3)
    assert sorted(p.name for p in writer.folder.iterdir()) == ["last.pt", "step-00000003.pt"]


def test_a_background_write_is_seen_running_after_a_ctrl_c_stopped_the_wait_for_it(
        tmp_path, monkeypatch):
    """A Ctrl-C inside the wait for a background write marks the thread stopped while it still
    writes (Python up to 3.12): whether a write is running is counted by the writers
    themselves, so a run stopped at once still knows to leave through os._exit."""
    import os
    import signal
    import threading
    import time

    real = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda state, path: (time.sleep(1.0),
                                                                   real(state, path)))
    writer = saver.Checkpointer(tmp_path, keep_last=2, async_save=True, enabled=True)
    writer.save(whole(3), 3)
    assert saver.writing_in_background()
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()  # (a Ctrl-C)
    with pytest.raises(KeyboardInterrupt):
        writer.wait()
    assert saver.writing_in_background()
    deadline = time.monotonic() + 30
    while saver.writing_in_background() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not saver.writing_in_background()
    assert checkpoint.load(tmp_path / "checkpoints" / "last.pt")["step"] == 3

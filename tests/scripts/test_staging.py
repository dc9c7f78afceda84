"""scripts/staging.py: a folder replaced whole, also when a signal comes during the swap."""
from __future__ import annotations

import os
import shutil
import signal

import pytest

from scripts import staging


def test_a_failed_write_leaves_out_as_it_was_and_no_staging_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(ValueError):
        with staging.staged(out) as stage:
            stage.mkdir()
            (stage / "new.txt").write_text("new")
            raise ValueError("the write failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "old.txt").read_text() == "old"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_swap_lets_it_end(tmp_path, monkeypatch, sig):
    """Once written, the result goes into place whatever comes: a Ctrl-C or SIGTERM between
    the two renames or during the old folder's removal would leave --out missing or a
    half-removed folder beside it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    removing = shutil.rmtree

    def signalled_rmtree(path, *args, **kwargs):
        if ".old-" in str(path):
            os.kill(os.getpid(), sig)  # handled at the next bytecode: inside the swap
        return removing(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", signalled_rmtree)
    with staging.sigterm_raises(), staging.staged(out) as stage:
        stage.mkdir()
        (stage / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_during_the_clean_up_of_a_first_lets_it_end(tmp_path, monkeypatch):
    """A Ctrl-C stops the write; a second one, while the staging folder is removed, cut that
    short: the folder stayed beside --out, and its traceback was printed into the first's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    removing = shutil.rmtree

    def signalled_rmtree(path, *args, **kwargs):
        if ".partial-" in str(path):
            os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: in the removal
        return removing(path, *args, **kwargs)
    monkeypatch.setattr(shutil, "rmtree", signalled_rmtree)
    with pytest.raises(KeyboardInterrupt, match="the first"):
        with staging.staged(out) as stage:
            stage.mkdir()
            for i in range(50):
                (stage / f"{i}.txt").write_text("new")
            raise KeyboardInterrupt("the first")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

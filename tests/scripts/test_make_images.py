"""scripts/make_images.py: a folder of JPEG files, written whole or not at all."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from scripts import make_images
from tests.helpers import ROOT


def files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.jpg"))


def test_writes_train_and_val_per_class_and_replaces_only_its_own_folder(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_images.main(["--out", "imgs", "--count", "40", "--size", "16", "--classes", "4"])
    first = files(tmp_path / "imgs")
    assert len(first) == 40 and sum(f.startswith("val/") for f in first) == 8
    with pytest.raises(SystemExit) as e:  # a second run does not mix into the first
        make_images.main(["--out", "imgs", "--count", "20", "--size", "24", "--classes", "4"])
    assert e.value.code == 2 and "--out imgs: exists and is not empty" in capsys.readouterr().err
    assert files(tmp_path / "imgs") == first
    make_images.main(["--out", "imgs", "--count", "20", "--size", "24", "--classes", "4",
                      "--overwrite"])
    assert len(files(tmp_path / "imgs")) == 20  # replaced whole: no file of the first run
    (tmp_path / "imgs" / "notes.txt").write_text("the user's")
    with pytest.raises(SystemExit) as e:
        make_images.main(["--out", "imgs", "--overwrite"])
    assert e.value.code == 2 and ("--out imgs: holds notes.txt, which this script did not "
                                  "write") in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imgs"]  # no staging folder


@pytest.mark.parametrize("args,fragment", [
    (["--out", ".", "--overwrite"], "--out .: is the working directory or holds it"),
    (["--out", "..", "--overwrite"], "--out ..: is the working directory or holds it"),
    (["--out", "f.txt"], "--out f.txt: is a file"),
    (["--out", "f.txt/imgs"], "--out f.txt/imgs: is under {work}/f.txt, a file, not a folder"),
    (["--out", "x", "--size", "200000"], "8 <= --size <= 8192"),
    (["--out", "x", "--count", "3"], "--count >= --classes >= 1"),
    (["--out", "x", "--count", "40", "--classes", "10", "--val-fraction", "0.9"],
     "each class needs a file in train/ and in val/ (4 files a class)"),
    (["--out", "x", "--count", "20", "--classes", "10", "--val-fraction", "0.1"],
     "each class needs a file in train/ and in val/ (2 files a class)"),  # (0.2 rounds to 0)
])
def test_bad_flags_are_refused_before_anything_is_written(tmp_path, monkeypatch, capsys, args,
                                                          fragment):
    work = tmp_path / "work"
    work.mkdir()
    (work / "f.txt").write_text("the user's")
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as e:
        make_images.main(args)
    assert e.value.code == 2 and fragment.format(work=work.resolve()) in capsys.readouterr().err
    assert sorted(p.name for p in work.iterdir()) == ["f.txt"]


@pytest.mark.slow
@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                           (signal.SIGINT, 130, "interrupted")])
def test_a_stopped_run_is_one_line_and_leaves_out_as_it_was(tmp_path, sig, code, word):
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "make_images.py"),
                             "--out", "imgs", "--count", "100000", "--size", "64"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".imgs.partial-*/train")) and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err.strip().splitlines() == [
        f"make_images: {word}; --out is as it was"]
    assert list(tmp_path.iterdir()) == []


def test_a_folder_without_val_says_how_to_use_it_not_a_command_that_fails(tmp_path, capsys):
    make_images.main(["--out", str(tmp_path / "imgs"), "--count", "8", "--classes", "2",
                      "--size", "8", "--val-fraction", "0"])
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "imgs").iterdir()) == ["train"]
    command = out.split("use it: python train.py ")[1].split()
    assert f"data.dataset.root={tmp_path / 'imgs'}/train" in command and \
        "data.dataset.val_fraction=0.2" in command
    from tests.helpers import compose_cfg  # the command's config builds the folder's splits
    from trainer.components import build

    cfg = compose_cfg(tmp_path / "run", *command)
    assert len(build(cfg.data.dataset, "data.dataset", {"split": "val"})) == 2

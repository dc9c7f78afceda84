"""scripts/prepare_data.py writes a dataset that data=memmap trains on."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from data.datasets import DigitsDataset, MemmapDataset
from tests.helpers import ROOT, compose_cfg, usage_error
from trainer.runner import train


@pytest.mark.slow
def test_prepare_then_train_on_memmap(tmp_path):
    out = tmp_path / "digits"
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["input_shape"] == [1, 8, 8] and meta["num_classes"] == 10
    assert meta["splits"] == {"train": 1438, "val": 359}
    mm, src = MemmapDataset("val", str(out)), DigitsDataset("val")
    assert all(torch.equal(mm[i][0], src[i][0]) for i in range(len(src)))
    direct = train(compose_cfg(tmp_path / "a", "trainer.max_epochs=2"))
    cached = train(compose_cfg(tmp_path / "b", "data=memmap", f"data.dataset.root={out}",
                               "data.eval_batch_size=256", "trainer.max_epochs=2"))
    assert cached["val_acc"] == direct["val_acc"]  # same samples, same run


def test_each_kind_of_prepared_set_given_to_the_others_reader_names_its_reader(tmp_path):
    """Shards given to data=memmap were "meta.json has no 'input_shape' (not written by
    scripts/prepare_data.py?)", which wrote them; arrays given to data=shards, "cannot read
    train/index.json"."""
    from tests.helpers import run_cli

    for fmt in ("npy", "shards"):
        proc = subprocess.run([sys.executable, "scripts/prepare_data.py", "--out",
                               str(tmp_path / fmt), "--format", fmt], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    for data, root, said in (("memmap", "shards", "a shard set (train/index.json), which "
                                                    "data=shards reads"),
                             ("shards", "npy", "arrays (train/x.npy), which data=memmap reads")):
        proc = run_cli([f"data={data}", f"data.dataset.root={tmp_path / root}",
                        f"hydra.run.dir={tmp_path / 'run'}"])
        assert proc.returncode == 2
        assert proc.stderr.strip().startswith(
            f"stoker: error: data.dataset.root={tmp_path / root}: {said}"), proc.stderr


def test_a_table_naming_its_classes_is_packed_with_their_count_and_no_cnn(tmp_path):
    """meta.json said num_classes null beside the dataset's class names, and the line to use
    it asked for model=cnn, which cannot take 64 features."""
    out = tmp_path / "table"
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", "--out", str(out),
                           "data=custom", "+data.dataset._target_=tests.helpers.FlatNamedDigits",
                           "data.input_shape=[64]"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_classes"] == 10 and meta["input_shape"] == [64]
    assert meta["classes"][:2] == ["digit 0", "digit 1"]
    use = proc.stdout.strip().splitlines()[-1]
    assert use == f"use it: python train.py data=memmap data.dataset.root={out}"
    summary = train(compose_cfg(tmp_path / "run", *use.split()[4:], "trainer.max_steps=2"))
    assert summary["steps"] == 2


@pytest.mark.slow
def test_prepared_image_folder_rows_equal_the_decoded_files(tmp_path):
    from data.images import ImageFolder
    from scripts.make_images import write_images

    root, out = tmp_path / "images", tmp_path / "packed"
    write_images(root, count=30, size=40, classes=3)
    (root / "train" / "class_01" / "zz_broken.png").write_bytes(b"no png")
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", "--out", str(out),
                           "data=image_folder", f"data.dataset.root={root}",
                           "data.dataset.size=24", "data.num_workers=2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["input_shape"] == [3, 24, 24] and meta["num_classes"] == 3
    assert meta["classes"] == ["class_00", "class_01", "class_02"]
    assert meta["splits"] == {"train": 24, "val": 6}  # the broken file left out
    for split in ("train", "val"):
        folder = ImageFolder(split, str(root), size=24)
        decoded = [s for s in (folder[i] for i in range(len(folder))) if s is not None]
        packed = MemmapDataset(split, str(out))
        assert len(packed) == len(decoded)
        for i, (x, y) in enumerate(decoded):
            assert torch.equal(packed[i][0], x) and int(packed[i][1]) == int(y)


def test_the_use_line_carries_the_crop_of_image_shards(tmp_path):
    from omegaconf import OmegaConf

    from scripts.prepare_data import use_args

    d = OmegaConf.create({"dataset": {"root": "imgs", "size": 64, "resize": None}})
    images, digits = {"classes": ["a", "b"]}, {}
    assert use_args("shards", tmp_path, d, images) == (
        f"data=shards data.dataset.root={tmp_path} data.dataset.size=64 model=cnn")
    # arrays hold the decoded crop already (their shape says images); digits have no crop
    assert use_args("npy", tmp_path, d, {**images, "input_shape": [3, 64, 64]}) == (
        f"data=memmap data.dataset.root={tmp_path} model=cnn")
    assert use_args("shards", tmp_path, OmegaConf.create({"dataset": {}}), digits) == (
        f"data=shards data.dataset.root={tmp_path}")
    apart = OmegaConf.create({"dataset": None, "train_dataset": {"size": 32},
                              "val_dataset": {"size": 32}})  # train and val named apart
    assert use_args("shards", tmp_path / "my data", apart, images) == (
        f"data=shards data.dataset.root='{tmp_path / 'my data'}' data.dataset.size=32 model=cnn")


USER_DATA = '''
import time

import torch

class Pairs(torch.utils.data.Dataset):
    def __init__(self, split, fail_at=-1, sleep_s=0.0):
        self.n, self.fail_at, self.sleep_s = (40 if split == "train" else 10), fail_at, sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise ValueError(f"sample {i} cannot be read")
        time.sleep(self.sleep_s)
        return torch.full((3,), float(i)), i % 2
'''


def prepare_cmd(out: str, *extra) -> list:
    """prepare_data.py on the user's own Pairs dataset (imported from the working dir)."""
    return [sys.executable, str(ROOT / "scripts" / "prepare_data.py"), "--out", out,
            "data.dataset._target_=userdata.Pairs", "~data.dataset.val_fraction",
            "~data.dataset.split_seed", "data.num_workers=0", *extra]


@pytest.mark.slow
def test_a_full_out_folder_is_replaced_only_when_asked_and_only_once_complete(tmp_path):
    """--out holding files: refused without --overwrite, and refused with it unless this
    script wrote them; with it, a failed write leaves the folder as it was and a finished one
    replaces it. The dataset is a module of the user's, imported from the directory the
    command runs in, as train.py imports it."""
    (tmp_path / "userdata.py").write_text(USER_DATA)
    out = tmp_path / "packed"
    out.mkdir()
    (out / "keep.txt").write_text("a file of the user's")

    def prepare(*extra):
        return subprocess.run(prepare_cmd("packed", *extra), cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    refused = prepare()
    assert refused.returncode == 2
    assert "--out packed: exists and is not empty; give a new folder, or --overwrite" \
        in refused.stderr
    refused = prepare("--overwrite")
    assert refused.returncode == 2 and "--out packed: holds keep.txt, which this script did " \
        "not write; --overwrite replaces only a folder it wrote" in refused.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()
    first = prepare()  # an empty folder is written into
    assert first.returncode == 0, first.stderr[-3000:]
    assert "exists and is not empty" in prepare().stderr
    failed = prepare("--overwrite", "+data.dataset.fail_at=7")
    assert failed.returncode != 0 and "sample 7 cannot be read" in failed.stderr
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train", "val"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folder
    done = prepare("--overwrite")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train", "val"]
    assert json.loads((out / "meta.json").read_text())["splits"] == {"train": 40, "val": 10}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert torch.equal(MemmapDataset("train", str(out))[7][0], torch.full((3,), 7.0))
    (tmp_path / "link").symlink_to(out)  # a link to the folder: the folder is replaced
    relinked = subprocess.run(prepare_cmd("link", "--overwrite"), cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    assert relinked.returncode == 0, relinked.stderr[-3000:]
    assert (tmp_path / "link").is_symlink() and (out / "meta.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("out,fragment", [
    (".", "--out .: is the working directory or holds it"),
    ("..", "--out ..: is the working directory or holds it"),
    ("imgs", "--out imgs: overlaps data.dataset.root=imgs, which it reads"),
    ("imgs/packed", "--out imgs/packed: overlaps data.dataset.root=imgs, which it reads"),
])
def test_an_out_folder_that_would_take_the_source_or_the_working_dir_is_refused(
        tmp_path, monkeypatch, capsys, out, fragment):
    """--out is replaced whole: never the folder the command runs in (or one holding it),
    nor the data it reads, a folder inside that, or one around it; --overwrite or not."""
    from scripts import prepare_data

    work = tmp_path / "work"
    (work / "imgs" / "train" / "a").mkdir(parents=True)
    (work / "notes.txt").write_text("the user's")
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as e:
        prepare_data.prepare(["--out", out, "--overwrite", "data=image_folder",
                              "data.dataset.root=imgs"])
    assert e.value.code == 2 and fragment in capsys.readouterr().err
    assert (work / "notes.txt").is_file() and (work / "imgs" / "train" / "a").is_dir()


@pytest.mark.slow
@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "stopped by SIGTERM"),
                                           (signal.SIGINT, 130, "interrupted")])
def test_a_stopped_prepare_is_one_line_and_leaves_no_partial_folder(tmp_path, sig, code, word):
    (tmp_path / "userdata.py").write_text(USER_DATA)
    proc = subprocess.Popen(prepare_cmd("packed", "+data.dataset.sleep_s=0.05"), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not [p for p in tmp_path.iterdir() if p.name.startswith(".packed.partial")] \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # inside the write
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err[-2000:]
    assert err.strip().splitlines() == [f"stoker: error: {word}; --out is as it was"]
    # (and the __pycache__ Python writes for the user's module where bytecode is written)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [
        "userdata.py"]


def test_a_write_error_names_the_out_folder_not_the_staging_one(tmp_path, monkeypatch,
                                                                capsys):
    from scripts import prepare_data

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(prepare_data, "write_arrays", full)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        prepare_data.main(["--out", "packed"])
    assert e.value.code == 1
    assert capsys.readouterr().err.strip() == (
        "stoker: error: --out packed: cannot write it: No space left on device")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("what", ["shards", "unreadable", "none"])
def test_a_source_it_cannot_pack_is_one_line_and_leaves_no_folder(tmp_path, capsys, what):
    """Streamed shards (a worker's TypeError traceback), a folder of which no file reads
    (a ValueError traceback) and no dataset at all (data=custom: a meta.json of no splits,
    "use it" printed) are refused in one line; --out never appears."""
    from data.shardwriter import write_shards
    from scripts import prepare_data
    from scripts.make_images import write_images

    src = tmp_path / "src"
    if what == "shards":
        for split in ("train", "val"):
            write_shards([(torch.zeros(3), 0)] * 4, src / split, samples_per_shard=2)
        args, fragment = ["data=shards"], "ShardStream is streamed"
    elif what == "none":
        args, fragment = ["data=custom"], "data.train_dataset=null: no dataset"
    else:
        write_images(src, count=8, size=16, classes=2)
        for f in src.rglob("*.jpg"):
            f.write_bytes(b"")
        args, fragment = ["data=image_folder"], "nothing to cache or pack: none of the"
    with pytest.raises(SystemExit) as e:
        prepare_data.main(["--out", str(tmp_path / "out"), *args]
                          + ([f"data.dataset.root={src}"] if what != "none" else []))
    err = capsys.readouterr().err
    assert e.value.code == 2 and fragment in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["npy", "shards"])
@pytest.mark.parametrize("dataset,held", [("DictDigits", "dict(image, label, name)"),
                                          ("NamedLabelDigits", "list(Tensor, tuple)"),
                                          ("TripleDigits", "list(Tensor, Tensor, Tensor)")])
def test_samples_that_are_not_input_target_pairs_are_one_line_in_either_format(
        tmp_path, monkeypatch, capsys, fmt, dataset, held):
    """Dict samples, string labels and a third item are refused in the same one line whether
    written as arrays or as shards (not a traceback from the shard writer), exit 2, and an
    --out this script wrote before is left as it was under --overwrite."""
    from scripts import prepare_data

    out = tmp_path / "packed"
    (out / "train").mkdir(parents=True)
    (out / "meta.json").write_text('{"source": {}, "splits": {"train": 1}}')
    (out / "train" / "x.npy").write_text("the earlier one")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        prepare_data.main(["--format", fmt, "--out", "packed", "--overwrite", "data=custom",
                           "data.input_shape=[1,8,8]", "data.num_classes=10",
                           f"+data.dataset._target_=tests.helpers.{dataset}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.strip().splitlines() == [
        "stoker: error: data.cache and scripts/prepare_data.py need a dataset of (input, "
        f"target) tensor pairs, which the default collate batches, not samples that batch to "
        f"{held}; use data.cache=none for other samples"], err
    assert (out / "train" / "x.npy").read_text() == "the earlier one"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed"]  # no staging folder


@pytest.mark.parametrize("out", ["notes.txt/packed", "notes.txt/a/packed"])
def test_an_out_under_a_file_is_a_usage_error_naming_the_file(tmp_path, monkeypatch, capsys,
                                                              out):
    """Made only once the data is read, it failed then as an OS error, exit 1; refused at
    the start instead, as an --out that is a file is."""
    from scripts import prepare_data

    (tmp_path / "notes.txt").write_text("the user's")
    monkeypatch.chdir(tmp_path)
    err = usage_error(capsys, prepare_data.main, ["--out", out])
    assert err.strip().splitlines()[-1].endswith(
        f": error: --out {out}: is under {tmp_path.resolve() / 'notes.txt'}, a file, not a "
        "folder; give a folder to write"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "the user's"

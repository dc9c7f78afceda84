"""scripts/tune_loader.py sweeps the grid and prints a paste-able override line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, usage_error

sys.path.insert(0, str(ROOT / "scripts"))  # as the scripts run: benchlib beside them


@pytest.mark.slow
def test_smoke_prints_best_override_line(tmp_path):
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [sys.executable, "scripts/tune_loader.py", "--workers", "0", "1", "--prefetch", "2", "4",
         "--batches", "3", "--out", str(out), "data=synthetic", "data.dataset.num_samples=256"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    grid = [(r["num_workers"], r["prefetch_factor"]) for r in result["results"]]
    assert grid == [(0, None), (1, 2), (1, 4)]  # prefetch_factor means nothing without workers
    assert proc.stdout.splitlines()[2].split()[:2] == ["0", "-"]  # the table's 0-worker row
    assert all(r["samples_per_s"] > 0 for r in result["results"])
    line, best = result["best_overrides"], result["best"]
    assert line.startswith(f"data.num_workers={best['num_workers']}")
    # with workers, their prefetch depth; without, none (it would mean nothing)
    assert ("data.prefetch_factor=" in line) == (best["num_workers"] > 0)
    assert line in proc.stdout
    assert "(3 batches a setting: a rough reading; --batches 20 or more" in proc.stdout


@pytest.mark.slow
def test_a_users_dict_samples_from_the_working_directory(tmp_path):
    """The dataset's module is found where the command runs, as train.py finds it, and a dict
    batch counts its samples as training counts them."""
    (tmp_path / "dictdata.py").write_text(
        "import torch\n"
        "class Dicts(torch.utils.data.Dataset):\n"
        "    def __init__(self, split):\n"
        "        self.n = 96 if split == 'train' else 32\n"
        "    def __len__(self):\n"
        "        return self.n\n"
        "    def __getitem__(self, i):\n"
        "        return {'pixels': torch.zeros(4), 'label': i % 3}\n")
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "tune_loader.py"), "--batches", "2", "--out",
         str(out), "--workers", "0", "data.dataset._target_=dictdata.Dicts",  # (as the advice
         "~data.dataset.val_fraction", "~data.dataset.split_seed", "data.batch_size=32"],  # has it)
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads(out.read_text())["results"]
    assert row["samples_per_s"] > 0 and "best:" in proc.stdout


@pytest.mark.parametrize("override,said", [
    ("data.dataset._target_=nowhere.Dataset",
     "data.dataset._target_=nowhere.Dataset: no module named 'nowhere'"),
    ("data=custom", "data.train_dataset=null: no dataset: set data.dataset"),  # (a TypeError)
    ("data.batch_size=0", "data.batch_size=0: must be >= 1"),  # as train.py says it
    # one batch an epoch: nothing timed after the first (0 samples/s was recommended)
    ("data.batch_size=5000", "data.batch_size=5000: an epoch of the 1438 samples is one batch"),
])
def test_a_wrong_setting_is_one_line(capsys, tmp_path, override, said):
    from scripts.tune_loader import main

    with pytest.raises(SystemExit) as e:
        main([override, "--workers", "0", "--out", str(tmp_path / "t.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"stoker: error: {said}") and "\n" not in err, err


def test_an_image_folder_is_timed_through_its_own_collate(tmp_path, capsys):
    """As train.py batches it (the folder's collate leaves out unreadable files): a folder
    with a broken file is timed; one of which no file reads is one line, not default_collate's
    IndexError traceback."""
    from scripts.make_images import write_images
    from scripts.tune_loader import main

    root = tmp_path / "imgs"
    write_images(root, count=16, size=16, classes=2)
    next((root / "train").rglob("*.jpg")).write_bytes(b"broken")
    common = ["data=image_folder", f"data.dataset.root={root}", "data.dataset.size=8",
              "data.batch_size=4", "--workers", "0", "--prefetch", "2", "--batches", "2"]
    result = main([*common, "--out", str(tmp_path / "a.json")])
    assert result["results"][0]["samples_per_s"] > 0
    for f in (root / "train").rglob("*.jpg"):
        f.write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        main([*common, "--out", str(tmp_path / "b.json")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and err.startswith("stoker: error: data: no sample was read")


def test_more_workers_than_cpus_is_timed_without_pytorchs_warning(tmp_path, capsys):
    """A setting it times on purpose (workers waiting on reads): PyTorch's warning, printed
    twice for each, was noise."""
    import warnings as py_warnings

    from scripts.tune_loader import main

    with py_warnings.catch_warnings(record=True) as seen:
        py_warnings.simplefilter("always")
        main(["--workers", str(2 * len(os.sched_getaffinity(0)) + 1), "--batches", "2",
              "--out", str(tmp_path / "t.json"), "data=synthetic",
              "data.dataset.num_samples=256"])
    assert not [w for w in seen if "This DataLoader will create" in str(w.message)]


@pytest.mark.parametrize("args,needle", [
    (["--batches", "0"], "argument --batches: 0: must be >= 1"),
    (["--workers", "-1"], "argument --workers: -1: must be >= 0"),
    (["--workers", "0", "1000"], "argument --workers: 1000: at most "),  # (1000 processes)
    (["data.num_workers=abc"], "data.num_workers=abc: tune_loader sweeps data.num_workers "
                               "itself; give --workers instead"),
])
def test_bad_arguments_are_usage_errors(capsys, args, needle):
    from scripts.tune_loader import main

    assert needle in usage_error(capsys, main, args)


def test_overrides_after_a_list_option_are_not_taken_as_its_values():
    """`--workers 0 1 2 data=custom` said "argument --workers: 'data=custom' is not an
    integer"; an --out value with '=' in it stays the option's."""
    import argparse

    from scripts.tune_loader import overrides_first

    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, nargs="+")
    p.add_argument("--out")
    p.add_argument("--flag", action="store_true")
    p.add_argument("overrides", nargs="*")
    argv = ["--flag", "--workers", "0", "1", "data=custom", "+data.x=1", "~data.y", "--out",
            "a=b.json"]
    assert overrides_first(argv, p) == ["data=custom", "+data.x=1", "~data.y", "--flag",
                                        "--workers", "0", "1", "--out", "a=b.json"]
    a = p.parse_intermixed_args(overrides_first(argv, p))
    assert (a.workers, a.out, a.overrides) == ([0, 1], "a=b.json",
                                              ["data=custom", "+data.x=1", "~data.y"])


def test_a_loader_worker_killed_while_timing_is_one_line(tmp_path):
    """The loader's own fault, not the user's setting: one line and exit 1, wherever the
    timing thread met PyTorch's report of the worker's death."""
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [sys.executable, "scripts/tune_loader.py", "--workers", "1", "--batches", "4",
         "--out", str(out), "data=custom", "+data.dataset._target_=tests.helpers.KilledInWorker",
         "data.input_shape=[1,8,8]", "data.num_classes=10", "data.shuffle=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)  # (sample 40: the first batch)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().startswith("stoker: error: data: loader worker (pid ")
    assert not out.exists()

"""scripts/benchlib.py: the argument types, output checks and atomic JSON the benchmark
scripts share."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))  # as the scripts run: benchlib beside them


def test_at_least_takes_counts_and_refuses_the_rest():
    import argparse

    from benchlib import at_least

    assert at_least(1)("3") == 3 and at_least(0)("0") == 0
    for text, needle in (("0", "0: must be >= 1"), ("-2", "-2: must be >= 1"),
                         ("x", "'x' is not an integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            at_least(1)(text)


@pytest.mark.parametrize("script,args,needle", [
    ("compare_strategies.py", ["--nproc", "0"], "argument --nproc: 0: must be >= 1"),
    ("bench_checkpoint.py", ["--repeats", "0"], "argument --repeats: 0: must be >= 1"),
    ("bench_loader.py", ["--workers", "-1"], "argument --workers: -1: must be >= 1"),
])
def test_a_count_of_zero_is_a_usage_error_not_a_traceback(script, args, needle):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_number_at_least_takes_finite_numbers_in_bounds():
    import argparse

    from benchlib import number_at_least

    assert number_at_least(0)("0") == 0.0 and number_at_least(0, strict=True)("2.5") == 2.5
    for parse, text, needle in ((number_at_least(0), "-5", "-5: must be >= 0"),
                                (number_at_least(0, strict=True), "0", "0: must be > 0"),
                                (number_at_least(0), "inf", "'inf' is not a finite number"),
                                (number_at_least(0), "x", "'x' is not a number")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            parse(text)


def test_unwritable_says_why_before_anything_is_written(tmp_path):
    from benchlib import unwritable

    file = tmp_path / "file"
    file.write_text("x")
    assert unwritable(tmp_path) == "is a directory; give the path of a file"
    assert unwritable(file / "x.json") == f"{file} is a file, not a folder"
    assert unwritable(file / "deeper" / "x.json") == f"{file} is a file, not a folder"
    assert unwritable(tmp_path / "new" / "sub" / "x.json") is None  # made at the end, not now
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # nothing made, nothing left
    if os.access("/sys", os.W_OK) and unwritable(Path("/sys/x.json")) is None:
        pytest.skip("/sys is writable here")
    assert unwritable(Path("/sys/x.json")).startswith("cannot write in /sys (")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in a read-only folder")
def test_unwritable_names_a_read_only_folder(tmp_path):
    from benchlib import unwritable

    tmp_path.chmod(0o555)
    try:
        assert unwritable(tmp_path / "x.json") == f"cannot write in {tmp_path} (Permission denied)"
    finally:
        tmp_path.chmod(0o755)


def test_a_failed_write_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """A full disk half-way through the JSON: the good file stays whole, no temp file stays."""
    import errno

    import benchlib

    out = tmp_path / "good.json"
    benchlib.write_json(out, {"machine": {}, "results": [1]})
    good = out.read_text()

    def half_then_full(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    with pytest.raises(OSError) as e:
        benchlib.write_json(out, {"machine": {}, "results": [2]})
    monkeypatch.undo()
    assert e.value.strerror == "No space left on device" and e.value.filename == str(out)
    assert out.read_text() == good and [p.name for p in tmp_path.iterdir()] == ["good.json"]


def test_results_so_far_go_beside_the_output_until_it_is_written(tmp_path):
    import benchlib

    out = tmp_path / "bench_gpu_h100.json"
    out.write_text("the good result\n")
    side = benchlib.write_partial(out, {"results": [1]})
    assert side == tmp_path / "bench_gpu_h100.partial.json"  # run_on_gpu.sh's *_h100* finds it
    assert json.loads(side.read_text())["partial"] is True
    assert out.read_text() == "the good result\n"
    benchlib.write_json(out, {"results": [1, 2]})
    assert not side.exists() and "partial" not in json.loads(out.read_text())


OUT_SCRIPTS = ["bench_checkpoint", "bench_gpu", "bench_handoff", "bench_images", "bench_loader",
               "bench_overhead", "bench_speed", "compare_strategies", "count_ops",
               "make_benchmarks_page", "tune_loader"]


@pytest.mark.parametrize("script", OUT_SCRIPTS)
def test_every_out_is_checked_before_the_run(script, tmp_path, capsys):
    """A directory, or a path under a file, is a usage error at the start, not a traceback
    after the whole sweep."""
    import importlib

    main = importlib.import_module(script).main
    file = tmp_path / "file"
    file.write_text("x")
    for out, needle in ((tmp_path, "is a directory"),
                        (file / "x.json", f"{file} is a file, not a folder")):
        with pytest.raises(SystemExit) as e:
            main(["--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"error: --out {out}: {needle}" in err, err


def test_an_out_that_is_a_device_or_a_link_is_written_through_not_replaced(tmp_path):
    """As root, renaming over /dev/null would make it a plain file for the whole machine."""
    import benchlib

    with benchlib.atomic_path(Path("/dev/null")) as tmp:
        assert tmp == Path("/dev/null")
        tmp.write_text("{}")
    assert Path("/dev/null").is_char_device()
    target = tmp_path / "results.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    with benchlib.atomic_path(tmp_path / "link.json") as tmp:
        tmp.write_text("new")
    assert (tmp_path / "link.json").is_symlink() and target.read_text() == "new"

"""scripts/make_benchmarks_page.py: tables, plots, skipped rows, and the committed page is current."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import make_benchmarks_page as page  # noqa: E402

COMMITTED = ROOT / "docs" / "benchmarks"


def test_committed_page_is_what_the_script_writes(tmp_path):
    """docs/benchmarks.md is generated: regenerating it from the committed JSON changes nothing."""
    bench = tmp_path / "docs" / "benchmarks"
    shutil.copytree(COMMITTED, bench)
    out = page.main(["--dir", str(bench), "--out", str(tmp_path / "docs" / "benchmarks.md")])
    assert out.read_text() == (ROOT / "docs" / "benchmarks.md").read_text()


def test_every_json_gets_its_table_command_machine_and_plot(tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    gpu = {"command": "python scripts/bench_gpu.py --smoke",
           "machine": {"date": "2026-01-02T03:04:05", "cuda": False, "cpu_count": 2,
                       "platform": "Linux", "torch": "2.13.0+cpu", "python": "3.11"},
           "smoke": True, "training": [
               {"model": "cnn", "precision": "bf16", "prefetch": True, "samples_per_s": 120.5,
                "data_wait_frac": 0.01, "peak_mem_mb": 300.0},
               {"model": "cnn", "precision": "fp16", "prefetch": True,
                "skipped": "fp16 needs CUDA"}],
           "copy": [{"batch_mb": 0.25, "skipped": "needs CUDA"}]}
    (bench / "bench_gpu_cpu.json").write_text(json.dumps(gpu))
    (bench / "bench_overhead_cpu.json").write_text(json.dumps(
        {"command": "python scripts/bench_overhead.py", "partial": True,
         "machine": gpu["machine"], "results": []}))
    text = page.render(bench, tmp_path / "benchmarks.md")
    assert "- command: `python scripts/bench_gpu.py --smoke`" in text
    overhead = text.split("### `bench_overhead_cpu.json`")[1].split("###")[0]
    assert "**incomplete**" in overhead and "**incomplete**" not in text.split(
        "### `bench_gpu_cpu.json`")[1]
    assert "- machine: no GPU; 2 CPU cores; Linux; torch 2.13.0+cpu" in text
    assert "- date: 2026-01-02T03:04:05" in text and "**smoke run**" in text
    assert "| cnn | bf16 | yes | 120 |" in text.replace("120.500", "120")
    assert "| cnn | fp16 | yes | - | - | - | - | - | - | fp16 needs CUDA |" in text
    assert "| 0.250 | - | - | - | - | - | - | - | needs CUDA |" in text
    assert "![bench_gpu_cpu](benchmarks/bench_gpu_cpu-plot.png)" in text
    assert (bench / "bench_gpu_cpu-plot.png").read_bytes()[:4] == b"\x89PNG"
    # sections without files say so; nothing measured on a GPU is listed as such
    assert "Not measured yet." in text
    assert "- `python scripts/bench_gpu.py`" in text.split("## Not measured on a GPU yet")[1]


def test_missing_directory_is_one_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/make_benchmarks_page.py", "--dir",
                           str(tmp_path / "nope")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "no such directory of benchmark JSON files" in proc.stderr


MACHINE = {"date": "2026-01-02T03:04:05", "cuda": False, "cpu_count": 2, "platform": "Linux",
           "torch": "2.13.0+cpu", "python": "3.11"}


def _one_file(bench):
    bench.mkdir(parents=True)
    (bench / "bench_speed_cpu.json").write_text(json.dumps(
        {"command": "python scripts/bench_speed.py", "machine": MACHINE,
         "results": [{"switch": "baseline", "samples_per_s": 10.0, "data_wait_frac": 0.1}]}))


def test_a_relative_or_outside_out_links_the_plots_from_where_the_page_is(tmp_path,
                                                                         monkeypatch):
    """--out relative to where it runs, or in another tree than --dir: each plot's link is
    relative to the page's folder (it raised ValueError from Path.relative_to)."""
    bench = tmp_path / "repo" / "docs" / "benchmarks"
    _one_file(bench)
    monkeypatch.chdir(tmp_path / "repo")
    for out, link in ((Path("docs/benchmarks.md"), "benchmarks/bench_speed_cpu-plot.png"),
                      (tmp_path / "elsewhere" / "bm.md",
                       "../repo/docs/benchmarks/bench_speed_cpu-plot.png"),
                      (Path("bm_rel.md"), "docs/benchmarks/bench_speed_cpu-plot.png")):
        written = page.main(["--dir", str(bench), "--out", str(out)])
        assert f"![bench_speed_cpu]({link})" in written.read_text()


def test_a_bad_json_file_is_one_line_naming_it(tmp_path, capsys):
    bench = tmp_path / "benchmarks"
    _one_file(bench)
    out = tmp_path / "benchmarks.md"
    out.write_text("the page as it was\n")
    bad = bench / "bench_gpu_h100.json"
    for text, needle in (('{"machine": {"cuda"', "not valid JSON (Expecting ':' delimiter: "
                                                 "line 1 column 20)"),
                         ('{"training": []}', 'no "machine" object'),
                         (json.dumps({"machine": {**MACHINE, "cuda": True}, "training": []}),
                          "not what bench_gpu.py writes (no 'gpu')")):
        bad.write_text(text)
        with pytest.raises(SystemExit) as e:
            page.main(["--dir", str(bench), "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and "\n" not in err
        assert f"error: {bad}: {needle}" in err, err
        assert out.read_text() == "the page as it was\n"


def test_an_out_that_is_a_directory_is_a_usage_error(tmp_path, capsys):
    bench = tmp_path / "benchmarks"
    _one_file(bench)
    with pytest.raises(SystemExit) as e:
        page.main(["--dir", str(bench), "--out", str(tmp_path)])
    assert e.value.code == 2 and f"--out {tmp_path}: is a directory" in capsys.readouterr().err

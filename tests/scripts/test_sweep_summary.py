"""scripts/sweep_summary.py: the table of a sweep dir looked at later, and its usage errors."""
from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import ROOT, usage_error
from tests.trainer.test_sweep import job

sys.path.insert(0, str(ROOT / "scripts"))


def test_a_stopped_sweeps_table_and_its_record(tmp_path, capsys):
    import sweep_summary

    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optim.lr=0.1"], "completed", {"steps": 4, "val_loss": 0.5})
    (sweep / "multirun.yaml").write_text("{}\n")
    job(sweep, 1, ["optim.lr=-1"], "failed: configuration, data or checkpoint")
    sweep_summary.main([str(sweep), "--no-write"])
    assert not (sweep / "sweep.json").exists()
    sweep_summary.main([str(sweep)])
    out = capsys.readouterr().out.splitlines()
    assert out[-1].split()[:3] == ["1", "-1", "failed:"]
    assert out[-4].endswith("best by val_loss (min): job 0")
    assert json.loads((sweep / "sweep.json").read_text())["best_job"] == 0


def test_a_sweep_json_that_cannot_be_written_is_an_error_after_the_table(tmp_path, capsys):
    import sweep_summary

    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optim.lr=0.1"], "completed", {"steps": 4, "val_loss": 0.5})
    (sweep / "multirun.yaml").write_text("{}\n")
    (sweep / "sweep.json").mkdir()
    with pytest.raises(SystemExit) as e:
        sweep_summary.main([str(sweep)])
    assert e.value.code == 1
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].split()[:3] == ["0", "0.1", "completed"]
    assert err.endswith(f": error: {sweep / 'sweep.json'} not written (Is a "
                   "directory); the table above is what it would hold (--no-write prints it "
                        "only)\n") and err.count("\n") == 1
    assert sorted(p.name for p in sweep.iterdir()) == ["0", "multirun.yaml", "sweep.json"]


def test_a_damaged_file_is_one_warning_line_on_stderr(tmp_path, capsys):
    import sweep_summary

    sweep = tmp_path / "sweep"
    job(sweep, 0, ["optim.lr=0.1"], "completed", {"steps": 4, "val_loss": 0.5})
    job(sweep, 1, ["optim.lr=0.2"])
    (sweep / "1" / "status.json").write_text("{")
    (sweep / "multirun.yaml").write_text("{}\n")
    sweep_summary.main([str(sweep), "--no-write"])
    out, err = capsys.readouterr()
    assert err.endswith(f": warning: {sweep / '1' / 'status.json'}: not JSON; its job shows "
                        "as \"unreadable status.json\"\n") and err.count("\n") == 1
    assert out.splitlines()[-1].split()[:3] == ["1", "0.2", "unreadable"]


def runs_folder(p):
    """outputs/<date>: runs, not a sweep (its table would list them as jobs)."""
    job(p / "outputs", "11-00-00", ["optim.lr=0.1"], "completed", {"val_loss": 0.5})
    return p / "outputs"


def started_nothing(p):
    (p / "multirun.yaml").write_text("{}\n")
    return p


@pytest.mark.parametrize("make,needle", [
    (lambda p: p / "nope", "nope: not a folder (a sweep's dir: multirun/<date>/<time>)"),
    (runs_folder, "outputs: not a sweep's dir (no multirun.yaml, which Hydra writes into each"),
    (started_nothing, ": no job has started in this sweep yet"),
])
def test_a_folder_that_is_no_sweep_is_a_usage_error(tmp_path, capsys, make, needle):
    import sweep_summary

    assert needle in usage_error(capsys, sweep_summary.main, [str(make(tmp_path))])

"""What a run that raised leaves behind: a record where its run dir is its own, none where
the dir is another run's or the error was said in one line before the first step."""
from __future__ import annotations

import json

from omegaconf import OmegaConf

from trainer import failure
from trainer.config import ConfigError
from trainer.distributed import DistEnv


def _cfg():
    return OmegaConf.create({"trainer": {"ddp": {"timeout_s": 5}}})


def test_a_crash_before_the_first_step_is_recorded_only_in_a_dir_of_its_own(tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    crash = RuntimeError("boom")
    for run_dir, own in ((ours, True), (theirs, False)):
        said = failure.left_behind(crash, _cfg(), DistEnv(), run_dir, None, None, None, own)
        assert said is None  # (the crash itself is raised, with its traceback)
    status = json.loads((ours / "status.json").read_text())
    assert (status["status"], status["exit_code"]) == ("failed", 1)
    assert status["error"] == "RuntimeError: boom"
    assert list(theirs.iterdir()) == []  # (another run's dir: nothing written)


def test_an_error_said_in_one_line_before_the_first_step_leaves_no_status(tmp_path):
    said = failure.left_behind(ConfigError("data.batch_size=0: must be >= 1"), _cfg(),
                               DistEnv(), tmp_path, None, None, None, True)
    assert said is None
    assert not (tmp_path / "status.json").exists()

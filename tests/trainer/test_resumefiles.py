"""trainer/resumefiles.py: which checkpoint a run resumes from (null, auto, a path),
auto's fall-back past damaged files, and the overrides that resume a run."""
from __future__ import annotations

import os
import shlex
import sys

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
    # its checkpoints/ folder: the same (it said only "give a path to a .pt file")
    folder = tmp_path / "checkpoints"
    with pytest.raises(CheckpointError, match=rf"^trainer.resume={folder}: a directory, not a "
                                              rf"checkpoint file; to continue the run in it: "
                                              rf"trainer.resume=auto hydra.run.dir={tmp_path}, "
                                              rf"or start a new run from one of its "
                                              rf"checkpoints: trainer.resume={folder}/last.pt$"):
        resumefiles.find_resume(str(folder), tmp_path / "new")


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


def test_the_resume_overrides_are_the_launchs_own(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from tests.helpers import CONF

    run_dir = tmp_path / "my run"
    # from Python: where, no more, as the overrides of a composed config (run_dir: there is
    # no Hydra run dir; hydra.run.dir named none, and train.py trained another run)
    assert shlex.split(resumefiles.resume_args(run_dir)) == [
        "trainer.resume=auto", f"run_dir='{run_dir}'"]
    assert resumefiles.resume_said(run_dir) == (
        "the config this run was composed from and the overrides ['trainer.resume=auto', "
        f"\"run_dir='{run_dir}'\"]")
    job_dir = tmp_path / "optim.lr=0.1,seed=1"  # a sweep's job dir named by its overrides
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", return_hydra_config=True, overrides=[
            "optim.lr=0.1", "trainer.resume=/elsewhere/last.pt", "data.input_shape=[1,8,8]",
            f"hydra.searchpath=[file://{tmp_path}]", "hydra.run.dir=outputs/other",
            "hydra.job.chdir=false", "hydra.sweep.dir=sweeps"])
    HydraConfig.instance().set_config(cfg)
    try:
        got = shlex.split(resumefiles.resume_args(job_dir))
    finally:
        HydraConfig.instance().cfg = None
    assert got[:-1] == [f"hydra.searchpath=[file://{tmp_path}]", "hydra.job.chdir=false",
                        "optim.lr=0.1", "data.input_shape=[1,8,8]", "trainer.resume=auto"]
    parsed = OverridesParser.create().parse_override(got[-1])  # as Hydra reads it back
    assert parsed.key_or_group == "hydra.run.dir" and parsed.value() == str(job_dir)


def test_a_resume_path_that_is_no_regular_file_says_what_it_is(tmp_path):
    with pytest.raises(CheckpointError, match=r"^trainer.resume=/dev/null: not a regular file "
                                              r"\(a device, a pipe or a socket\)"):
        resumefiles.find_resume("/dev/null", tmp_path)
    with pytest.raises(CheckpointError, match=r": no such checkpoint file \(give a path"):
        resumefiles.find_resume(str(tmp_path / "nope.pt"), tmp_path)
    (tmp_path / "last.pt").write_bytes(b"")  # a misspelt name: the files beside it
    with pytest.raises(CheckpointError) as e:
        resumefiles.find_resume(str(tmp_path / "lats.pt"), tmp_path)
    assert str(e.value).endswith(f"(give a path to a .pt file, auto, or null); {tmp_path} "
                                 "holds last.pt"), e.value


def test_a_set_aside_state_is_known_by_the_step_its_roll_back_went_to(tmp_path):
    """A second roll-back to the same step sets aside into `...-00000023-2`: its step is 23
    (the name's last number was read as the step)."""
    folder = tmp_path / "checkpoints"
    for name in ("abandoned-after-step-00000023", "abandoned-after-step-00000023-2"):
        (folder / name).mkdir(parents=True)
        assert resumefiles.set_aside_step(folder / name / "last.pt", tmp_path) == 23
    assert resumefiles.set_aside_step(folder / "last.pt", tmp_path) is None
    elsewhere = tmp_path / "other" / "checkpoints" / "abandoned-after-step-00000023"
    assert resumefiles.set_aside_step(elsewhere / "last.pt", tmp_path) is None


def test_the_resume_line_starts_with_the_command_where_it_can_be_told(monkeypatch):
    """Under torchrun the line named the arguments alone: pasted after `python train.py`,
    they resumed a job of several ranks as one process."""
    monkeypatch.setattr(resumefiles.sys, "argv", ["train.py", "optim.lr=0.1"])
    here = os.path.dirname(sys.executable)  # (an activated environment: its bin on PATH)
    torchrun = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "PATH": here}
    assert resumefiles.launch_command({"PATH": here}) == "python train.py"
    assert resumefiles.launch_command(torchrun) == \
        "torchrun --standalone --nproc_per_node=4 train.py"
    # several nodes, SLURM: flags this process cannot see
    assert resumefiles.launch_command({**torchrun, "LOCAL_WORLD_SIZE": "2"}) is None
    assert resumefiles.launch_command({"SLURM_PROCID": "0", "SLURM_NTASKS": "2",
                                       "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "7",
                                       "SLURM_NODELIST": "n1"}) is None
    monkeypatch.setattr(resumefiles.sys, "argv", ["-c"])
    assert resumefiles.launch_command({}) is None


def test_the_resume_line_names_the_interpreter_that_ran_where_path_finds_another(
        monkeypatch, tmp_path):
    """A run started as `.venv/bin/python train.py` said `resume with python train.py`,
    which a shell ran with another Python (one without torch: ModuleNotFoundError)."""
    monkeypatch.setattr(resumefiles.sys, "argv", ["train.py"])
    other = tmp_path / "bin"  # (a `python` and a `torchrun` of another environment)
    other.mkdir()
    for name in ("python", "torchrun"):
        (other / name).write_text("#!/bin/sh\n")
        (other / name).chmod(0o755)
    here = os.path.dirname(sys.executable)
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for path in (str(other), ""):  # another environment's first on PATH, or none at all
        assert resumefiles.launch_command({"PATH": path}) == \
            f"{shlex.quote(os.path.join(here, 'python'))} train.py"
        assert resumefiles.launch_command({**torchrun, "PATH": path}) == \
            f"{shlex.quote(os.path.join(here, 'torchrun'))} --standalone --nproc_per_node=2 " \
            "train.py"
    # an interpreter with no torchrun script beside it: its module
    monkeypatch.setattr(resumefiles.sys, "executable", str(tmp_path / "py" / "python3"))
    assert resumefiles.launch_command({**torchrun, "PATH": str(other)}) == \
        f"{tmp_path / 'py' / 'python3'} -m torch.distributed.run --standalone " \
        "--nproc_per_node=2 train.py"
    # a `python` beside this interpreter that is another one (/usr/bin/python, a python2
    # beside /usr/bin/python3): named by the path of the one that ran
    system = tmp_path / "usr"
    system.mkdir()
    for name in ("python", "python3"):
        (system / name).write_text(f"#!/bin/sh\n# {name}\n")
        (system / name).chmod(0o755)
    monkeypatch.setattr(resumefiles.sys, "executable", str(system / "python3"))
    for path in (str(system), ""):
        assert resumefiles.launch_command({"PATH": path}) == f"{system / 'python3'} train.py"
    (system / "python").unlink()
    (system / "python").symlink_to("python3")  # (the same one: the shell's name for it)
    assert resumefiles.launch_command({"PATH": str(system)}) == "python train.py"

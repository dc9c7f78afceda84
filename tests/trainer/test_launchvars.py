"""Launcher variables that cannot describe a job are one line naming the variable; detect()
reads them as one process, so that the line can be said."""
from __future__ import annotations

import pytest

from trainer.distributed import detect
from trainer.launchvars import LaunchError, check_launch


@pytest.mark.parametrize("env,message", [
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "abc"},
     "SLURM_NTASKS=abc: must be a whole number >= 1 (slurm sets it"),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "2"},
     "SLURM_PROCID=5: must be below SLURM_NTASKS=2 (the job's ranks are 0 to one less"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_PORT": "http"},
     "MASTER_PORT=http: must be a whole number >= 1"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2: must be below WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK=-1: must be a whole number >= 0 (torchrun"),
    ({"RANK": "0", "WORLD_SIZE": "²"}, "WORLD_SIZE=²: must be a whole number >= 1"),
    # (int()'s traceback before)
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "abc"},
     "SLURM_NTASKS_PER_NODE=abc: must be tasks per node as SLURM writes them"),
])
def test_launcher_variables_that_cannot_describe_a_job_are_one_line(env, message):
    """They were an interpolation traceback, or a rank that waited out the timeout for peers
    that did not exist; detect() reads them as one process, so that the line can be said."""
    with pytest.raises(LaunchError, match=f"^{message}".replace("(", r"\(")):
        check_launch(env)
    assert detect(env).world_size == 1
    check_launch({"SLURM_PROCID": "1", "SLURM_NTASKS": "2"})  # a real job
    check_launch({})


@pytest.mark.parametrize("env,message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "RANK=0 and WORLD_SIZE=2 are set but MASTER_ADDR is "
                                       "not: the job's processes meet at"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost"},
     "RANK=0 and WORLD_SIZE=2 are set but MASTER_PORT is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"},
     "MASTER_PORT=99999: must be a port number, 1 to 65535"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "http"},
     "MASTER_PORT=http: must be a port number"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_PORT": "70000"},
     "MASTER_PORT=70000: must be a port number, 1 to 65535"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "0"},
     "MASTER_PORT=0: must be a port number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "²"},
     "MASTER_PORT=²: must be a port number"),
])
def test_a_job_without_a_meeting_point_is_one_line(env, message):
    """Variables set by hand without torchrun: the process group's start raised a ValueError
    (a 68-line traceback)."""
    with pytest.raises(LaunchError, match=f"^{message}"):
        check_launch(env)
    check_launch({"RANK": "0", "WORLD_SIZE": "1"})  # one process needs none
    check_launch({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "junk"})
    check_launch({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})


@pytest.mark.parametrize("env,message", [
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not: a job's processes get both"),
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK is not"),
])
def test_half_of_a_jobs_variables_is_one_line_not_a_lone_rank_0(env, message):
    """A process told it is rank 1 trained alone, writing as rank 0."""
    with pytest.raises(LaunchError, match=f"^{message}"):
        check_launch(env)
    check_launch({"RANK": "0"})  # (values that mean one process: as it runs)
    check_launch({"WORLD_SIZE": "1"})

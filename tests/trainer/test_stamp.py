"""trainer/stamp.py: the launch's run dir, named alike by every rank of a job."""
from __future__ import annotations

import os

from tests.helpers import run_cli
from trainer import stamp


def test_run_stamp_is_shared_by_the_ranks_of_a_job():
    torchrun = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "1"}
    # one node: the torchrun agent's start time, the same for each of its ranks
    assert stamp.run_stamp(torchrun) == stamp.run_stamp({**torchrun, "RANK": "0"})
    assert stamp.run_stamp({**torchrun, "GROUP_WORLD_SIZE": "2"}) == "rdzv-abc"
    assert stamp.run_stamp({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4"}) == "slurm-9"
    assert len(stamp.run_stamp({})) == len("2026-01-01/00-00-00")


def test_a_plain_launch_claims_a_run_dir_no_other_launch_has(tmp_path, monkeypatch):
    monkeypatch.setattr(stamp, "_stamp", lambda environ, fmt: ("2026-01-01/00-00-00",
                                                                     False))
    parent = str(tmp_path / "outputs")
    first = stamp.claim_run_dir(parent)
    assert stamp.claim_run_dir(parent) == first  # Hydra resolving the key again
    monkeypatch.setattr(stamp, "_claimed", {})  # another launch, in the same second
    second = stamp.claim_run_dir(parent)
    assert (first, second) == (f"{parent}/2026-01-01/00-00-00", f"{parent}/2026-01-01/00-00-00-1")
    assert os.path.isdir(first) and os.path.isdir(second)
    # the ranks of a job name one dir alike: no claim, no suffix
    monkeypatch.setattr(stamp, "_claimed", {})
    monkeypatch.setattr(stamp, "_stamp", lambda environ, fmt: ("2026-01-01/00-00-00",
                                                                     True))
    assert stamp.claim_run_dir(parent) == first


def test_rank_0_owns_its_jobs_dir_whichever_rank_made_it_but_not_an_earlier_attempts(
        tmp_path, monkeypatch):
    """Under torchrun, rank 1's Hydra made the dated dir before rank 0 looked in about 1
    launch in 2: rank 0 took it for a restarted job's and left it, train.log alone in it,
    after a launch refused before its first step."""
    monkeypatch.setattr(stamp, "_stamp", lambda environ, fmt: ("2026-01-01/00-00-00", True))
    monkeypatch.setattr(stamp, "_made", [])
    removed_at_exit = []
    monkeypatch.setattr(stamp.atexit, "register", lambda fn, folders: removed_at_exit.append(
        folders))
    parent = tmp_path / "outputs"
    (parent / "2026-01-01" / "00-00-00").mkdir(parents=True)  # (rank 1's)
    path = stamp.claim_run_dir(str(parent), {"RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"})
    assert stamp.made_here(path)
    # the folders above it too (each only if empty at exit): rank 1 may have made them
    assert removed_at_exit == [[path, str(parent / "2026-01-01"), str(parent)]]
    for restarted in ({"TORCHELASTIC_RESTART_COUNT": "1"}, {"SLURM_RESTART_COUNT": "2"}):
        monkeypatch.setattr(stamp, "_claimed", {})
        monkeypatch.setattr(stamp, "_made", [])
        assert not stamp.made_here(stamp.claim_run_dir(str(parent), {"RANK": "0", **restarted}))


def test_a_claim_never_loops_on_a_file_in_the_way_and_removal_stops_at_a_used_dir(tmp_path):
    (tmp_path / "outputs").write_text("a file where the dated dirs go")
    assert stamp._claim(str(tmp_path / "outputs" / "day" / "time")) == (
        str(tmp_path / "outputs" / "day" / "time"), False)
    used, empty = tmp_path / "used", tmp_path / "used" / "day" / "time"
    empty.mkdir(parents=True)
    (used / "train.log").write_text("x")
    stamp._remove_empty([str(tmp_path / "gone"), str(empty), str(empty.parent),
                               str(used)])
    assert not empty.parent.exists() and used.is_dir()


def test_a_launch_that_ran_nothing_leaves_no_claimed_dir(tmp_path):
    proc = run_cli(["--cfg", "hydra", "--resolve"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dir: outputs/" in proc.stdout and list(tmp_path.iterdir()) == []



def test_a_count_that_is_not_a_number_names_no_shared_stamp_and_does_not_fail():
    """The resolver runs before the run can refuse the variable in one line."""
    assert stamp._stamp({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "abc"}, "%Y")[1] is False


def test_a_launch_stamp_is_one_no_other_attempt_of_the_job_names(tmp_path, monkeypatch):
    """resume=auto in such a dir finds nothing, surely a mistake; not where a requeue or a
    restart names the same dir (the job's id, or the torchrun agent that restarts)."""
    monkeypatch.setattr(stamp, "_claimed", {("outputs", "x"): str(tmp_path / "d")})
    plain, job = str(tmp_path / "d"), str(tmp_path / "d" / "0")  # (a sweep's job inside)
    assert stamp.is_launch_stamp(plain, {}) and stamp.is_launch_stamp(job, {})
    assert not stamp.is_launch_stamp(str(tmp_path / "named"), {})
    torchrun = {"TORCHELASTIC_RUN_ID": "abc", "RANK": "0"}
    assert stamp.is_launch_stamp(plain, {**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"})
    for reused in ({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "3"},
                   {**torchrun, "GROUP_WORLD_SIZE": "2"},  # (the rendezvous id)
                   {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "2"},
                   {**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"}):
        assert not stamp.is_launch_stamp(plain, reused), reused
    # one SLURM task: its stamp is the launch's time, which a requeue does not keep
    assert stamp.is_launch_stamp(plain, {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "1"})

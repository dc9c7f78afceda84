"""trainer/sweepdirs.py: a sweep's job dirs checked before a job writes into one."""
from __future__ import annotations

import json

from tests.helpers import run_cli
from trainer.runner import train

QUICK = ["trainer.max_steps=4", "trainer.progress_bar=false", "data.num_workers=0"]


def test_a_sweep_subdir_naming_no_job_is_refused_at_the_first_job(tmp_path):
    """hydra.sweep.subdir=same: job 1 was refused for job 0's checkpoints, and the relaunch
    with trainer.resume=auto it advised had job 1 continue job 0's run (lr 0.01 never
    trained, exit 0). A sweep of one value has one job: its subdir is its own."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "optim.lr=0.1,0.01", *QUICK, f"hydra.sweep.dir={sweep}",
                    "hydra.sweep.subdir=same"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"stoker: error: hydra.sweep.subdir=same: names one dir for every job of the sweep "
            f"({sweep / 'same'}), where each job would continue the one before; name the job "
            "in it: ${hydra.job.num} (the default) or ${hydra.job.override_dirname}\n"
            "stoker: the sweep stopped at job 0") in proc.stderr
    assert not (sweep / "same" / "checkpoints").exists()
    one = run_cli(["-m", "optim.lr=0.1", *QUICK, f"hydra.sweep.dir={tmp_path / 'one'}",
                   "hydra.sweep.subdir=same"], cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-2000:]


def test_a_sweep_resuming_one_checkpoint_in_every_job_is_refused(make_cfg, tmp_path):
    """-m optim.lr=0.1,0.01 trainer.resume=PATH: both jobs continued PATH's run at its own lr
    (kept by its optimizer state), and the table compared two equal results. A sweep of what
    a resume applies (its length) continues PATH's run in each job."""
    first = tmp_path / "first"
    train(make_cfg(*QUICK, run_dir=first))
    last = first / "checkpoints" / "last.pt"
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", "optim.lr=0.1,0.01", *QUICK, f"hydra.sweep.dir={sweep}",
                    f"trainer.resume={last}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (f"stoker: error: trainer.resume={last}: every job of this sweep of optim.lr would "
            "continue that one run, whose state keeps it (its optimizer's settings, its RNG "
            f"states): the jobs would not differ; trainer.init_from={last} starts each job "
            "from its weights") in proc.stderr
    assert not (sweep / "0" / "checkpoints").exists()
    longer = run_cli(["-m", "trainer.max_steps=5,6", "trainer.progress_bar=false",
                      f"hydra.sweep.dir={tmp_path / 'longer'}", f"trainer.resume={last}"],
                     cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr[-2000:]
    assert [json.loads((tmp_path / "longer" / j / "summary.json").read_text())["steps"]
            for j in "01"] == [5, 6]


def test_jobs_of_a_sweep_that_would_share_a_dir_are_refused_where_they_meet(tmp_path):
    """A sweep of trainer.resume paths named by ${hydra.job.override_dirname}, which leaves
    trainer.resume out: its second job had the first one's dir. A sweep dir of its own per
    job (`lr${optim.lr}`, subdir `.`) is no such sweep."""
    first = tmp_path / "first"
    run = run_cli([*QUICK, f"hydra.run.dir={first}", "trainer.checkpoint.every_n_steps=2"],
                  cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    points = ",".join(str(first / "checkpoints" / f"step-0000000{n}.pt") for n in (2, 4))
    shared = run_cli(["-m", f"trainer.resume={points}", "trainer.max_steps=5",
                      "trainer.progress_bar=false", f"hydra.sweep.dir={tmp_path / 'paths'}",
                      "hydra.sweep.subdir=${hydra.job.override_dirname}"], cwd=tmp_path)
    assert shared.returncode == 2, shared.stderr[-2000:]
    assert "stoker: error: hydra.sweep.subdir=${hydra.job.override_dirname}: job 1 has the " \
           "dir of job 0 (" in shared.stderr
    own = run_cli(["-m", "optim.lr=0.1,0.2", "trainer.max_steps=1", "trainer.progress_bar=false",
                   f"hydra.sweep.dir={tmp_path / 'own'}/lr${{optim.lr}}",
                   "hydra.sweep.subdir=."], cwd=tmp_path)
    assert own.returncode == 0, own.stderr[-2000:]
    assert (tmp_path / "own" / "lr0.2" / "summary.json").is_file()

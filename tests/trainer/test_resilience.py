"""Killed, preempted, restarted, resized and poisoned runs, with real processes."""
from __future__ import annotations

import json
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from scripts.processes import descendants
from tests.helpers import (ROOT, bounded, kill_tree, made_once, read_metrics, started,
                           with_stacks)
from trainer import checkpoint

pytestmark = pytest.mark.slow
# 16 batches of 32 per epoch, 3 epochs; a little CPU per sample so a run takes a few seconds
JOB = ["trainer.progress_bar=false", "data=synthetic", "data.dataset.num_samples=512",
       "data.input_shape=[1,8,8]", "data.dataset.cost_ms=0.5", "data.batch_size=32",
       "data.num_workers=0", "model=mlp", "trainer.max_epochs=3", "trainer.log_every_n_steps=1"]


def env():
    e = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "STOKER_"))}
    e.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",  # (this environment activated:
             PATH=os.pathsep.join([os.path.dirname(sys.executable),  # resume lines say
                                   e.get("PATH", "")]))  # `python`, `torchrun`)
    return e


def launcher(nproc: int = 1, torchrun_args=()):
    """`python train.py`, or torchrun's, without arguments."""
    cmd = [sys.executable]
    if nproc > 1 or torchrun_args:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                *torchrun_args]
    return cmd + [str(ROOT / "train.py")]


def command(run_dir: Path, extra=(), nproc: int = 1, torchrun_args=()):
    return launcher(nproc, torchrun_args) + [f"hydra.run.dir={run_dir}", *JOB, *extra]


def resume_line(overrides, run_dir: Path) -> str:
    """The overrides a stopped run names to resume it: its own, then where to resume."""
    return " ".join(shlex.quote(a) for a in [*overrides, "trainer.resume=auto",
                                             f"hydra.run.dir={run_dir}"])


def run(cmd, timeout=240):
    return bounded(cmd, ROOT, env(), timeout)


def newest_step(run_dir: Path, pattern="step-*.pt") -> int:
    files = sorted((run_dir / "checkpoints").glob(pattern)) if (run_dir / "checkpoints").is_dir() else []
    return int(files[-1].stem.split("-")[1]) if files else 0


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


def start_and_wait(cmd, until, timeout=120):
    """The run started in a session of its own, once `until()` holds (the point a test stops
    it at); a run that ended first, or did not get there in `timeout` s, fails the test with
    its output (killed first, tree and all)."""
    # (SIGHUP as in a terminal's run, also where the suite itself runs under nohup, which the
    # run would inherit: it would train on through the test's SIGHUP)
    proc = started(cmd, ROOT, with_stacks(env()), merged=True, default_signals=[signal.SIGHUP])
    deadline = time.monotonic() + timeout
    while not until():
        ended = proc.poll() is not None
        if ended or time.monotonic() > deadline:
            kill_tree(proc)  # (what is left of it: its pipe's other holders among them)
            out, _ = proc.communicate(timeout=30)
            raise AssertionError(("ended (exit %d)" % proc.returncode if ended else
                                  f"not there after {timeout} s") + " before the point the "
                                 f"test stops it at: {' '.join(cmd)}\n{out[-3000:]}")
        time.sleep(0.01)
    return proc


def uninterrupted(suite_dir: Path, nproc: int) -> Path:
    """The run dir of JOB run through on `nproc` processes, which the runs stopped and resumed
    here must match bit for bit (whatever their checkpoint cadence or loader workers): made
    once for the suite, shared by the tests (to read)."""
    def make(run_dir: Path) -> None:
        ref = run(command(run_dir, nproc=nproc))
        assert ref.returncode == 0, ref.stderr[-3000:]

    return made_once(suite_dir, f"resilience-uninterrupted-{nproc}", make)


def weights(run_dir: Path):
    return checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]


def assert_bitwise_equal(a, b, context=""):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs {context}"


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigkill_then_resume_is_bit_exact(tmp_path, suite_dir, nproc):
    extra = ["trainer.checkpoint.every_n_steps=4"]
    ref = uninterrupted(suite_dir, nproc)
    total = 48 // nproc if nproc > 1 else 48  # 2 ranks: 8 batches of 32 each per epoch
    kill_at = random.Random().randint(5, total - 6)
    run_dir = tmp_path / "killed"
    proc = start_and_wait(command(run_dir, extra, nproc),
                          until=lambda: logged_step(run_dir) >= kill_at)
    assert proc.poll() is None, f"finished before the kill at step {kill_at}"
    kill_tree(proc)  # torchrun and its ranks, each in a session of its own
    killed_after = newest_step(run_dir)
    resumed = run(command(run_dir, [*extra, "trainer.resume=auto"], nproc))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert_bitwise_equal(weights(run_dir), weights(ref),
                         f"(killed at step ~{kill_at}, newest checkpoint {killed_after})")
    # the steps the killed attempt logged past its checkpoint were trained again: one row each
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ref_rows = (ref / "metrics.jsonl").read_text().splitlines()
    assert [(r["split"], r["step"]) for r in rows] == [
        (r["split"], r["step"]) for r in map(json.loads, ref_rows)]


def test_three_ranks_resume_bit_exact_with_trainer_deterministic(tmp_path):
    """Over 3 ranks the gradients' sums depend on DDP's bucket layout, which is another on a
    process's first step: a resumed run drifted from the uninterrupted one in the last bits
    (1e-8) from its first step on. trainer.deterministic=true sums each parameter alone."""
    extra = ["trainer.checkpoint.every_n_steps=1", "trainer.deterministic=true",
             "trainer.max_epochs=2"]  # (6 batches of 32 a rank an epoch)
    ref = run(command(tmp_path / "ref", extra, 3))
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir = tmp_path / "killed"
    proc = start_and_wait(command(run_dir, extra, 3), until=lambda: newest_step(run_dir) >= 4)
    kill_tree(proc)
    resumed = run(command(run_dir, [*extra, "trainer.resume=auto"], 3))
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert_bitwise_equal(weights(run_dir), weights(tmp_path / "ref"))


def children(pid: int):
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_sigterm_checkpoints_exits_75_and_torchrun_restart_resumes(tmp_path, suite_dir):
    run_dir = tmp_path / "preempted"
    proc = start_and_wait(command(run_dir, nproc=2, torchrun_args=["--max-restarts=1"]),
                          until=lambda: logged_step(run_dir) >= 10)
    for worker in children(proc.pid):
        os.kill(worker, signal.SIGTERM)  # what a scheduler's preemption sends the ranks
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    assert "stopped on a preemption signal" in out
    assert "torchrun restart 1: resuming" in out and "resumed from" in out
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert_bitwise_equal(weights(run_dir), weights(uninterrupted(suite_dir, 2)),
                         "after preemption")


def preempted(run_dir: Path, extra, at_step: int):
    """A one-process run sent SIGTERM once it logged `at_step`: its output and status.json,
    after checking it exited 75 and says it was preempted."""
    proc = start_and_wait(command(run_dir, extra),
                          until=lambda: logged_step(run_dir) >= at_step)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out[-2000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "preempted" and status["exit_code"] == 75
    return out, status


def test_sigterm_single_process_exit_code_and_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    out, status = preempted(run_dir, ["trainer.accumulate_grad_batches=2"], at_step=7)
    resume = resume_line([*JOB, "trainer.accumulate_grad_batches=2"], run_dir)
    assert status["resume"] == resume  # the launch's own overrides, then where to resume
    assert f"resume with python {ROOT / 'train.py'} {resume}\n" in out
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert state["step"] >= 7 and state["step"] == logged_step(run_dir)
    assert "failed at step" not in (run_dir / "train.log").read_text()  # (no failure)
    # saved on an optimizer-step boundary: whole windows of 2 batches of 32
    assert state["position"] % 64 == 0


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_signal_while_the_run_is_built_stops_it_before_its_first_step(tmp_path, nproc):
    """A SIGTERM while the datasets were built (minutes for a large listing or cache) was
    noted, the build went on, and the run then trained a step and saved it: past a
    scheduler's grace period, for nothing. It stops before the first step now, every rank,
    nothing saved."""
    run_dir, marker = tmp_path / "run", tmp_path / "building"
    proc = start_and_wait(
        launcher(nproc) + [f"hydra.run.dir={run_dir}", "trainer.progress_bar=false",
                           "data.dataset._target_=tests.helpers.SlowToBuildDigits",
                           f"+data.dataset.marker={marker}", "+data.dataset.seconds=3"],
        until=marker.exists)
    os.killpg(proc.pid, signal.SIGTERM)  # (a scheduler's: every process of the job)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == (75 if nproc == 1 else 1), out[-3000:]
    lines = [ln for ln in out.splitlines() if "before the first step" in ln]
    assert len(lines) == 1 and lines[0].endswith(
        "stopped on a preemption signal before the first step: nothing trained, nothing "
        "saved; the same command starts it again"), out[-3000:]
    assert not (run_dir / "checkpoints").exists()
    # as it says (the dir's status.json, of a run that left no result, refused it)
    again = run(proc.args)
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_preempted_run_without_checkpoints_names_no_resume(tmp_path):
    run_dir = tmp_path / "run"
    out, status = preempted(run_dir, ["trainer.save_checkpoint=false"], at_step=3)
    assert "; no checkpoint saved (trainer.save_checkpoint=false)" in out
    assert "resume with" not in out and not (run_dir / "checkpoints").exists()
    assert "resume" not in status


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_checkpoints_exits_130_and_resumes_bit_exact(tmp_path, suite_dir, nproc):
    """A Ctrl-C reaches every process of the terminal's group (torchrun, its ranks, their
    loader workers): the run stops at a step boundary with a checkpoint, like a preemption,
    exits 130 and names the overrides that resume it; the workers do not die first."""
    run_dir = tmp_path / "run"
    proc = start_and_wait(command(run_dir, ["data.num_workers=1"], nproc=nproc),
                          until=lambda: logged_step(run_dir) >= 10)
    os.killpg(proc.pid, signal.SIGINT)  # what a Ctrl-C in a terminal sends
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == (130 if nproc == 1 else 1), out[-3000:]  # torchrun: 1 for any
    assert "KeyboardInterrupt" not in out and ("Traceback" not in out or nproc > 1)
    lines = [ln for ln in out.splitlines() if "stopped on a Ctrl-C" in ln]
    assert len(lines) == 1, out[-3000:]  # rank 0's only
    status = json.loads((run_dir / "status.json").read_text())
    launch = "python" if nproc == 1 else f"torchrun --standalone --nproc_per_node={nproc}"
    assert lines[0].endswith(f"resume with {launch} {ROOT / 'train.py'} {status['resume']}")
    assert status["status"] == "interrupted" and status["exit_code"] == 130
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert state["step"] >= 10
    # resumed with the printed overrides alone, as a user pastes them
    resumed = run(launcher(nproc) + shlex.split(status["resume"]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_bitwise_equal(weights(run_dir), weights(uninterrupted(suite_dir, nproc)),
                         "after a Ctrl-C")


def test_a_run_started_with_nohup_trains_on_through_a_sighup(tmp_path):
    """nohup ignores SIGHUP so that a closed terminal changes nothing: a preemption there
    would stop the very run it was to keep."""
    run_dir = tmp_path / "run"
    proc = start_and_wait(["nohup", *command(run_dir, ["data.num_workers=1",
                                                       "trainer.max_epochs=3"])],
                          until=lambda: logged_step(run_dir) >= 5)
    os.killpg(proc.pid, signal.SIGHUP)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "preemption" not in out
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_to_the_whole_process_group_reaches_the_loader_workers_too_and_still_saves(
        tmp_path, sig):
    """SLURM cancelling a job (or `kill -- -PGID`) sends SIGTERM to every process, the loader
    workers included: they let it pass, so the run ends its step, saves and exits 75 as on
    a SIGTERM to it alone (torch's worker handler ended them, and the step failed on it). A
    closed terminal's SIGHUP is a preemption too (the run died at once, unsaved)."""
    run_dir = tmp_path / "run"
    proc = start_and_wait(command(run_dir, ["data.num_workers=2", "trainer.max_epochs=50"]),
                          until=lambda: logged_step(run_dir) >= 5)
    os.killpg(proc.pid, sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-3000:]
    assert "stopped on a preemption signal" in out and "killed by signal" not in out
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"


def test_sigterm_to_every_process_of_a_torchrun_job_still_saves(tmp_path):
    """SLURM's scancel signals every process of a job step itself: torchrun, its rank and
    the rank's loader workers. A worker then had two SIGTERMs, the sender's and torchrun's
    copy to its rank's group, ended on the second, and the step failed on it: the
    preemption checkpoint was lost (one run in two). Copies that close together are one."""
    run_dir = tmp_path / "run"
    proc = start_and_wait(command(run_dir, ["data.num_workers=2", "trainer.max_epochs=50"],
                                  torchrun_args=["--nnodes=1"]),
                          until=lambda: logged_step(run_dir) >= 5)
    # the deepest first (the workers, then the rank, then torchrun), as one sender's loop
    for pid in [*reversed(descendants(proc.pid)), proc.pid]:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    out, _ = proc.communicate(timeout=120)
    assert "stopped on a preemption signal" in out and "killed by signal" not in out, \
        out[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["step"] >= 5


def test_a_sweep_stopped_by_ctrl_c_names_how_to_continue_the_whole_sweep(tmp_path):
    """Ctrl-C in job 0 of a sweep: the line names the job's resume and the sweep's, whose
    overrides (as typed) continue it: job 0 from its checkpoint, job 1 from the start."""
    sweep = tmp_path / "sweep"
    proc = start_and_wait(launcher() + ["-m", "optim.lr=1e-3,2e-3", f"hydra.sweep.dir={sweep}",
                                        *JOB, "trainer.max_epochs=12"],
                          until=lambda: logged_step(sweep / "0") >= 10)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    status = json.loads((sweep / "0" / "status.json").read_text())
    assert status["resume_sweep"].startswith("-m optim.lr=1e-3,2e-3 ")
    assert status["resume_sweep"].endswith(f"trainer.resume=auto hydra.sweep.dir={sweep}")
    assert f"; or the whole sweep with {status['resume_sweep']}" in out
    assert not (sweep / "1").exists()
    resumed = run(launcher() + shlex.split(status["resume_sweep"]))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and resumed.stdout.count("done:") == 2
    for job in ("0", "1"):
        assert json.loads((sweep / job / "status.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_stops_at_once_in_one_line_and_keeps_the_checkpoints(tmp_path, sig):
    """A step that does not end (a sample read that hangs, in the main process: no
    data.timeout applies): the first Ctrl-C or SIGTERM waits for the step boundary, a second
    one a moment later stops the run at once: one line, exit 130 (Ctrl-C) or 143 (SIGTERM),
    the checkpoints already written untouched."""
    run_dir = tmp_path / "run"
    proc = start_and_wait([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}",
                           "trainer.progress_bar=false", "trainer.log_every_n_steps=1",
                           "data.dataset._target_=tests.helpers.StallingDigits",
                           "+data.dataset.how=sleep", "+data.dataset.at=700",
                           "data.num_workers=0", "trainer.checkpoint.every_n_steps=5"],
                          until=lambda: logged_step(run_dir) >= 10)
    time.sleep(1.0)  # (the read at sample 700 hangs in step 10 or 11)
    before = {p.name: p.read_bytes() for p in (run_dir / "checkpoints").glob("*.pt")}
    proc.send_signal(sig)
    time.sleep(1.5)
    assert proc.poll() is None  # still waiting for the step to end
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert "Traceback" not in out
    status = json.loads((run_dir / "status.json").read_text())
    if sig == signal.SIGINT:
        assert proc.returncode == 130, out[-3000:]
        assert "Ctrl-C again to stop at once" in out and out.strip().endswith("stoker: interrupted")
    else:
        assert proc.returncode == 143, out[-3000:]
        assert out.strip().endswith(
            "stoker: stopped at once on a second SIGTERM, without a checkpoint (before the "
            "step, or the validation after it, ended; the checkpoints written stay)")
        assert status["status"] == "stopped at once"
    assert status["exit_code"] == proc.returncode
    assert {p.name: p.read_bytes() for p in (run_dir / "checkpoints").glob("*.pt")} == before


def test_resume_with_another_world_size(tmp_path):
    run_dir = tmp_path / "run"
    extra = ["sched=constant", "trainer.checkpoint.every_n_steps=5"]
    first = run(command(run_dir, [*extra, "trainer.max_steps=5"], nproc=2))
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["position"] == 5 * 32 * 2
    second = run(command(run_dir, [*extra, "trainer.max_steps=12", "trainer.resume=auto"]))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "written by 2 ranks, this job has 1" in second.stdout
    assert "320 samples into the epoch" in second.stdout
    # a run limited by max_steps: its schedule spans those steps whatever the world size
    assert "the lr schedule moves" not in second.stdout
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == 12 and state["world_size"] == 1
    # the 192 unseen samples of epoch 0 took 6 steps (5 + 6 = 11), step 12 began epoch 1
    assert state["epoch"] == 1 and state["position"] == 32


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    run_dir = tmp_path / "run"
    extra = ["sched=constant", "trainer.checkpoint.every_n_steps=4", "trainer.max_steps=8"]
    assert run(command(run_dir, extra)).returncode == 0
    folder = run_dir / "checkpoints"
    (folder / "step-00000008.pt").write_bytes(b"\0" * 100)  # last.pt is the same inode
    proc = run(command(run_dir, ["sched=constant", "trainer.max_steps=10",
                                 "trainer.resume=auto"]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step-00000004.pt" in proc.stdout and "resumed from" in proc.stdout
    assert "the previous checkpoint was used" in proc.stdout + proc.stderr


def test_non_finite_loss_stops_with_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = run(command(run_dir, ["model._target_=tests.helpers.NaNAfterMLP",
                                 "+model.nan_after=10", "trainer.checkpoint.every_n_steps=4",
                                 "trainer.max_bad_steps=3"]))
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("stoker: error:")]
    assert len(lines) == 1 and "not finite for 3 optimizer steps" in lines[0]
    assert "; stopped (" in lines[0]  # (what the data holds, or what else it may be)
    assert lines[0].endswith(f"); the last good checkpoint is {run_dir}/checkpoints/last.pt")
    assert newest_step(run_dir) == 8  # steps 11.. were NaN: step 12 was not saved
    state = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert state["step"] == 8
    assert all(torch.isfinite(v).all() for v in state["model"].values())


@pytest.mark.parametrize("when", ["periodic", "final"])
def test_a_second_signal_during_a_checkpoint_write_lets_it_finish(make_cfg, tmp_path,
                                                                    monkeypatch, when):
    """A periodic save (or the final one) under way when SIGTERM came, and again a moment
    later: the second was taken for a step that never ends and stopped the run at once, the
    write lost ("the step did not end"; the run's only checkpoint, for the final save). The
    step has ended: the write finishes, and the run stops after it (a periodic save) or
    completes (the final one)."""
    from trainer import checkpoint as ckpt
    from trainer.resilience import Preempted
    from trainer.runner import train

    at = 10 if when == "periodic" else 22  # (22: not a periodic save's step)
    save = ckpt.save

    def signalled_twice(state, path):
        if state["step"] == at:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.3)  # (past the second that tells a second signal from one repeated)
            os.kill(os.getpid(), signal.SIGTERM)
        save(state, path)

    monkeypatch.setattr(ckpt, "save", signalled_twice)
    cfg = make_cfg("trainer.max_steps=22", "trainer.checkpoint.every_n_steps=5",
                   "trainer.checkpoint.every_n_epochs=0", "trainer.progress_bar=false",
                   "trainer.checkpoint.async_save=false", run_dir=tmp_path / "run")
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    if when == "periodic":
        with pytest.raises(Preempted, match="^stopped on a preemption signal at step 10;"):
            train(cfg)
    else:
        assert train(cfg)["steps"] == 22
    assert checkpoint.load(last)["step"] == at


@pytest.mark.gpu
def test_cuda_random_state_is_the_ranks_own_gpus_and_old_checkpoints_still_restore():
    """A rank saves the generators of the GPUs it computes on, in order, and restores them
    onto its own, whatever other GPUs the resumed job sees; a checkpoint of an earlier
    version (every visible GPU's state, by index) restores the rank's device from its index."""
    from trainer.resilience import rng_state, set_rng_state
    gpu = torch.device("cuda", 0)
    saved = rng_state(None, [gpu])
    assert len(saved["cuda_used"]) == 1 and "cuda" not in saved
    expected = torch.rand(4, device=gpu)
    set_rng_state(saved, None, [gpu])
    assert torch.equal(torch.rand(4, device=gpu), expected)
    legacy = {k: v for k, v in saved.items() if k != "cuda_used"}
    legacy["cuda"] = torch.cuda.get_rng_state_all()
    expected = torch.rand(4, device=gpu)
    set_rng_state(legacy, None, [gpu])
    assert torch.equal(torch.rand(4, device=gpu), expected)


@pytest.mark.parametrize("saved_on,old_form,restored_on,expected", [
    (["cuda:3"], False, ["cuda:0"], {"cuda:0": "s3"}),  # another GPU set: the rank's own
    (["cuda:0", "cuda:1", "cuda:2", "cuda:3"], False, ["cuda:0", "cuda:1"],  # dp, 4 -> 2
     {"cuda:0": "s0", "cuda:1": "s1"}),
    ([f"cuda:{i}" for i in range(8)], True, ["cuda:5"], {"cuda:5": "s5"}),  # old form, by index
    (["cuda:0"], True, ["cuda:3"], {}),  # old form without the rank's index: left as seeded
])
def test_cuda_random_states_map_onto_the_gpus_the_resumed_rank_uses(monkeypatch, saved_on,
                                                                    old_form, restored_on,
                                                                    expected):
    """Which saved CUDA generator state goes to which GPU on resume (recorded calls: no GPU
    here). A new checkpoint holds the saving rank's GPUs in order; an earlier version's held
    every visible GPU's, by index."""
    from trainer import resilience
    monkeypatch.setattr(torch.cuda, "get_rng_state",
                        lambda device: f"s{torch.device(device).index}")
    restored = {}
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device: restored.__setitem__(str(device), state))
    state = resilience.rng_state(None, [torch.device(d) for d in saved_on])
    if old_form:
        state["cuda"] = state.pop("cuda_used")
    assert "cuda" in state or state["cuda_used"] == [f"s{d[-1]}" for d in saved_on]
    resilience.set_rng_state(state, None, [torch.device(d) for d in restored_on])
    assert restored == expected


def test_ranks_whose_torchrun_is_killed_save_and_stop(tmp_path):
    """torchrun SIGKILLed (by a scheduler, the OOM killer): its ranks, each in a session of
    its own, are not in its process group; each is sent SIGTERM as its parent dies, saves as
    for a preemption and stops, instead of training on under init."""
    run_dir = tmp_path / "run"
    proc = start_and_wait(command(run_dir, ["trainer.max_epochs=1000"], nproc=2),
                          until=lambda: logged_step(run_dir) >= 3)
    assert proc.poll() is None, proc.stdout.read()[-2000:]
    ranks = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # torchrun alone
    proc.wait()
    deadline = time.monotonic() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    for pid in alive:  # (no test leaves them behind)
        os.kill(pid, signal.SIGKILL)
    assert not alive, "ranks trained on after torchrun was killed"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["exit_code"] == 75 and newest_step(run_dir) > 0, status


def test_a_refused_save_with_no_checkpoint_before_it_says_so(make_cfg, caplog):
    """trainer.max_bad_steps=0 trains on through non-finite losses; a save they refuse does
    not speak of a last good checkpoint the run never wrote."""
    import logging

    from trainer.runner import train

    with caplog.at_level(logging.WARNING, logger="stoker"):
        try:
            train(make_cfg("model._target_=tests.helpers.NaNAfterMLP", "+model.nan_after=0",
                           "trainer.max_bad_steps=0", "trainer.max_steps=3"))
        except Exception:  # noqa: BLE001  (how the run ends is another test's)
            pass
    said = [r.getMessage() for r in caplog.records if "not saving a checkpoint" in r.getMessage()]
    assert said and all(s.endswith("no checkpoint was saved before it") for s in said), said


def test_the_last_validation_after_the_last_epoch_is_ranked_for_best_pt(make_cfg, tmp_path,
                                                                         monkeypatch):
    """max_steps inside an epoch: the run's last validation comes after the last epoch's
    callbacks, and best.pt takes it where it is better; so does another run's complete
    checkpoint validated again in a new dir (it had no best.pt there)."""
    from tests.helpers import Scripted
    from trainer.runner import train

    args = ("+task.metrics.score._target_=tests.helpers.Scripted", "trainer.checkpoint.mode=min",
            "trainer.checkpoint.monitor=val_score")
    monkeypatch.setattr(Scripted, "values", [0.5, 0.3])
    first = train(make_cfg("trainer.max_steps=30", *args))  # validated at 23, then at 30
    assert first["best"] == {"monitor": "val_score", "value": pytest.approx(0.3), "step": 30}
    assert torch.load(tmp_path / "run" / "checkpoints" / "best.pt",
                      weights_only=True)["step"] == 30
    monkeypatch.setattr(Scripted, "values", [0.4])
    again = train(make_cfg("trainer.max_steps=30", *args,
                           f"trainer.resume={first['checkpoint']}", run_dir=tmp_path / "again"))
    assert again["best"] == {"monitor": "val_score", "value": pytest.approx(0.4), "step": 30}
    assert (tmp_path / "again" / "checkpoints" / "best.pt").is_file()


def test_a_ctrl_c_during_an_epochs_validation_stops_at_that_epochs_end(make_cfg, tmp_path):
    """The signal came after the epoch's last step (in its validation or its callbacks): the
    run stopped a step into the next epoch, an extra step of waiting past the signal."""
    from trainer.loop import Callback
    from trainer.resilience import Preempted
    from trainer.runner import train

    class CtrlCAtEpochEnd(Callback):
        def after_epoch(self, loop, val):
            self.step = loop.state.step
            os.kill(os.getpid(), signal.SIGINT)

    at = CtrlCAtEpochEnd()
    with pytest.raises(Preempted, match=r"^stopped on a Ctrl-C at step (\d+);") as e:
        train(make_cfg("trainer.max_epochs=3", "trainer.progress_bar=false",
                       run_dir=tmp_path / "run"), callbacks=[at])
    assert f"at step {at.step};" in str(e.value)
    assert checkpoint.load(tmp_path / "run" / "checkpoints" / "last.pt")["step"] == at.step


def test_a_signal_during_a_validation_under_ddp_stops_it_and_the_resume_takes_it_first(
        tmp_path):
    """A signal during an epoch's validation let the validation run to its end: a long one
    outlived a scheduler's grace period (SLURM's 30 s) and the epoch's checkpoint went with
    it, and a second signal stopped it at once, unsaved. Each rank now stops at its next
    batch and the ranks agree at the validation's sums (rank 1 alone is signalled here: rank
    0 reads its whole shard and learns of it there), every one saves the epoch's trained
    state, and the resumed run validates first: the rows and weights of a run never
    stopped."""
    run_dir, whole = tmp_path / "run", tmp_path / "whole"
    common = ["trainer.progress_bar=false", "data.placement=host", "data.num_workers=0",
              "data.dataset._target_=tests.helpers.SignalsInValidation", "trainer.max_epochs=3"]
    proc = run(launcher(2) + [f"hydra.run.dir={run_dir}", *common])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "exitcode  : 75" in proc.stderr, out[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "preempted"
    saved = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    step = saved["step"]
    assert (saved["epoch"], saved["validated_step"]) == (0, -1) and saved["position"] > 0
    assert f"validation at step {step} stopped by the signal" in out, out[-3000:]
    assert f"stopped on a preemption signal at step {step};" in out
    assert not [r for r in read_metrics(run_dir) if r.get("split") == "val"]
    resumed = run(launcher(2) + [f"hydra.run.dir={run_dir}", *common, "+data.dataset.at=99",
                                 "trainer.resume=auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at epoch 0 step {step} (at the epoch's end)" in resumed.stdout + resumed.stderr
    proc = run(launcher(2) + [f"hydra.run.dir={whole}", *common, "+data.dataset.at=99"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[{k: v for k, v in r.items() if k != "time"} for r in read_metrics(d)
             if r.get("split") == "val"] for d in (run_dir, whole)]
    assert len(rows[1]) == 3 and rows[0] == rows[1]
    assert rows[1][0]["step"] == step
    weights = [checkpoint.load(d / "checkpoints" / "last.pt")["model"] for d in (run_dir, whole)]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[1])


def test_a_signal_during_the_last_epochs_validation_lets_the_run_complete(make_cfg, tmp_path):
    """Stopped there as preempted, the run's resume found nothing to train and left it
    "preempted" for ever, with no summary.json (a sweep's table showed the job without its
    values): the run is validated at its end, so it completes."""
    from trainer.loop import Callback
    from trainer.runner import train

    class SigtermAtTheEnd(Callback):  # (before the checkpointing's own after_epoch)
        def after_epoch(self, loop, val):
            if loop.state.epoch == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    run_dir = tmp_path / "run"
    summary = train(make_cfg("trainer.max_epochs=2", "trainer.progress_bar=false",
                             run_dir=run_dir), callbacks=[SigtermAtTheEnd()])
    assert summary["epochs"] == 2 and "val_loss" in summary
    assert json.loads((run_dir / "summary.json").read_text())["epochs"] == 2
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["epoch"] == 2


@pytest.mark.parametrize("async_save", ["true", "false"])
def test_a_failed_validation_whose_save_fails_too_says_both(make_cfg, tmp_path, caplog,
                                                            monkeypatch, async_save):
    """The save after a failed validation met a full disk: its error was swallowed (and with
    an asynchronous write taken from the writer, so the run's last warning about it went
    too); the validation's error is said last, the save's before it."""
    import errno

    from trainer import checkpoint as ckpt
    from trainer.runner import train

    def full(state, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(ckpt, "save", full)
    with pytest.raises(ValueError, match="bad validation sample 300"):
        train(make_cfg("data.dataset._target_=tests.helpers.FailingValDigits",
                       "data.placement=host", "trainer.max_epochs=2",
                       f"trainer.checkpoint.async_save={async_save}"))
    said = [r.getMessage() for r in caplog.records if "saving the trained state failed too"
            in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("validation failed after step 23, and saving "
                                                 "the trained state failed too: ") \
        and "No space left on device" in said[0], said


def test_a_failed_validation_keeps_the_epoch_it_followed(make_cfg, tmp_path, caplog):
    """A validation sample that raised (past the sanity check's batch) lost the epoch's
    training: the epoch-end save comes after the validation. The trained state is saved first,
    and trainer.resume=auto goes on from it once the data is mended."""
    from trainer.runner import train

    bad = ["data.dataset._target_=tests.helpers.FailingValDigits", "data.placement=host",
           "trainer.max_epochs=2"]
    with pytest.raises(ValueError, match="bad validation sample 300"):
        train(make_cfg(*bad))
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    saved = torch.load(last, weights_only=True)
    assert (saved["step"], saved["epoch"], saved["position"]) == (23, 1, 0)
    assert any(r.getMessage().startswith("validation failed after step 23: the trained state "
                                         f"is saved in {last} (trainer.resume=auto continues")
               for r in caplog.records)
    mended = train(make_cfg("data.placement=host", "trainer.max_epochs=2",
                            "trainer.resume=auto"))
    assert mended["steps"] == 46 and mended["checkpoint"] == str(last)

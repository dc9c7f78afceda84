"""train.py launched as users launch it: torchrun (one node and the multi-node form), srun-style
SLURM variables, sweeps, and a failing rank. Real processes, gloo on CPU."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import (QUIET, ROOT, TORCHRUN, compose_cfg, free_port, slurm_tasks,
                           summary_of, torchrun)
from trainer.runner import train

pytestmark = pytest.mark.slow


def test_ddp_two_ranks_match_one_process_and_share_one_run_dir(tmp_path):
    proc = torchrun(2, ["data.batch_size=16", "trainer.max_steps=20"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 1, runs  # both ranks, one timestamped dir
    run = runs[0]
    assert {p.name for p in run.iterdir()} == {
        ".hydra", "config.yaml", "train.log", "metrics.jsonl", "summary.json", "status.json",
        "tensorboard", "checkpoints"}  # and no .stoker.lock: released at the end
    assert proc.stdout.count("global batch 32 = per-rank batch 16 x accumulation 1 x "
                             "world size 2") == 1  # rank 1 says nothing at INFO
    assert "[rank 1]" not in (run / "train.log").read_text()
    said = proc.stdout + proc.stderr  # a warning of the settings, which every rank shares
    assert said.count("sched.warmup_steps=20 is not fewer than the run's 20 optimizer") == 1
    s = summary_of(run)
    assert s["world_size"] == 2 and s["strategy"] == "ddp" and s["steps"] == 20
    ddp = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
    single = train(compose_cfg(tmp_path / "single", "data.batch_size=32",
                               "trainer.max_steps=20"))
    ref = torch.load(single["checkpoint"], weights_only=True)["model"]
    for k in ref:
        torch.testing.assert_close(ddp[k], ref[k], rtol=1e-4, atol=1e-5)


def test_two_ranks_over_an_odd_training_set_match_one_process(tmp_path):
    """1437 samples on 2 ranks: the sampler pads each epoch to 1438 with a repeat, which the
    last step counted twice (a tester saw parameters 0.007 apart from one process's). Each
    rank's last batch keeps a sample of its own without it, so it is left out, and two ranks
    of 16 take one process's steps of 32 over the same samples."""
    common = ["data.dataset._target_=tests.helpers.OddDigits", "trainer.max_epochs=2",
              "sched=constant"]
    run = tmp_path / "ddp"
    proc = torchrun(2, [*common, "data.batch_size=16", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train set: 1437 samples" in (run / "train.log").read_text()
    assert "repeated" not in (run / "train.log").read_text()
    single = train(compose_cfg(tmp_path / "single", *common, "data.batch_size=32"))
    assert summary_of(run)["steps"] == single["steps"] == 90
    ddp = torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]
    ref = torch.load(single["checkpoint"], weights_only=True)["model"]
    for k in ref:
        torch.testing.assert_close(ddp[k], ref[k], rtol=1e-4, atol=1e-5)


def test_validation_is_exact_over_an_uneven_split(tmp_path):
    """359 validation samples over 3 ranks (120, 120, 119): no padded duplicates counted."""
    single = train(compose_cfg(tmp_path / "single", "trainer.max_epochs=1"))
    run = tmp_path / "ddp3"
    proc = torchrun(3, [f"hydra.run.dir={run}", "trainer.max_epochs=1",
                        f"trainer.resume={single['checkpoint']}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary_of(run)
    assert s["world_size"] == 3
    assert s["val_acc"] == single["val_acc"]
    # training's sampler pads 1438 samples to 3 x 480; ranks 1 and 2 leave their repeat out
    # of their last batch (479 = 7 x 64 + 31 samples of their own): nothing repeated to say
    log = (run / "train.log").read_text()
    assert "train set: 1438 samples" in log and "repeated" not in log
    assert s["val_loss"] == pytest.approx(single["val_loss"], rel=1e-6)


def test_a_failing_rank_ends_the_job_quickly_with_its_error(tmp_path):
    start = time.monotonic()
    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.ddp.timeout_s=60",
                        "data.dataset._target_=tests.helpers.FailingOnRankDigits",
                        "+data.dataset.fail_index=100"], cwd=ROOT, timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    assert "injected failure on rank 1" in proc.stderr
    # rank 1's crash reaches rank 0's record and log, not only the console
    error = json.loads((tmp_path / "run" / "status.json").read_text())["error"]
    assert error.startswith("rank 0 lost a peer in a collective at step ") and \
        ": rank 1's process ended, on its error: RuntimeError: injected failure on rank 1" \
        in error, error
    last = (tmp_path / "run" / "train.log").read_text().splitlines()[-1]
    assert "[ERROR] failed at step " in last and last.endswith(error), last


def test_ranks_with_datasets_of_different_lengths_are_refused_in_one_line(tmp_path):
    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "data.num_workers=0",
                        "data.dataset._target_=tests.helpers.RankSizedDigits"], cwd=ROOT,
                    timeout=120)
    assert proc.returncode != 0 and "Fatal Python error" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert lines == ["stoker: error: data: the ranks built training sets of different lengths "
                     "(1338 to 1438 samples); every rank must build the same dataset (one that "
                     "reads RANK, or files that differ between nodes?)"]


@pytest.mark.parametrize("overrides, differ", [
    # rank 1 took other batches (gloo aborted it on the mismatched collective: SIGABRT)
    (["data.batch_size=1${oc.env:RANK}", "seed=${oc.env:RANK}"],
     "seed (0 to 1), data.batch_size (10 to 11)"),
    # replicas that drift apart, exit 0: another lr, warm-up, layer width, held-out split
    (["optim.lr='${oc.decode:0.00${oc.env:RANK}1}'", "sched.warmup_steps=${oc.env:RANK}",
      "model.hidden=[64,'${oc.decode:6${oc.env:RANK}}']",
      "data.dataset.split_seed='${oc.decode:${oc.env:RANK}}'"],
     "model.hidden.1 (60 to 61), optim.lr (0.0001 to 0.0011), sched.warmup_steps, "
     "data.dataset.split_seed (0 to 1)"),
    # each rank its own dir: a resume read other checkpoints on each (gloo aborted rank 0)
    (["hydra.run.dir=${hydra:runtime.cwd}/run_${oc.env:RANK}"], None),
    # one rank validates init_from's weights, the other trains from them (gloo aborted
    # rank 0 in the data placement's all-reduce), with DDP's buckets laid out otherwise
    (["trainer.init_from=${hydra:runtime.cwd}/weights.pt",
      "trainer.validate_only='${oc.decode:${oc.env:RANK}}'",
      "trainer.deterministic='${oc.decode:${oc.env:RANK}}'"],
     "trainer.validate_only, trainer.deterministic"),
])
def test_ranks_with_different_settings_are_refused_in_one_line(tmp_path, overrides, differ):
    """An override that reads the rank's environment."""
    torch.save({}, tmp_path / "weights.pt")  # (read after the settings agree: none here)
    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "data.num_workers=0",
                        "trainer.max_epochs=1", *overrides], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0 and "Fatal Python error" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert lines == [f"stoker: error: the ranks run with different settings: {differ}; every "
                     "rank must have the same ones (an override that reads the rank's "
                     "environment?)" if differ else
                     "stoker: error: the ranks run in different run dirs, and every rank reads "
                     "the run's checkpoints: name one on a filesystem every node shares with "
                     "hydra.run.dir=... (or launch torchrun with --rdzv-id)"]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not list(tmp_path.glob("run_*/checkpoints"))


def test_sweep_runs_each_job_as_a_ddp_job_with_its_own_dir(tmp_path):
    proc = torchrun(2, ["optim.lr=0.001,0.003", "trainer.max_steps=5"], cwd=tmp_path,
                    multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweeps = list((tmp_path / "multirun").glob("*/*"))
    assert len(sweeps) == 1
    jobs = sorted(p for p in sweeps[0].iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    lrs = [json.loads((j / "config.yaml").read_text().split("lr: ")[1].split()[0])
           for j in jobs]
    assert lrs == [0.001, 0.003]
    assert all(summary_of(j)["world_size"] == 2 and summary_of(j)["steps"] == 5 for j in jobs)
    assert proc.stdout.count("Launching 2 jobs locally") == 1  # Hydra's lines: rank 0's only


def test_multi_node_form_on_one_machine(tmp_path):
    """Two 'nodes' of one process each, joined through the c10d rendezvous."""
    port = free_port()
    cmd = TORCHRUN + ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=stoker-test",
                      str(ROOT / "train.py"), *QUIET, "trainer.max_steps=5"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "STOKER_"))}
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [n.communicate(timeout=180)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    run = tmp_path / "outputs" / "rdzv-stoker-test"  # named by the rendezvous id
    assert summary_of(run)["world_size"] == 2


def test_srun_style_slurm_launch_without_torchrun(tmp_path):
    codes, outs = slurm_tasks(tmp_path, 2, ["trainer.max_steps=5"])
    assert codes == [0, 0], outs
    s = summary_of(tmp_path / "outputs" / "slurm-4242")
    assert s["world_size"] == 2 and s["strategy"] == "ddp"


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (train.py's first lines set it, and the
    one of SIGINT before it): the kernel's mask of caught signals."""
    import signal

    with open(f"/proc/{pid}/status") as status:
        caught = next(ln for ln in status if ln.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def _signalled_while_starting(tmp_path, sig, launches: int, step: float):
    """`launches` launches of train.py, each sent `sig` at a moment of its start-up (once
    train.py's first lines set their handlers, then `step` later each time): (run dir,
    process, stderr, what to show on a failure). (A fixed 0.15 s after the launch came before
    Python's own start-up ended on a loaded machine: nothing of Stoker's had run.)"""
    for n in range(launches):
        delay, run_dir = step * n, tmp_path / str(n)
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"),
                                 f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not _catches_sigterm(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)  # (Python's own start-up is done; importing torch is not)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        yield run_dir, proc, err, f"(sent after {delay:.2f} s) {err[-2000:]}"


def test_a_ctrl_c_while_importing_is_one_line(tmp_path):
    """A Ctrl-C in the seconds torch takes to import was a 30-line traceback; one met inside
    torch's own import of numpy was swallowed there (the run went on, exit 0), and one inside
    an extension's import surfaced as an ImportError. Sent at moments across the start-up,
    each ends the launch with 130 and one line."""
    import signal

    for _, proc, err, said in _signalled_while_starting(tmp_path, signal.SIGINT, 16, 0.03):
        assert proc.returncode == 130 and "Traceback" not in err, said
        assert err.strip().splitlines()[-1] in (
            "stoker: interrupted", "stoker: stopping at the end of this step with a checkpoint "
            "(Ctrl-C again to stop at once, without one)"), said



def test_a_preemption_signal_while_importing_is_a_preemption_before_the_first_step(tmp_path):
    """A SIGTERM in the seconds the imports take ended the process at -15 without a word (a
    rank under torchrun read as a crash); sent at moments across the start-up, each ends the
    launch as a preemption: 75 and its line, nothing written."""
    import signal

    for run_dir, proc, err, said in _signalled_while_starting(tmp_path, signal.SIGTERM, 8, 0.06):
        assert proc.returncode == 75 and "Traceback" not in err, said
        last = err.strip().splitlines()[-1]
        if "before the first step" in last:  # (a machine that imports fast is past it)
            assert last.endswith("stopped on a preemption signal before the first step: "
                                 "nothing trained, nothing saved; the same command starts it "
                                 "again"), said
            assert not (run_dir / "checkpoints").exists()
        else:  # (after the first step: a preemption's own stop, its checkpoint saved)
            assert re.search(r"stopped on a preemption signal at step \d+; checkpoint saved",
                             err), said


def test_a_preemption_signal_at_the_rendezvous_is_a_preemption_before_the_first_step(tmp_path):
    """Between the imports and the run's own handler (Hydra's composition, the ranks'
    rendezvous, which waits for every rank) the start-up handler had been put back: a SIGTERM
    there ended a rank at -15 without a word. A rank 0 whose peer never comes waits there."""
    import signal
    import socket

    from tests.helpers import free_port

    port = free_port()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"),
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # its store is up: the
            try:                                                  # rendezvous has begun
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "stoker: stopped on a preemption signal before the first step: nothing trained, "
        "nothing saved; the same command starts it again"), err[-2000:]

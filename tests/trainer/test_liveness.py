"""Liveness: a stopped or stuck rank or loader worker ends the job within minutes, naming it,
and the exit never hangs on a stopped worker. Real processes; every test is bounded."""
from __future__ import annotations

import re
import time

import pytest

from tests.helpers import ROOT, run_cli, torchrun, torchrun_until

pytestmark = pytest.mark.slow
STALL = "data.dataset._target_=tests.helpers.StallingDigits"


def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    """Rank 1 is stopped (SIGSTOP): rank 0 ends within the timeout with a line naming it.
    (Then the job is killed: torchrun itself would wait 30 s to kill the stopped rank.)"""
    err, took = torchrun_until(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.ddp.timeout_s=10",
                                   STALL, "+data.dataset.rank=1", "+data.dataset.at=200"],
                               cwd=ROOT)
    assert took < 120
    lines = [ln for ln in err if ln.startswith("stoker: error:")]
    assert len(lines) == 1, "\n".join(err[-40:])
    assert "rank 0 waited more than trainer.ddp.timeout_s=10 s in a collective" in lines[0]
    # (a stopped process beats no more: its last beat's step may be seconds behind)
    stopped = re.search(r"rank 1 stopped beating (\d+) s ago \(its process is stopped, cut off, "
                        r"or stuck where its threads cannot run; its last heartbeat, up to 5 s "
                        r"before that, said step \d+, training\); stopped, stuck or gone",
                        lines[0])
    assert stopped and int(stopped.group(1)) >= 5, lines[0]


@pytest.mark.parametrize("how", ["stop", "sleep"])
def test_a_stuck_loader_worker_ends_the_run_and_the_exit_does_not_hang(tmp_path, how):
    start = time.monotonic()
    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", STALL, f"+data.dataset.how={how}",
                    "+data.dataset.at=20", "data.num_workers=1", "data.timeout=5",
                    "data.persistent_workers=false", "trainer.progress_bar=false"], timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - start < 90
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("stoker: error: data: DataLoader timed out after 5.0 seconds "
                           "(data.timeout) waiting for a batch from a loader worker")


def test_non_finite_loss_on_one_rank_at_save_steps_stops_every_rank_alike(tmp_path):
    start = time.monotonic()
    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.ddp.timeout_s=60",
                        "model._target_=tests.helpers.NaNOnRankMLP", "+model.after=3",
                        "trainer.checkpoint.every_n_steps=2", "trainer.max_bad_steps=2",
                        "trainer.log_every_n_steps=2", "trainer.progress_bar=false"],
                    cwd=ROOT, timeout=150)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60  # no rank sat in a collective its peer never entered
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert len(errors) == 1 and re.search(r"the loss was not finite for \d+ optimizer steps in "
                                          r"a row \(up to step \d+, trainer.max_bad_steps=2\)",
                                          errors[0])
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*.pt"))
    assert saved == ["step-00000002.pt"]  # the last good one; none with a NaN loss


def test_a_stuck_rank_0_is_named_by_the_rank_that_waits_for_it(tmp_path):
    """Rank 0 hangs inside a step (its heartbeat thread beats on): rank 1, which cannot rely
    on rank 0 to print, says itself which rank made no progress, and for how long."""
    err, took = torchrun_until(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.ddp.timeout_s=10",
                                   "model._target_=tests.helpers.FaultyMLP", "+model.rank=0",
                                   "+model.at=5"], cwd=ROOT)
    assert took < 120
    lines = [ln for ln in err if ln.startswith("stoker: error:")]
    assert len(lines) == 1, "\n".join(err[-40:])
    assert "rank 1 waited more than trainer.ddp.timeout_s=10 s in a collective" in lines[0]
    stalled = re.search(r"rank 0 made no progress for at least (\d+) s", lines[0])
    # not the heartbeat thread's last beat (0 s): 10 s waited, less a beat's 5 s
    assert stalled and int(stalled.group(1)) >= 5, lines[0]


def test_a_killed_rank_is_named_by_its_peer_in_one_line(tmp_path):
    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.ddp.timeout_s=60",
                        "model._target_=tests.helpers.FaultyMLP", "+model.rank=1",
                        "+model.at=5", "+model.how=kill", "data.num_workers=0",
                        "trainer.progress_bar=false"], cwd=ROOT, timeout=150)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert re.match(r"stoker: error: rank 0 lost a peer in a collective at step \d+ "
                    r"\(training\): rank 1's process ended; its own error, if it had one, "
                    r"is in its output; no checkpoint was saved$", lines[0])
    assert "Traceback" not in proc.stderr.split("stoker: error:")[0]  # (torchrun's own follows)


@pytest.mark.parametrize("ranks,how,where,said", [
    (2, "init", "before the first step", "rank 1 stopped on its error: tests.helpers.FaultyMLP: "
                                         "width 7 is not for rank 1"),
    (2, "refuse", "in a collective at step", "rank 1's process ended, on its error: data: a "
                                             "sample rank 1 cannot use"),
    # rank 1 loses rank 2 too: its own loss is not taken for an error of rank 1's
    (3, "init", "before the first step", "rank 2 stopped on its error: tests.helpers.FaultyMLP: "
                                         "width 7 is not for rank 2")])
def test_a_peers_own_one_line_error_is_said_by_rank_0(tmp_path, ranks, how, where, said):
    """Only rank 0 says a one-line error the ranks all meet: an error of another rank's own,
    in building its model or mid-run, is said by that rank itself, and the survivors' reports
    of the lost peer name it, not a gloo traceback or 'is in its output'; so does status.json.
    (Torchrun ends every rank once one exits: a survivor, rank 0 too, may be ended before it
    says its loss, which is why the rank says its own error.)"""
    import json

    run_dir = tmp_path / "run"
    proc = torchrun(ranks, [f"hydra.run.dir={run_dir}", "trainer.ddp.timeout_s=60",
                            "model._target_=tests.helpers.FaultyMLP", f"+model.rank={ranks - 1}",
                            "+model.at=5", f"+model.how={how}", "data.num_workers=0",
                            "trainer.progress_bar=false"], cwd=ROOT, timeout=150)
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    own = f"stoker: error: rank {ranks - 1}: " + said.split("on its error: ")[1]
    assert own in lines, proc.stderr[-3000:]
    lines.remove(own)
    # a survivor that says its loss (rank 0 may be the one lost) says it once, naming the error
    assert len(lines) <= ranks - 1 and len(set(ln.split(" lost a peer")[0] for ln in lines)) \
        == len(lines), proc.stderr[-3000:]
    assert all(re.match(rf"stoker: error: rank \d lost a peer {where}", ln) and said in ln
               for ln in lines), lines
    assert "Traceback" not in proc.stderr.split("stoker: error:")[0]  # (torchrun's own follows)
    if any(ln.startswith("stoker: error: rank 0 lost a peer") for ln in lines):
        status = json.loads((run_dir / "status.json").read_text())  # (written before the line)
        assert status["status"] == "failed" and said in status["error"], status


def _at_the_writer_barrier(rank: int, port: int, out: str, late: float) -> None:
    """Rank `rank` of two gloo ranks: rank 0 (the writer) comes to the barrier `late` seconds
    after rank 1 when `late` > 0 (after rank 1 said it arrives, whenever that is on a loaded
    machine); rank 1 never comes (a stopped peer) when `late` < 0."""
    import datetime
    import os
    from pathlib import Path

    import torch.distributed as dist

    from trainer import distributed
    from trainer.liveness import from_a_lost_peer, writer_barrier

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    done = Path(out, "rank0")
    if rank == 1 and late == GONE:  # it ends before it comes, rank 0 waiting there
        time.sleep(1)
        os._exit(0)  # (0: mp.spawn would end rank 0 on another code)
    if rank == 1 and late < 0:
        while not done.exists():  # stopped: it never arrives while rank 0 waits
            time.sleep(0.1)
        os._exit(0)
    start = time.monotonic()
    arriving = Path(out, "rank1 arriving")
    if rank == 1 and late > 0:
        arriving.touch()
    if rank == 0 and late > 0:  # the checkpoint write, `late` s from rank 1's arrival on
        while not arriving.exists():
            time.sleep(0.01)
        time.sleep(late)
        start = time.monotonic()
    try:
        writer_barrier(write_s=60, arrive_s=2)
        result = "passed"
    except RuntimeError as e:
        result = f"failed: {e}" + (" [a lost peer]" if from_a_lost_peer(e) else "")
    took = time.monotonic() - start
    Path(out, f"rank{rank}.tmp").write_text(f"{took}\n{result}")
    os.replace(Path(out, f"rank{rank}.tmp"), Path(out, f"rank{rank}"))
    distributed._CPU_GROUP = None
    if rank == 0 and late < 0:
        os._exit(0)  # (a peer that never came: no clean shutdown with it)
    dist.destroy_process_group()


GONE = -99.0  # `late`: rank 1's process ends while rank 0 waits in the barrier


def _barrier(tmp_path, late: float):
    import torch.multiprocessing as mp

    from tests.helpers import free_port

    mp.spawn(_at_the_writer_barrier, args=(free_port(), str(tmp_path), late), nprocs=2)
    took, result = (tmp_path / "rank0").read_text().split("\n", 1)
    return float(took), result


def test_a_peer_gone_during_a_checkpoint_write_is_a_lost_peer_not_a_barrier_timeout(tmp_path):
    """Rank 1's process ended while rank 0 waited for it in the barrier: gloo's barrier fails
    before its time, worded as a timeout ("Ranks 1 failed to pass monitoredBarrier in 2000
    ms"), which reached the console as that traceback; it is a lost peer, which the heartbeat
    then names in one line."""
    took, result = _barrier(tmp_path, late=GONE)
    assert result.endswith(" [a lost peer]"), result
    assert float(took) < 60  # not the write's timeout


def test_the_ranks_wait_for_a_checkpoint_write_longer_than_a_collective(tmp_path):
    """Rank 0 writes for 4 s, twice the time a peer may take to arrive: rank 1 waits it out."""
    _, result = _barrier(tmp_path, late=4)
    assert result == "passed"
    took, result = (tmp_path / "rank1").read_text().split("\n", 1)
    assert result == "passed" and float(took) >= 4


def test_a_peer_that_stops_before_a_checkpoint_write_ends_is_named_without_the_writes_timeout(
        tmp_path):
    """Rank 1 never comes to the barrier: rank 0, its write done, waits the arrival timeout
    (2 s), not the write's (60 s), and the error names rank 1."""
    took, result = _barrier(tmp_path, late=-1)
    assert result.startswith("failed: timed out after trainer.ddp.timeout_s=2 s: ") and \
        "Ranks 1 failed to pass monitoredBarrier" in result, result
    assert took < 60


@pytest.mark.parametrize("write_s, ddp_s", [(60, 6), (3, 60)])
def test_the_ranks_wait_for_rank_0s_write_as_long_as_checkpoint_timeout_s(tmp_path, write_s,
                                                                          ddp_s):
    """Rank 0's write takes 12 s (a slow disk). The others waited for it in a barrier whose
    wait on their side was the host-side group's timeout, trainer.ddp.timeout_s: at 6 s the
    job failed as if rank 0 were gone ("a peer's process ended"), and a
    trainer.checkpoint.timeout_s of 3 s never applied (at 60 s the write was waited for).
    Now trainer.checkpoint.timeout_s=60 waits for it, and 3 stops the waiting rank, naming
    the write and the key."""
    start = time.monotonic()
    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_steps=3",
                        "trainer.checkpoint.async_save=false", f"trainer.ddp.timeout_s={ddp_s}",
                        f"trainer.checkpoint.timeout_s={write_s}"], cwd=ROOT, timeout=150,
                    env={"STOKER_TEST_SLOW_WRITE_S": "12"})
    if write_s == 60:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert time.monotonic() - start > 12  # (the write was slow indeed)
        return
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert any("rank 1 waited more than trainer.checkpoint.timeout_s=3 s for rank 0's "
               "checkpoint write at step 3" in ln for ln in errors), proc.stderr[-3000:]


def test_a_rank_stuck_before_the_first_step_is_one_line_not_gloos_traceback(tmp_path):
    """Rank 1 builds its dataset for 15 s; the others wait in a collective of the run's
    building (trainer.ddp.timeout_s=5): gloo's `Timed out waiting 5000ms for recv` traceback
    (the heartbeat that names a stuck rank starts with the training loop) is one line."""
    proc = torchrun(2, [f"hydra.run.dir={tmp_path / 'run'}", "trainer.ddp.timeout_s=5",
                        "data.dataset._target_=tests.helpers.SlowBuiltDigits"], cwd=ROOT,
                    timeout=150)
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("stoker: error:")]
    assert errors and errors[0].startswith(
        "stoker: error: rank 0 waited more than trainer.ddp.timeout_s=5 s in a collective "
        "before the first step: another rank did not reach it (stuck, or slow to build its "
        "data, model or cache; "), proc.stderr[-3000:]
    assert "[rank0]: Traceback" not in proc.stderr


def test_a_backend_timeout_outside_the_loop_is_a_lost_peer_and_a_write_wait_says_its_own():
    from trainer.liveness import LeftTheBarrier, PeerLost, WriteWaitTimedOut, lost_at

    gloo = "[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv"
    first = lost_at(RuntimeError(gloo), 0, 2, None, 5)
    assert isinstance(first, PeerLost) and str(first).startswith(
        "rank 0 waited more than trainer.ddp.timeout_s=5 s in a collective before the first "
        "step: another rank did not reach it (stuck, or slow to build")
    later = lost_at(RuntimeError(gloo), 0, 2, 40, 5)
    assert str(later).endswith("at step 40: another rank did not reach it (stopped, stuck or "
                               "gone)")
    # a checkpoint write's wait names its own key and time; one's own timeout is no peer's
    for error in (WriteWaitTimedOut("trainer.checkpoint.timeout_s", 3, gloo, False),
                  LeftTheBarrier(gloo), RuntimeError("the metrics server timed out")):
        assert lost_at(error, 1, 2, 3, 60) is None, error
    assert lost_at(RuntimeError(gloo), 0, 1, None, 5) is None


def test_the_rank_named_is_the_one_in_its_own_code_not_one_waiting_for_it(monkeypatch):
    """Rank 2 stuck in its dataset's read, ranks 0 and 1 in a collective waiting for it: all
    three at the same step and phase, and which one was named depended on when each beat
    saw it change (rank 1 named rank 0, rank 0 named rank 1)."""
    from trainer.liveness import Heartbeat

    now = time.time()
    beat = {"step": 8, "phase": "validating", "time": now}
    heart = Heartbeat.__new__(Heartbeat)
    heart.rank, heart.world_size = 0, 3
    heart.beats = lambda: {0: {**beat, "since": now - 30, "waiting": True},
                           1: {**beat, "since": now - 30, "waiting": True},
                           2: {**beat, "since": now - 20, "waiting": False}}
    said = heart._slowest()
    assert said.startswith("rank 2 made no progress for at least 20 s (last heartbeat: step "
                           "8, validating, not waiting in a collective)"), said
    heart.beats = lambda: {1: {**beat, "since": now - 30, "waiting": True},
                           2: {**beat, "step": 7, "since": now - 10, "waiting": True}}
    assert heart._slowest().startswith("rank 2 made no progress")  # (the oldest step first)


def test_of_peers_gone_the_first_to_end_is_named_first(monkeypatch):
    """Rank 1 killed during rank 0's checkpoint write; rank 0 ended after it, on its report of
    that: rank 2 named rank 0's process as the one that ended, rank 1 after it."""
    from trainer import liveness
    from trainer.liveness import Heartbeat

    now = time.time()
    reads = iter([{0: {"time": now - 2}, 1: {"time": now - 30}},
                  {0: {"time": now - 2}, 1: {"time": now - 30}}])
    heart = Heartbeat.__new__(Heartbeat)
    heart.rank, heart.world_size = 2, 3
    heart.beats = lambda: next(reads)
    monkeypatch.setattr(liveness.time, "sleep", lambda s: None)
    monkeypatch.setattr(liveness, "peer_errors", lambda rank, world: {})
    assert heart._gone().startswith("rank 1's process ended, and that of ranks [0]")

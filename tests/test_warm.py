"""tests/warm.py: a run forked from the warm process is the run a new interpreter starts, its
argv, working dir, environment, `__main__`, session, output and exit code; a run whose
interpreter would start otherwise starts cold; a warm run that hangs is ended like a cold one."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys

import pytest

from tests import helpers, warm
from tests.helpers import ROOT, STACKS, Hung, bounded, run_cli


def _env(**extra):
    """The environment `run_cli` gives `bounded`, with `extra`."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **extra}


def _started(**extra):
    """... and the one `bounded` starts a run with (its stacks' sitecustomize on the path)."""
    return {**_env(), "PYTHONPATH": os.pathsep.join(
        [str(STACKS), *filter(None, [os.environ.get("PYTHONPATH")])]), **extra}


def _reporting(tmp_path):
    """A short run whose dataset reports its process into the returned file: (file, args)."""
    report = tmp_path / "report.json"
    return report, ["debug=fdr", "trainer.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}",
                    "data.dataset._target_=tests.helpers.ProcessReportingDigits",
                    f"+data.dataset.report={report}"]


@pytest.fixture
def started(monkeypatch):
    """The runs `bounded` started warm (a WarmRun) or cold (None), in order."""
    runs, start = [], warm.start
    monkeypatch.setattr(warm, "start", lambda *a, **k: runs.append(start(*a, **k)) or runs[-1])
    return runs


def test_a_warm_run_starts_as_python_train_py_does(tmp_path, started):
    report, args = _reporting(tmp_path)
    runs = {}
    for how, cold in (("warm", "0"), ("cold", "1")):
        os.environ["STOKER_TEST_COLD"] = cold
        try:
            proc = bounded([sys.executable, warm.TRAIN, *args], tmp_path,
                           _env(STOKER_TEST_SAY=how), timeout=240)
        finally:
            del os.environ["STOKER_TEST_COLD"]
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "reported to stdout" in proc.stdout and "reported to stderr" in proc.stderr
        runs[how] = json.loads(report.read_text())
    assert isinstance(started[0], warm.WarmRun) and started[1] is None
    assert runs["warm"].pop("say") == "warm" and runs["cold"].pop("say") == "cold"
    assert runs["warm"] == runs["cold"] == {
        "argv": [warm.TRAIN, *args], "cwd": str(tmp_path), "path0": str(ROOT),
        "main": warm.TRAIN, "session": True, "pipe": True, "threads": runs["cold"]["threads"],
        "sighup_ignored": runs["cold"]["sighup_ignored"], "signals": runs["cold"]["signals"],
        "streams": runs["cold"]["streams"]}


def test_another_startup_environment_asked_for_twice_gets_a_warm_process_of_its_own(
        tmp_path, started):
    report, args = _reporting(tmp_path)
    run_cli(["--help"])  # (the suite's own environment, OMP_NUM_THREADS=1, has a warm process)
    threads = []
    for _ in range(3):
        proc = bounded([sys.executable, warm.TRAIN, *args], tmp_path, _env(OMP_NUM_THREADS="2"),
                       timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        threads.append(json.loads(report.read_text())["threads"])
    kinds = [type(run) for run in started]
    assert kinds[0] is warm.WarmRun and kinds[1:] in (
        [type(None), warm.WarmRun, warm.WarmRun],  # (the environment's first run: cold)
        [warm.WarmRun] * 3)  # (this worker asked for it before)
    assert started[-1].warm != started[0].warm and threads == [2, 2, 2]


@pytest.mark.parametrize("override", ["data.num_worker=8", "trainer.precision=fp16"])
def test_a_warm_runs_error_and_exit_code_are_the_cold_runs(tmp_path, override, monkeypatch,
                                                          started):
    warm_run = run_cli([f"hydra.run.dir={tmp_path}", override])
    monkeypatch.setenv("STOKER_TEST_COLD", "1")
    cold_run = run_cli([f"hydra.run.dir={tmp_path}", override])
    assert isinstance(started[0], warm.WarmRun) and started[1] is None
    assert (warm_run.returncode, warm_run.stdout, warm_run.stderr) == (
        cold_run.returncode, cold_run.stdout, cold_run.stderr)
    assert warm_run.returncode == 2 and warm_run.stderr.startswith("stoker: error:")


def test_torchruns_agent_and_its_ranks_start_warm_as_torchrun_starts_them(tmp_path,
                                                                         monkeypatch):
    """The warm agent's rank 0 is a copy of it, its last rank a new interpreter, each started
    as the ranks of a cold job are, from a suite under nohup (SIGHUP ignored, in the warm
    process too): torchrun's agent handles SIGHUP, so its ranks find it at its default. The
    four ranks of the two jobs hash a string four ways (no PYTHONHASHSEED): the warm rank 0
    with its warm process's seed, each other one with its own."""
    report = tmp_path / "report.json"
    cmd = [*helpers.TORCHRUN, "--standalone", "--nproc_per_node=2", warm.TRAIN, *helpers.QUIET,
           "trainer.max_epochs=1", "data.dataset._target_=tests.helpers.ProcessReportingDigits",
           f"+data.dataset.report={report}"]
    jobs, agents = {}, {}
    env = _started()
    env.pop("PYTHONHASHSEED", None)
    ignored = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        server = warm._Warm(env)
        try:
            for how in ("warm", "cold"):
                start = helpers.started if how == "cold" else (
                    lambda *a: server.start(*a, merged=False, default_signals=()))
                if how == "cold":
                    monkeypatch.setenv("STOKER_TEST_COLD", "1")
                agents[how] = start([*cmd, f"hydra.run.dir={tmp_path / how}"], tmp_path,
                                    {**env, "STOKER_TEST_SAY": how})
                out, err = agents[how].communicate(timeout=240)
                assert agents[how].returncode == 0, err[-3000:]
                jobs[how] = [json.loads(report.with_name(f"report.json.{rank}").read_text())
                             for rank in range(2)]
        finally:
            server.close()
    finally:
        signal.signal(signal.SIGHUP, ignored)
    assert isinstance(agents["warm"], warm.WarmRun)
    assert not isinstance(agents["cold"], warm.WarmRun)
    hashes = [job[rank]["hash"] for job in jobs.values() for rank in range(2)]
    for rank in range(2):
        w, c = jobs["warm"][rank], jobs["cold"][rank]
        # (each agent forked warm or started cold; the ranks its children)
        assert (w.pop("parent"), c.pop("parent")) == (agents["warm"].pid, agents["cold"].pid)
        assert (w.pop("say"), c.pop("say")) == ("warm", "cold")
        assert w.pop("argv")[-1] == f"hydra.run.dir={tmp_path / 'warm'}"
        assert c.pop("argv")[-1] == f"hydra.run.dir={tmp_path / 'cold'}"
        # the warm rank 0, a copy of its agent's interpreter; the others `python -u train.py
        # ARGS` as torchrun runs it; all started alike in all they report
        assert w.pop("cmdline")[:3] == ([sys.executable, "-m", "tests.warm"] if rank == 0
                                        else [sys.executable, "-u", warm.TRAIN])
        assert c.pop("cmdline")[:3] == [sys.executable, "-u", warm.TRAIN]
        w.pop("hash"), c.pop("hash")
        assert w == c
        assert {k: c[k] for k in ("cwd", "path0", "main", "session", "pipe", "threads",
                                  "sighup_ignored")} == {
            "cwd": str(tmp_path), "path0": str(ROOT), "main": warm.TRAIN, "session": True,
            "pipe": True, "threads": 1,  # (torchrun's OMP_NUM_THREADS=1)
            "sighup_ignored": False}  # (the trainer's own handler: torchrun's was not ignored)
        assert c["streams"]["stdout"][2:4] == [False, True]  # (-u: written through)
    assert len(set(hashes)) == 4, hashes


def test_a_torchrun_rank_starts_warm_only_as_its_interpreter_would(tmp_path, monkeypatch):
    """A waiting copy of the agent becomes the rank `python -u train.py ARGS` whose startup
    environment is the agent's but for torchrun's own variables: the request it is sent
    holds the rank's argv, working dir, environment, stdio and the signals the agent
    ignores. Another script, interpreter or startup environment is torchrun's own Popen;
    so is every rank once no copy waits."""
    env = {**_started(), "TORCHELASTIC_RUN_ID": "none"}
    copy, agent_end = socket.socketpair()
    ranks = warm._Ranks(0, env)  # (none forked: this one's end of a socketpair stands in)
    ranks.waiting.append((os.getpid(), agent_end))
    rank = [sys.executable, "-u", "train.py", "trainer.max_epochs=1"]
    ignored = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    monkeypatch.chdir(ROOT)
    try:
        for other in ([sys.executable, "-u", str(ROOT / "scripts" / "bench_overhead.py")],
                      ["/usr/bin/python3", *rank[1:]], [sys.executable, *rank[2:]]):
            assert ranks.start(other, env, None, None) is None
        for startup in ({"LC_ALL": "C"}, {"OMP_NUM_THREADS": "4"}, {"PYTHONHASHSEED": "1"},
                        {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}):  # (the last: a seed)
            assert ranks.start(rank, {**env, **startup}, None, None) is None
        assert len(ranks.waiting) == 1
        ours = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "2", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
        with open(tmp_path / "out", "w") as out:
            proc = ranks.start(rank, {**env, **ours}, out, None)
        assert isinstance(proc, warm._Rank) and proc.pid == os.getpid() and not ranks.waiting
        assert ranks.start(rank, env, None, None) is None  # (no copy left)
    finally:
        signal.signal(signal.SIGHUP, ignored)
    request, *fds = warm._receive(copy)
    assert request == {"argv": rank[2:], "module": None, "cwd": str(ROOT), "env": {**env, **ours},
                       "default_signals": [], "unbuffered": True,
                       "ignored": request["ignored"]}
    assert int(signal.SIGHUP) in request["ignored"] and int(signal.SIGTERM) not in \
        request["ignored"]
    same = [os.path.samestat(os.fstat(fd), os.fstat(to)) for fd, to in zip(fds, (0, 2, 2))]
    assert same == [True, False, True] and os.path.samestat(
        os.fstat(fds[1]), os.stat(tmp_path / "out"))  # (its stdin and stderr the agent's)
    for fd in fds:
        os.close(fd)
    copy.close()


@pytest.mark.parametrize("argv, env, count", [
    (["--standalone", "--nproc_per_node=2", "train.py", "x=1"], {}, 1),
    (["--nproc-per-node", "3", "--max-restarts=1", "train.py"], {}, 2),  # (not its restarts)
    (["--nproc_per_node=1", "train.py"], {}, 1),
    (["--standalone", "train.py"], {"PET_NPROC_PER_NODE": "4"}, 3),  # (torchrun's default)
    (["--standalone", "train.py", "--nproc_per_node=4"], {}, 1),  # (the script's own)
    (["--nproc_per_node=auto", "train.py"], {}, 0),
    (["--nproc_per_node=2", "scripts/bench_overhead.py"], {}, 0)])
def test_torchruns_agent_forks_a_copy_for_each_rank_but_the_last(argv, env, count, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert warm._Ranks._asked(argv, env) == count


def _merged_reporting_runs(start, tmp_path):
    """Two `_reporting` runs by `start(cmd, cwd, env, merged=True, default_signals=...)`, the
    second asking for SIGHUP at its default: (each run, whether it found SIGHUP ignored),
    once each ended 0 with its stderr in its stdout."""
    report, args = _reporting(tmp_path)
    runs = []
    for default in ([], [signal.SIGHUP]):
        proc = start([sys.executable, warm.TRAIN, *args], tmp_path, _started(), merged=True,
                     default_signals=default)
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0 and err is None, out[-3000:]
        assert "reported to stdout\nreported to stderr\n" in out
        runs.append((proc, json.loads(report.read_text())["sighup_ignored"]))
    return runs


def test_a_warm_run_merges_its_output_and_takes_signals_at_their_default_as_asked(tmp_path):
    """test_resilience's runs: stderr into stdout's pipe (Popen's stderr=STDOUT), SIGHUP at
    its default although the warm process ignores it (a suite under nohup), as their cold
    preexec_fn sets it; poll and send_signal as Popen's."""
    ignored = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (inherited by the warm process)
    try:
        server = warm._Warm(_started())
    finally:
        signal.signal(signal.SIGHUP, ignored)
    try:
        runs = _merged_reporting_runs(server.start, tmp_path)
        # (SIGHUP: the trainer's own handler, not nohup's, where asked)
        assert [ignored for _, ignored in runs] == [True, False]
        marker = tmp_path / "building"
        proc = server.start([sys.executable, warm.TRAIN, f"hydra.run.dir={tmp_path / 'slow'}",
                             "trainer.progress_bar=false", f"+data.dataset.marker={marker}",
                             "data.dataset._target_=tests.helpers.SlowToBuildDigits",
                             "+data.dataset.seconds=3"], tmp_path, _started(), merged=True,
                            default_signals=[signal.SIGHUP])
        while not marker.exists():
            assert proc.poll() is None
        proc.send_signal(signal.SIGHUP)  # (a closed terminal: a preemption)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == proc.poll() == 75, out[-3000:]
        assert "stopped on a preemption signal before the first step" in out
        proc.send_signal(signal.SIGHUP)  # (ended: nothing is sent)
    finally:
        server.close()


def test_a_cold_run_merges_its_output_and_takes_signals_at_their_default_as_asked(
        tmp_path, monkeypatch):
    """helpers.started's other way, a new interpreter (here with STOKER_TEST_COLD=1): the
    same as the warm fork's, from a suite that ignores SIGHUP."""
    monkeypatch.setenv("STOKER_TEST_COLD", "1")
    ignored = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (inherited by the run)
    try:
        runs = _merged_reporting_runs(helpers.started, tmp_path)
    finally:
        signal.signal(signal.SIGHUP, ignored)
    assert not any(isinstance(proc, warm.WarmRun) for proc, _ in runs)
    assert [ignored for _, ignored in runs] == [True, False]


def test_a_run_whose_interpreter_starts_otherwise_starts_cold(tmp_path):
    cmd = [sys.executable, warm.TRAIN, "--help"]
    proc = warm.start(cmd, tmp_path, _started())  # (the warm process started where none was)
    assert isinstance(proc, warm.WarmRun)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "train is powered by Hydra" in out, err
    assert warm.start(cmd, tmp_path, _started(LC_ALL="C")) is None  # (a locale of its own)
    assert warm.start(cmd, tmp_path, _started(PYTHONPATH="/elsewhere")) is None
    assert warm.start(cmd, tmp_path, _started(), preexec_fn=os.getpid) is None
    assert warm.start([sys.executable, "-m", "trainer"], tmp_path, _started()) is None


def test_a_warm_run_that_hangs_is_ended_tree_and_all_saying_where(tmp_path, started):
    args = [f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress_bar=false",
            "data.dataset._target_=tests.helpers.SlowToBuildDigits",
            f"+data.dataset.marker={tmp_path / 'building'}", "+data.dataset.seconds=600"]
    with pytest.raises(Hung) as hung:
        bounded([sys.executable, warm.TRAIN, *args], tmp_path, _env(), timeout=30)
    message = str(hung.value)
    assert [type(run) for run in started] == [warm.WarmRun]
    stacks = message.split("its stderr's end (stacks after SIGUSR2):")[1]
    assert re.search(r'tests/helpers.py", line \d+ in __init__', stacks), message[-3000:]
    pid = int(message.split("its processes: ")[1].split()[0])
    assert not os.path.exists(f"/proc/{pid}"), "the run outlived its timeout"

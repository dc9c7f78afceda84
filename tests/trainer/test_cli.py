"""Bad overrides and values end with one line on stderr naming the key, exit code 2."""
from __future__ import annotations

import pytest

from tests.helpers import run_cli
from trainer.config import ConfigError


@pytest.mark.parametrize("override,needle", [
    ("data.num_worker=8", "data.num_worker"),  # typo: compose time
    ("data.num_workers=abc", "data.num_workers"),  # type: compose time
    ("data=nope", "digits"),  # bad group choice: lists the valid ones
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches"),  # semantic
    ("trainer.precision=fp16", "trainer.precision"),  # fp16 without CUDA
    ("trainer.resume=/no/such/file.pt", "trainer.resume"),
    ("trainer.resume=/tmp", "trainer.resume=/tmp: a directory, not a checkpoint file"),
    ("task=classifcation", "Available options in 'task': classification language_model "
                           "model_loss regression; did you mean task=classification?"),
    ("task=zzz", "Available options in 'task': classification language_model model_loss "
                 "regression"),  # (no choice it misspells: none named)
    ("task.num_classes=abc", "task.num_classes='abc': must be an integer >= 2 or null"),
    # Hydra's lexer takes no non-ASCII letter unquoted: it showed a caret under the override
    ("data.cache_dir=/x/d\u00fcr", "data.cache_dir=/x/d\u00fcr: Hydra's override grammar does "
                                   "not take '\u00fc' unquoted; quote the value: "
                                   "data.cache_dir=\"/x/d\u00fcr\" (in a shell: "
                                   "'data.cache_dir=\"/x/d\u00fcr\"')"),
    ("d\u00fcr=1", "LexerNoViableAltException: d\u00fcr=1"),  # (in the key: no quoting helps)
    ("model._target_=builtins.dict", "model._target_=builtins.dict: builds a dict, not a "
                                     "torch.nn.Module"),
    # Hydra's grammar errors named no override: two run together by a missing space
    ("data.cache_dir=/x/a-trainer.max_epochs=0", "stoker: error: data.cache_dir=/x/a-trainer."
                                                 "max_epochs=0: mismatched input '='"),
    ("optim.lr=[1,", "stoker: error: optim.lr=[1,: no viable alternative at input"),
    # a config group deleted: OmegaConf's words alone named no choice
    ("~sched", "stoker: error: Missing mandatory value: sched (a config group: choose one, "
               "sched=constant|step|warmup_cosine)"),
    # null for a key that takes none: Hydra's "is not Optional" named no value that does
    ("data.cache=null", "stoker: error: data.cache=null: data.cache takes a value, not null "
                        "(the schema's default is none)"),
    ("trainer.tensorboard=null", "trainer.tensorboard takes a value, not null (the schema's "
                                 "default is true)"),
    # a group the config chooses already, added with +: Hydra's words named no fix
    # a search path folder that is not there: Hydra's raw warning, then it blamed the config
    ("hydra.searchpath=[file:///nonexistent/stoker-conf]", "hydra.searchpath=[file:///"
     "nonexistent/stoker-conf]: /nonexistent/stoker-conf is not a folder"),
    ("+data=digits", "stoker: error: +data=digits: data appears more than once in the final "
                     "defaults list (the config chooses a data already: write data=digits, "
                     "without the +, to choose it)"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, override, needle):
    proc = run_cli([f"hydra.run.dir={tmp_path}", override])
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("stoker: error:") and needle in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_an_experiment_of_ones_own_without_its_package_line_is_told_to_add_it(tmp_path):
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "defaults:\n  - override /data: synthetic\n")
    proc = run_cli([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "experiment=mine",
                    f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith(
        "Could not override 'data@experiment.data'. Did you mean to override data? (a config "
        "under experiment/ that overrides other groups' choices needs '# @package _global_' as "
        "its first line, as conf/experiment/*.yaml have)"), proc.stderr


def test_a_config_name_not_in_the_search_path_lists_the_configs_there(tmp_path):
    """Hydra's `Cannot find primary config 'trian'` named none of the configs there are."""
    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", "--config-name", "trian"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("stoker: error: --config-name trian: no such config in the "
                                   "config search path (it has: train); did you mean train?")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "pretrain.yaml").write_text("x: 1\n")
    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", "--config-dir", str(tmp_path / "mine"),
                    "--config-name", "zzz"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("stoker: error: --config-name zzz: no such config in the "
                                   "config search path (it has: pretrain, train)")
    assert not (tmp_path / "run").exists()


def test_an_empty_run_dir_is_refused_and_nothing_lands_in_the_current_dir(tmp_path):
    """`hydra.run.dir=$UNSET_VARIABLE` would otherwise make the current directory the run
    dir: checkpoints, config and logs written among the user's files."""
    proc = run_cli(["hydra.run.dir=", "debug=fdr"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("stoker: error: hydra.run.dir is empty: name the run's "
                                   "directory (hydra.run.dir=outputs/my-run), or leave the key "
                                   "out for a new dated one")
    assert not list(tmp_path.iterdir())


def test_user_can_ask_for_the_full_traceback(tmp_path):
    proc = run_cli([f"hydra.run.dir={tmp_path}", "trainer.precision=fp16"],
                   env_extra={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr


def test_auto_num_workers_shares_the_cpus_among_ranks():
    from trainer.distributed import auto_num_workers

    assert auto_num_workers(1000) == 1 and 1 <= auto_num_workers(1) <= 16


def test_cli_accepts_num_workers_auto(tmp_path):
    proc = run_cli([f"hydra.run.dir={tmp_path}", "data.num_workers=auto", "debug=fdr"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "num_workers: " in proc.stdout and "${auto_workers" not in proc.stdout


def test_the_slurm_launcher_on_a_machine_without_slurm_is_one_line(tmp_path):
    import shutil

    if shutil.which("srun"):
        pytest.skip("this machine has SLURM")
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    proc = run_cli(["-m", "hydra/launcher=slurm", "optim.lr=1e-3,3e-3"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "stoker: error: hydra/launcher=slurm: this machine has no SLURM (no srun on the PATH); "
        "submit from a cluster's login node, or leave the launcher out to run the sweep here")
    assert not list(tmp_path.iterdir())  # no sweep dir left behind by a sweep that never ran


def test_a_misspelt_key_under_torchrun_is_one_line_not_a_ranks_traceback(tmp_path):
    from tests.helpers import torchrun

    proc = torchrun(2, ["data.num_worker=8"], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    lines = [ln for ln in out.splitlines() if ln.startswith("stoker: error:")]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith("stoker: error: Could not override 'data.num_worker': Key "
                               "'num_worker' not in 'DataConfig' (key: data.num_worker)")
    # torchrun reports the ranks' exit codes, not a traceback it read from their error files
    assert "hydra/_internal" not in out and "error_file: <N/A>" in out


def test_an_error_every_rank_meets_under_torchrun_is_said_once_by_rank_0(tmp_path):
    """Rank 0 says it before it leaves the process group and tells the agent's store; the
    other ranks wait for that word, so torchrun ending every rank at the first exit cannot
    end rank 0 before its line (no line at all before, in 4 runs of 4 of a user's typo)."""
    from tests.helpers import torchrun

    proc = torchrun(2, ["data=custom", "+data.dataset._target_=tests.helpers.Empty",
                        "data.input_shape=[4]", "data.num_classes=2",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=120)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if ln.startswith("stoker: error:")]
    assert lines == ["stoker: error: data.dataset: Empty split=train has no samples"], \
        (proc.stdout + proc.stderr)[-3000:]


@pytest.fixture
def agent_store(monkeypatch):
    """A store as torchrun's agent keeps one, this process as rank `rank` of two under it."""
    import datetime

    import torch.distributed as dist

    from trainer import liveness

    store = dist.TCPStore("127.0.0.1", 0, is_master=True,
                          timeout=datetime.timedelta(seconds=10))
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                       "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    for key in ("TORCHELASTIC_RESTART_COUNT", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(liveness, "_SAID_STORE", [])
    monkeypatch.setattr(liveness, "OWN_WAIT_S", 0.5)
    from trainer import cli

    monkeypatch.setattr(cli, "reap_children", lambda: None)

    def as_rank(rank: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setattr(liveness, "_SAID_STORE", [])

    return store, as_rank


@pytest.mark.parametrize("said_by_rank_0", [True, False])
def test_under_torchrun_a_ranks_error_line_waits_for_rank_0s_and_is_said_where_it_never_comes(
        agent_store, capsys, said_by_rank_0):
    """An error every rank meets is said by rank 0 only; torchrun's agent ends every rank as
    soon as one exits with an error, and a rank that met it first (before the ranks joined a
    group, as an override a node's target does not take) had rank 0 ended before its line:
    no line at all. The other ranks wait for rank 0's word that it said its line, and say
    their own where it never comes."""
    from trainer import cli

    store, as_rank = agent_store
    if said_by_rank_0:
        as_rank(0)
        with pytest.raises(SystemExit) as done:
            cli.fail(ConfigError("model.hiden: takes no argument 'hiden'"))
        assert done.value.code == 2
        assert capsys.readouterr().err == "stoker: error: model.hiden: takes no argument " \
                                          "'hiden'\n"
        assert store.check(["stoker/attempt-0/said/0"])
    as_rank(1)
    with pytest.raises(SystemExit) as done:
        cli.fail(ConfigError("model.hiden: takes no argument 'hiden'"))
    assert done.value.code == 2
    assert capsys.readouterr().err == ("" if said_by_rank_0 else "stoker: error: rank 1: "
                                       "model.hiden: takes no argument 'hiden'\n")


def test_a_misspelt_key_in_a_config_file_of_ones_own_lists_the_valid_keys(tmp_path):
    """Hydra raises the file's error while handling OmegaConf's (its context, not its cause):
    the line names the file and lists the keys, as the same typo on the command line does."""
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "typo.yaml").write_text(
        "defaults:\n  - digits\n  - _self_\nbatchsize: 16\n")
    proc = run_cli([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=typo",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(
        "stoker: error: In 'data/typo': Key 'batchsize' not in 'DataConfig' (valid keys: "
        "dataset, train_dataset, val_dataset, collate_fn, input_shape, num_classes, "
        "batch_size, "), proc.stderr
    assert "\n" not in proc.stderr.strip() and not (tmp_path / "run").exists()


def test_a_config_file_of_ones_own_that_is_not_yaml_is_one_line_naming_where(tmp_path):
    """A syntax error in a config file Hydra reads was yaml's 111-line traceback, exit 1; a
    YAML file one's own code reads keeps its traceback (it is that code's error)."""
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "broken.yaml").write_text(
        "dataset: {_target_: mine.Bad\nbatch_size: 16\n")
    proc = run_cli([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "data=broken",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (2, (
        f"stoker: error: {tmp_path / 'conf' / 'data' / 'broken.yaml'}, line 2, column 11: not "
        "valid YAML: expected ',' or '}', but got ':' (while parsing a flow mapping that begins "
        "at line 1, column 10)\n")), proc.stderr
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine.py").write_text(
        "import torch, yaml\n\n"
        "class Bad(torch.utils.data.Dataset):\n"
        "    def __init__(self, split):\n"
        "        pass\n\n"
        "    def __len__(self):\n"
        "        return 4\n\n"
        "    def __getitem__(self, i):\n"
        "        return yaml.safe_load('labels: {a: 1')\n")
    proc = run_cli(["data=custom", "+data.dataset._target_=mine.Bad", "data.input_shape=[2]",
                    "data.num_classes=2", "data.num_workers=0",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" in proc.stderr, proc.stderr[-2000:]
    assert "yaml.parser.ParserError" in proc.stderr and 'mine.py", line 11' in proc.stderr


def test_a_file_where_the_run_dir_must_be_is_named_in_one_line(tmp_path):
    (tmp_path / "afile").write_text("mine")
    proc = run_cli([f"hydra.run.dir={tmp_path / 'afile'}"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"stoker: error: hydra.run.dir={tmp_path / 'afile'}: a file "
                                   "is in the way where a folder must be (File exists)")
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_dangling_link_as_the_run_dir_is_said_as_a_link_not_a_file(tmp_path):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        f"stoker: error: hydra.run.dir={tmp_path / 'run'}: {tmp_path / 'run'} is a link to "
        f"{tmp_path / 'gone'}, which does not exist (or leads back to itself); make that "
        "folder, or give another path")


def test_a_folder_the_os_cannot_make_is_said_with_the_key_that_named_it(tmp_path):
    (tmp_path / "afile").write_text("mine")
    proc = run_cli([f"hydra.run.dir={tmp_path / 'run'}", "data.cache=disk",
                    f"data.cache_dir={tmp_path / 'afile' / 'cache'}"], cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"stoker: error: data.cache_dir={tmp_path / 'afile' / 'cache'}"
                                   ": a file is in the way where a folder must be (Not a "
                                   "directory)")
    assert (tmp_path / "afile").read_text() == "mine"


@pytest.mark.parametrize("writing", [False, True])
def test_a_second_ctrl_c_exits_130_and_at_once_past_a_background_checkpoint_write(
        monkeypatch, capsys, writing):
    """A run stopped at once: exit 130 as a shell reports Ctrl-C; while a checkpoint is still
    being written on its background thread, through os._exit (exit handlers run), because the
    interpreter's shutdown under torch's writer aborts the process (exit 134)."""
    from trainer import cli

    monkeypatch.setattr(cli, "writing_in_background", lambda: writing)
    monkeypatch.setattr(cli, "reap_children", lambda: None)
    ended = []

    def os_exit(code):
        ended.append(code)
        raise SystemExit("os._exit")

    monkeypatch.setattr(cli.os, "_exit", os_exit)
    monkeypatch.setattr(__import__("atexit"), "_run_exitfuncs", lambda: ended.append("atexit"))

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        cli._one_line_errors(interrupted)
    assert capsys.readouterr().err == "stoker: interrupted\n"
    assert (ended, e.value.code) == ((["atexit", 130], "os._exit") if writing else ([], 130))


def test_an_error_a_ctrl_c_left_behind_is_the_interrupt(monkeypatch, capsys):
    """A Ctrl-C while Hydra composed surfaced as omegaconf's clean-up failing ('NoneType'
    object has no attribute '_invalidate_flags_cache'), said as a config error, exit 2."""
    from omegaconf.errors import ConfigKeyError

    from trainer import cli

    monkeypatch.setattr(cli, "reap_children", lambda: None)
    monkeypatch.setattr(cli, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))

    def composing():
        try:
            raise KeyboardInterrupt
        finally:
            try:
                raise AttributeError("'NoneType' object has no attribute 'x'")
            except AttributeError as e:
                raise ConfigKeyError(str(e)) from e

    with pytest.raises(SystemExit) as e:
        cli._one_line_errors(composing)
    assert (e.value.code, capsys.readouterr().err) == (130, "stoker: interrupted\n")

    def plain():  # an error with no interrupt behind it stays the config error it is
        raise ConfigKeyError("no key x")

    with pytest.raises(SystemExit) as e:
        cli._one_line_errors(plain)
    assert e.value.code == 2 and "no key x" in capsys.readouterr().err


def test_a_sweep_flag_among_the_overrides_is_one_line_saying_where_it_goes(capsys):
    """Hydra's parser takes the overrides before -m and refuses those after it with its
    whole usage block; -m first, or after every override, is Hydra's to read."""
    from trainer.cli import _check_flag_order

    with pytest.raises(SystemExit) as e:
        _check_flag_order(["trainer.max_steps=3", "-m", "optim.lr=1e-3,3e-3"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        "stoker: error: -m (a sweep) goes before the overrides, not among them: python "
        "train.py -m trainer.max_steps=3 optim.lr=1e-3,3e-3\n")
    for fine in (["-m", "a=1", "b=2,3"], ["a=1", "b=2,3", "--multirun"], ["a=1"], []):
        _check_flag_order(fine)


def test_a_non_ascii_run_dir_under_the_c_locale_loses_no_line(tmp_path):
    """Without Python's UTF-8 mode, the C locale's console (ascii) could not encode a line
    naming the dir: logging printed its traceback and lost the line, in train.log too."""
    run_dir = tmp_path / "r\u00fcn"
    proc = run_cli(["trainer.max_steps=1", "trainer.progress_bar=false", "data.num_workers=0",
                    f"hydra.run.dir='{run_dir}'"],
                   env_extra={"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "Logging error" not in out and "Traceback" not in out, out[-2000:]
    assert f"run dir {tmp_path}/r\\udcc3\\udcbcn | device cpu" in out  # escaped on the console
    log = (run_dir / "train.log").read_text(encoding="utf-8")
    assert f"run dir {run_dir} | device cpu" in log and "] done: " in log  # as it is, in the file


def test_an_exit_raised_in_the_run_ends_children_that_let_sigterm_pass(tmp_path):
    """A sweep job's crash ends the sweep with SystemExit (trainer/ending.py:end_sweep), which
    passed on without ending the process's children: a loader worker lets Python's one exit
    SIGTERM pass, and the exit waited on it for ever."""
    import sys

    from tests.helpers import ROOT, bounded

    script = tmp_path / "exits.py"
    script.write_text("""
import multiprocessing, signal, time
from trainer.cli import exit_on_error

def child():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (as a worker lets the first one pass)
    time.sleep(600)

def main():
    worker = multiprocessing.get_context("fork").Process(target=child, daemon=True)
    worker.start()
    raise SystemExit(3)

if __name__ == "__main__":
    exit_on_error(main)
""")
    proc = bounded([sys.executable, str(script)], ROOT, {"PYTHONPATH": str(ROOT)}, 60)
    assert proc.returncode == 3, proc.stderr[-2000:]


@pytest.mark.parametrize("phase,signals", [("atexit", 1), ("atexit", 2), ("teardown", 1)])
def test_a_signal_after_the_run_completed_leaves_its_exit_0(tmp_path, phase, signals):
    """A SIGTERM in the second or so a completed run's process takes to end killed it (exit
    143 beside a status.json of "completed": a scheduler requeued the finished job). Now the
    first is let pass in Python's exit handlers and ignored in its teardown; a second ends the
    process at once, 0."""
    import json

    from tests.helpers import signalled_in_its_exit, train_until

    seconds = 6.0
    run_dir = tmp_path / "run"
    with train_until([f"hydra.run.dir={run_dir}", "trainer.max_epochs=1",
                      "model._target_=tests.helpers.SlowExitMLP", f"+model.phase={phase}",
                      f"+model.seconds={seconds}"], "slow exit:") as (proc, lines):
        code, waited = signalled_in_its_exit(proc, lines, signals)
    assert code == 0, "".join(lines[-40:])
    if signals == 2:  # (at once, not after the exit handler's seconds)
        assert waited < seconds - 1
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_a_thread_of_the_users_code_left_running_is_said_and_one_sigterm_ends_it(tmp_path):
    """Python's exit waits for a thread that is no daemon: the process sat silent after
    `done:` and let the first SIGTERM pass. Now a line says what it waits for, and one
    SIGTERM ends it, 0 (the run is complete)."""
    import json
    import os
    import signal

    from tests.helpers import train_until

    run_dir = tmp_path / "run"
    with train_until([f"hydra.run.dir={run_dir}", "trainer.max_epochs=1",
                      "model._target_=tests.helpers.ThreadLeavingMLP"],
                     "the process waits for") as (proc, lines):
        os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=30)
    assert code == 0, "".join(lines[-40:])
    said = [ln.strip() for ln in lines if "the process waits for" in ln]
    assert said == ["stoker: the run is complete; the process waits for 1 thread of your code "
                    "to end (uploader; not daemon threads): a Ctrl-C or SIGTERM ends it now"]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"


def test_the_threads_left_are_the_users_not_a_pools_the_exit_ends_itself():
    """torch.compile leaves a thread pool's workers, which Python's exit shuts down: they
    were said as threads of the user's code after every compiled run."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from trainer.cli import threads_left

    before = set(threads_left())  # (a test runner's own, if any)
    pool, release = ThreadPoolExecutor(2), threading.Event()
    pool.submit(lambda: None).result()
    mine = threading.Thread(target=release.wait, name="mine")
    mine.start()
    try:
        for locked in (True, False):
            assert set(threads_left(locked)) - before == {mine}
    finally:
        release.set()
        mine.join()
        pool.shutdown()

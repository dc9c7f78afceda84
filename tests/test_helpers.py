"""The test harness itself: a process a test starts that hangs is ended, tree and all, and
the failure says where each of its processes was; a folder the tests share is made once; a
config composed once is each test's own copy."""
import os
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import CONF, CPU_OVERRIDES, Hung, bounded, compose_cfg, made_once


def test_a_hung_tree_is_killed_and_says_where_it_waited(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(textwrap.dedent("""
        import subprocess, sys, time

        def wait_here():
            child = subprocess.Popen([sys.executable, "-c",
                                      "import time\\nwhile True: time.sleep(1)"])
            print(child.pid, flush=True)
            time.sleep(600)

        wait_here()
    """))
    start = time.monotonic()
    with pytest.raises(Hung) as hung:
        # (time enough for both processes to start on a loaded machine)
        bounded([sys.executable, str(script)], tmp_path, dict(os.environ), timeout=20)
    message = str(hung.value)
    assert time.monotonic() - start < 90
    assert message.startswith(f"still running after 20 s: {sys.executable} {script}")
    # both processes' states and stacks: the parent's names the function it waits in
    assert message.count(" S wchan=") + message.count(" R wchan=") == 2, message
    assert 'line 8 in wait_here' in message and 'File "<string>", line 2' in message, message
    child = int(message.split("its stdout's end:\n")[1].split()[0])
    assert not os.path.exists(f"/proc/{child}") or \
        open(f"/proc/{child}/stat").read().split(") ")[1].startswith("Z"), "child outlived"


def test_a_process_that_ends_in_time_is_unchanged(tmp_path):
    proc = bounded([sys.executable, "-c", "import sys; print('out'); sys.exit('err')"],
                   tmp_path, dict(os.environ), timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "out\n", "err\n")


@pytest.mark.slow
def test_srun_style_tasks_that_outlive_their_timeout_say_where_they_waited(tmp_path):
    from tests.helpers import slurm_tasks

    with pytest.raises(Hung) as hung:
        # (the first sample's read sleeps: time enough to start on a loaded machine)
        slurm_tasks(tmp_path, 1, ["data.dataset._target_=tests.helpers.StallingDigits",
                                  "+data.dataset.how=sleep", "+data.dataset.at=1",
                                  "data.num_workers=0"], timeout=45)
    message = str(hung.value)
    assert message.startswith("not all ended after 45 s: train.py "), message[:300]
    assert "task 0 (exit -9; " in message and " wchan=" in message, message[-3000:]
    assert "in __getitem__" in message, message[-3000:]  # its stack, from its own output


def test_a_folder_made_once_is_made_by_the_first_to_ask_and_the_others_wait_for_it(tmp_path):
    made = []

    def make(folder):
        made.append(folder)
        folder.mkdir()
        time.sleep(0.5)  # (the others asked meanwhile)
        (folder / "result").write_text("whole")

    with ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(lambda _: made_once(tmp_path, "ref", make), range(3)))
    assert made == [tmp_path / "ref"] and folders == [tmp_path / "ref"] * 3
    assert (tmp_path / "ref" / "result").read_text() == "whole"
    assert made_once(tmp_path, "ref", make) == tmp_path / "ref" and len(made) == 1


def test_a_folder_whose_make_failed_is_made_again_from_empty_by_the_next_to_ask(tmp_path):
    def fails(folder):
        folder.mkdir()
        (folder / "half").write_text("half")
        raise RuntimeError("the reference run failed")

    with pytest.raises(RuntimeError, match="the reference run failed"):
        made_once(tmp_path, "ref", fails)
    seen = []
    folder = made_once(tmp_path, "ref", lambda f: seen.append(f.exists()) or f.mkdir())
    assert seen == [False] and list(folder.iterdir()) == []


def test_a_config_composed_before_is_a_copy_of_its_own_as_hydra_composes_it(tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    overrides = ("data=synthetic", "trainer.resume=${run_dir}/c.pt")
    first = compose_cfg(tmp_path / "a", *overrides)
    first.trainer.max_steps = 7  # (a test's own change)
    second = compose_cfg(tmp_path / "b", *overrides)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        fresh = compose("train", overrides=[f"run_dir={tmp_path / 'b'}", *CPU_OVERRIDES,
                                            *overrides])
    assert OmegaConf.to_yaml(second, resolve=True) == OmegaConf.to_yaml(fresh, resolve=True)
    assert second.trainer.resume == f"{tmp_path / 'b'}/c.pt" and first.trainer.max_steps == 7
    assert OmegaConf.is_struct(second) and second.trainer.max_steps == fresh.trainer.max_steps

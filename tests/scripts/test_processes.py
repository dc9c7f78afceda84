"""scripts/processes.py: a child process (and all it started) ends with the script that ran
it, a signal passed on with a grace to stop; the script says why in one line (run_main)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT


DRIVER = """
import os, subprocess, sys
sys.path.insert(0, {scripts!r})
import processes
from benchlib import run_main
from processes import run_child
{setup}
run_main(lambda: run_child([sys.executable, "-c", {child!r}], "the child"))
"""
# a child that starts a grandchild in a session of its own (as torchrun starts its ranks),
# says both pids, and waits
TREE = """
import os, subprocess, sys, time
gc = subprocess.Popen([sys.executable, "-c",
                       "import os, time; os.setsid(); time.sleep(600)"])
open({pids!r} + ".tmp", "w").write(f"{{os.getpid()}} {{gc.pid}}")
os.replace({pids!r} + ".tmp", {pids!r})
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _start_driver(tmp_path, child: str, ready: Path, setup: str = "") -> subprocess.Popen:
    """DRIVER running `child` (source) through run_child, once the child wrote `ready`;
    `setup`: a line the driver runs first."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(scripts=str(ROOT / "scripts"), child=child, setup=setup))
    proc = subprocess.Popen([sys.executable, str(driver)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    return proc


def _start_tree(tmp_path):
    pids = tmp_path / "pids"
    proc = _start_driver(tmp_path, TREE.format(pids=str(pids)), pids)
    return proc, [int(p) for p in pids.read_text().split()]


@pytest.mark.parametrize("sig,code,line", [
    (signal.SIGTERM, 143, "driver.py: stopped by SIGTERM"),
    (signal.SIGINT, 130, "driver.py: interrupted (Ctrl-C)"),
])
def test_a_signal_ends_the_childs_whole_tree_and_is_one_line(tmp_path, sig, code, line):
    proc, tree = _start_tree(tmp_path)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        deadline = time.monotonic() + 10
        while any(map(_alive, tree)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in tree if _alive(pid)]
    finally:
        for pid in tree:  # this test's own processes, should it fail
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == code and err.strip() == line
    assert left == []  # the grandchild in its own process group too


def test_a_childs_one_line_error_is_said_as_it_is(tmp_path):
    driver = tmp_path / "driver.py"
    child = ("import sys; print('Traceback (most recent call last):', file=sys.stderr); "
             "print('stoker: error: data.batch_size=0: must be >= 1', file=sys.stderr); "
             "sys.exit(2)")
    driver.write_text(DRIVER.format(scripts=str(ROOT / "scripts"), child=child, setup=""))
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "stoker: error: data.batch_size=0: must be >= 1"


# a rank that says many lines, then its error, and aborts (as gloo aborts a process)
ABORTING_RANK = """
import os, sys, time
if os.environ["RANK"] == "0":
    for i in range(40):
        print(f"line {i}", file=sys.stderr, flush=True)
    print("rank 0's own last words", file=sys.stderr, flush=True)
    os.abort()
time.sleep(60)
"""


@pytest.mark.slow
def test_a_failed_torchrun_job_is_reported_by_its_ranks_lines_not_torchruns(tmp_path):
    """torchrun's launcher traceback and box (45 lines) would fill the report's last 25
    lines: they fold into one line, and the failing rank's own lines stay in."""
    rank = tmp_path / "rank.py"
    rank.write_text(ABORTING_RANK)
    child = (f"import os, sys; os.execv(sys.executable, [sys.executable, '-m', "
             f"'torch.distributed.run', '--standalone', '--nproc_per_node=2', {str(rank)!r}])")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(scripts=str(ROOT / "scripts"), child=child, setup=""))
    proc = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True,
                          timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines[0] == "driver.py: error: the child failed (exit 1)"
    assert "  rank 0's own last words" in lines and "  line 39" in lines
    assert lines[-1].startswith("  torchrun: the job failed; first failure: rank 0 "
                                "(local_rank: 0), exitcode -6"), lines[-1]
    assert len(lines) == 26 and not any("Traceback" in ln for ln in lines), lines


# a child that takes half a second to end on SIGTERM, and says it did
GRACEFUL = """
import signal, sys, time
def stop(*a):
    time.sleep(0.5)
    open({marker!r}, "w").write("ended")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open({marker!r} + ".up", "w").write("up")
time.sleep(600)
"""


def test_a_sigterm_said_twice_at_once_still_gives_the_child_its_grace(tmp_path):
    """GNU timeout signals the script and then its process group, microseconds apart: one
    stop, not two, so the child still gets its grace to end (a second SIGTERM a second or
    more later cuts it short)."""
    marker = tmp_path / "ended"
    # "at once": within AGAIN_AFTER_S, made long here so that a loaded machine's delay
    # between the two sends cannot make them two requests
    proc = _start_driver(tmp_path, GRACEFUL.format(marker=str(marker)), Path(f"{marker}.up"),
                         setup="processes.AGAIN_AFTER_S = 60.0")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)  # (two at once would merge into one before Python's handler runs)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip() == "driver.py: stopped by SIGTERM"
    assert marker.read_text() == "ended"


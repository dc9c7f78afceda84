"""scripts/benchlib.py: the argument types the benchmark scripts share."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))  # as the scripts run: benchlib beside them


def test_at_least_takes_counts_and_refuses_the_rest():
    import argparse

    from benchlib import at_least

    assert at_least(1)("3") == 3 and at_least(0)("0") == 0
    for text, needle in (("0", "0: must be >= 1"), ("-2", "-2: must be >= 1"),
                         ("x", "'x' is not an integer")):
        with pytest.raises(argparse.ArgumentTypeError, match=needle):
            at_least(1)(text)


@pytest.mark.parametrize("script,args,needle", [
    ("compare_strategies.py", ["--nproc", "0"], "argument --nproc: 0: must be >= 1"),
    ("bench_checkpoint.py", ["--repeats", "0"], "argument --repeats: 0: must be >= 1"),
    ("bench_loader.py", ["--workers", "-1"], "argument --workers: -1: must be >= 1"),
])
def test_a_count_of_zero_is_a_usage_error_not_a_traceback(script, args, needle):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr

from __future__ import annotations

from trainer.overrides import override_key


def test_override_key_is_the_key_whatever_the_prefix_and_value():
    for arg in ("a.b=1", "+a.b=1", "++a.b=x=y", "~a.b", "~a.b=3", "a.b"):
        assert override_key(arg) == "a.b", arg
    assert override_key("hydra/launcher=slurm") == "hydra/launcher"


def test_reading_a_sweeps_record_imports_no_torch():
    """trainer.sweep (and scripts/sweep_summary.py, which reads a sweep's record with it)
    stays free of torch: the key of an override is read without it."""
    import subprocess
    import sys

    code = ("import sys, trainer.sweep as s; s.varying([{'overrides': ['+a=1']}, "
            "{'overrides': ['+a=2']}]); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"

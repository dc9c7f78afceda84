"""Hydra override strings as the command line gives them, read without Hydra's parser; free of
torch, so that what reads a sweep's record (trainer/sweep.py, scripts/sweep_summary.py) stays
light."""
from __future__ import annotations


def override_key(arg: str) -> str:
    """The key a Hydra override names: `a.b` of `a.b=1`, `+a.b=1`, `++a.b=1` and `~a.b`."""
    return arg.lstrip("+~").split("=", 1)[0]

"""The settings the ranks compare at start-up: everything that changes their steps or their
math, list items one by one, paths left out (a node's own scratch folder). The collectives
themselves: tests/test_train.py (ranks given different settings or datasets)."""
from __future__ import annotations

from trainer.agreement import SHARED, _compared, same_data_everywhere, same_settings_everywhere


def test_the_compared_settings_hold_the_shared_keys_list_items_and_no_paths(make_cfg):
    cfg = make_cfg("model.hidden=[64,32]", "+data.dataset.root=/scratch/node1/data",
                   "optim.lr=0.002")
    compared = _compared(cfg)
    assert set(SHARED) | {"run_dir"} <= set(compared)
    assert compared["model.hidden.0"] == 64 and compared["model.hidden.1"] == 32
    assert compared["optim.lr"] == 0.002
    assert compared["trainer.precision"] == "fp32"  # (an enum: its value)
    assert "data.dataset._target_" in compared
    assert "data.dataset.root" not in compared  # (a path: it may differ between nodes)


def test_one_process_agrees_with_itself_without_a_collective(make_cfg):
    import torch

    same_settings_everywhere(make_cfg(), torch.device("cpu"))  # (no process group: returns)
    same_data_everywhere(None, None, torch.device("cpu"))

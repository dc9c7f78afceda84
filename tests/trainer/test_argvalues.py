"""A `_target_` node's values checked against what torch's and Stoker's targets take, when
built: refused by name, not by a TypeError from inside torch."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from trainer.components import build
from trainer.config import ConfigError


@pytest.mark.parametrize("key,node,message", [
    ("optim", {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": "abc"},
     "optim.lr=abc: must be a number (torch.optim.AdamW's default is 0.001)"),
    # (quoted: a number as text, said quoted; it read as a contradiction, "lr=1e-3: must be a
    # number")
    ("optim", {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": "1e-3"},
     "optim.lr='1e-3': must be a number, not the text '1e-3' (quoted, in the override or a "
     "YAML file: write optim.lr=1e-3 unquoted) (torch.optim.AdamW's default is 0.001)"),
    ("optim", {"_target_": "torch.optim.AdamW", "_partial_": True, "betas": [0.9]},
     "optim.betas=[0.9]: must be 2 numbers (torch.optim.AdamW's default is (0.9, 0.999))"),
    ("sched", {"_target_": "torch.optim.lr_scheduler.StepLR", "_partial_": True,
               "step_size": 10, "gamma": "abc"},
     "sched.gamma=abc: must be a number (torch.optim.lr_scheduler.StepLR's default is 0.1)"),
    ("sched", {"_target_": "trainer.schedules.warmup_cosine", "_partial_": True,
               "min_lr_ratio": [0.1]},
     "sched.min_lr_ratio=[0.1]: must be a number (trainer.schedules.warmup_cosine's default "
     "is 0.0)"),
    ("optim", {"_target_": "torch.optim.AdamW", "_partial_": True, "weight_decay": None},
     "optim.weight_decay=null: must be a number, not null (torch.optim.AdamW's default is "
     "0.01)"),
])
def test_a_value_unlike_its_numeric_default_is_named_before_the_call(key, node, message):
    """A learning rate, a decay factor or betas of the wrong kind are refused by name when
    built, not by a TypeError from inside torch (a StepLR's gamma only at its first decay)."""
    with pytest.raises(ConfigError) as e:
        build(OmegaConf.create(node), key)
    assert str(e.value) == message


def test_values_like_their_defaults_and_nulls_pass():
    node = OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1,
                             "betas": [0.8, 0.99], "weight_decay": 0.0, "foreach": None})
    build(node, "optim")([torch.nn.Parameter(torch.zeros(1))])
    conv = OmegaConf.create({"_target_": "torch.nn.Conv2d", "in_channels": 1, "out_channels": 2,
                             "kernel_size": 3, "padding": "same"})  # annotated to take "same"
    assert build(conv, "model").padding == "same"


class Flexible(torch.nn.Module):
    """A user's own model whose numeric default stands for one of the kinds it takes."""

    def __init__(self, hidden=128):
        super().__init__()
        self.hidden = hidden


def test_a_users_own_class_is_not_held_to_its_defaults_kinds():
    node = OmegaConf.create({"_target_": f"{__name__}.Flexible", "hidden": [128, 64]})
    assert list(build(node, "model").hidden) == [128, 64]

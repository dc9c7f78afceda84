"""trainer/inference.py: a checkpoint's model, rebuilt outside a run, gives the run's numbers."""
from __future__ import annotations

import pytest
import torch

from data.datasets import DigitsDataset
from trainer.checkpoint import CheckpointError
from trainer.inference import load_model
from trainer.runner import train


def _val_batch():
    val = DigitsDataset("val")
    return (torch.stack([val[i][0] for i in range(len(val))]),
            torch.tensor([int(val[i][1]) for i in range(len(val))]))


@pytest.mark.parametrize("model", ["model=mlp", "model=cnn"])
def test_a_checkpoints_model_gives_the_runs_validation_numbers(make_cfg, tmp_path, model):
    """Built from the config kept in the file (the shape and classes offered as the run offered
    them), in eval mode: the same loss and accuracy the run's last validation logged."""
    summary = train(make_cfg(model, "trainer.max_epochs=1"))
    net = load_model(tmp_path / "run" / "checkpoints" / "last.pt")
    assert not net.training
    x, y = _val_batch()
    with torch.no_grad():
        out = net(x)
    assert (out.argmax(1) == y).float().mean().item() == pytest.approx(summary["val_acc"])
    assert torch.nn.functional.cross_entropy(out, y).item() == pytest.approx(
        summary["val_loss"], rel=1e-5)


def test_a_file_that_is_not_a_checkpoint_is_refused_naming_it(tmp_path):
    weights = tmp_path / "weights.pt"
    torch.save(torch.nn.Linear(2, 2).state_dict(), weights)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {weights}: not a Stoker checkpoint"):
        load_model(weights)
    with pytest.raises(CheckpointError) as e:  # a misspelt name: the files beside it
        load_model(tmp_path / "wieghts.pt")
    assert str(e.value) == f"checkpoint {tmp_path / 'wieghts.pt'}: no such file; {tmp_path} " \
        "holds weights.pt"
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path / "gone" / "last.pt")
    assert str(e.value).endswith("last.pt: no such file")

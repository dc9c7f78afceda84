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


def test_image_files_prepared_for_a_checkpoints_model_give_the_runs_numbers(make_cfg, tmp_path):
    """image_inputs decodes, crops and normalises files as the run's image folder and device
    transform did: the model given them scores the run's last validation."""
    from data.images import ImageFolder
    from scripts.make_images import write_images
    from trainer.inference import image_inputs

    write_images(tmp_path / "images", count=60, size=40, classes=3)
    summary = train(make_cfg("data=image_folder", f"data.dataset.root={tmp_path / 'images'}",
                             "data.dataset.size=24", "model=cnn", "trainer.max_epochs=2"))
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    files = ImageFolder("val", str(tmp_path / "images"), size=24).samples
    x = image_inputs(last, [path for path, _ in files])
    y = torch.tensor([label for _, label in files])
    assert x.shape == (len(files), 3, 24, 24) and x.dtype == torch.float32
    with torch.no_grad():
        out = load_model(last)(x)
    assert (out.argmax(1) == y).float().mean().item() == pytest.approx(summary["val_acc"])
    assert torch.nn.functional.cross_entropy(out, y).item() == pytest.approx(
        summary["val_loss"], rel=1e-5)
    for name, data, said in (
            ("digits", [], r"its run's inputs were no square RGB images \(data.input_shape "
                           r"\[1, 8, 8\]\)"),
            # (square RGB of a dataset of one's own: no size, no normalisation recorded; it
            # was called no square RGB images)
            ("synthetic", ["data=synthetic", "model=cnn", "data.input_shape=[3,8,8]"],
             r"its run read its images through data.dataset._target_=data.datasets."
             r"SyntheticDataset, whose decoding, size and normalisation the checkpoint does "
             r"not record .*prepare the images as that dataset does$")):
        train(make_cfg(*data, "trainer.max_steps=1", run_dir=tmp_path / name))
        with pytest.raises(CheckpointError, match=said):
            image_inputs(tmp_path / name / "checkpoints" / "last.pt", [files[0][0]])

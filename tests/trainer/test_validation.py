"""trainer/validation.py: the validation pass, in its own phase for the heartbeat."""
from __future__ import annotations

import pytest

from trainer.runner import train


def test_validations_collectives_are_in_its_phase_for_the_heartbeat(make_cfg, monkeypatch):
    """A peer lost while ranks sum their validation losses is named as met in validation,
    not in training; training resumes its phase afterwards."""
    from trainer import distributed
    from trainer.loop import Loop

    phases, sum_ = [], distributed.all_reduce_sum
    seen = {}

    def all_reduce_sum(t):
        if "loop" in seen:  # (not the metrics' trial on the first batch: a training step's)
            phases.append(seen["loop"].phase)
        return sum_(t)

    evaluate = Loop.evaluate

    def recording(self, epoch):
        seen["loop"] = self
        return evaluate(self, epoch)

    monkeypatch.setattr(distributed, "all_reduce_sum", all_reduce_sum)
    monkeypatch.setattr(Loop, "evaluate", recording)
    train(make_cfg("trainer.max_epochs=1"))
    assert phases and set(phases) == {"validating"} and seen["loop"].phase == "training"


def test_validation_data_the_model_cannot_take_is_one_line_like_trainings(make_cfg):
    """Only the validation split holds float64 arrays: its first batch is named in one line,
    as the first training batch's would be, not a traceback after the epoch."""
    from trainer.config import ConfigError

    cfg = make_cfg("data=custom", "data.input_shape=[1,8,8]", "data.num_classes=10",
                   "+data.train_dataset._target_=data.datasets.DigitsDataset",
                   "+data.train_dataset.split=train",
                   "+data.val_dataset._target_=tests.helpers.Float64Digits",
                   "+data.val_dataset.split=val", "trainer.max_steps=2")
    with pytest.raises(ConfigError) as info:
        train(cfg)
    text = str(info.value)
    assert text.startswith("model: MLP cannot take the first validation batch (") and \
        "the batch holds float64 inputs and the model's parameters are float32" in text, text

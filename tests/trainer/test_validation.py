"""trainer/validation.py: the validation pass, in its own phase for the heartbeat."""
from __future__ import annotations

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

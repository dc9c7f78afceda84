"""trainer/callbacks.py: the base Callback does nothing, and each callback's key in a
checkpoint is its class name, numbered from the second of a class."""
from __future__ import annotations

from trainer.callbacks import Callback, callback_keys
from trainer.loop import Callback as FromLoop


class A(Callback):
    pass


class B(Callback):
    pass


def test_keys_are_class_names_numbered_from_the_second_of_a_class():
    assert callback_keys([A(), B(), A(), A()]) == ["A", "B", "A.1", "A.2"]
    assert callback_keys([]) == []


def test_the_base_does_nothing_and_is_the_one_the_loop_module_names():
    cb = Callback()
    assert cb.after_step(None) is None and cb.after_epoch(None, None) is None
    assert cb.should_stop(None) is None and cb.state_dict() is None
    assert FromLoop is Callback  # (the README's `from trainer.loop import Callback`)

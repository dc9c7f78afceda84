"""Callback: the loop's events for code of one's own (and the built-in checkpointing, early
stopping, preemption); `from trainer.loop import Callback` finds it too.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from trainer.task import _note

if TYPE_CHECKING:
    from trainer.loop import Loop


class Callback:
    """Loop events; subclass and override what you need (checkpointing, preemption, ...)."""

    def after_step(self, loop: "Loop") -> None:
        """After every optimizer step (all ranks, at the same step)."""

    def after_epoch(self, loop: "Loop", val: Optional[Dict[str, float]]) -> None:
        """After every epoch, with its validation results (None when it did not validate)."""

    def validation_failed(self, loop: "Loop") -> None:
        """When a validation after training steps raised, before its error goes on (the
        loop's state is the trained one: checkpointing saves it in one process)."""

    def should_stop(self, loop: "Loop") -> Optional[str]:
        """Asked before every epoch (after the last one's callbacks; at a start or resume):
        a reason ends the run there, and makes a run resumed from its checkpoint complete
        where it says so again (decide from the loop, or from state kept in `state_dict`).
        Keep it free of side effects. The loop agrees it over the ranks (a stop on one stops
        all)."""
        return None

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """What a resumed run must get back (None: nothing). Saved in every checkpoint under
        the callback's class name, in types a weights-only load accepts (numbers, strings,
        lists, dicts, tensors)."""
        return None

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Receives what `state_dict` returned when the checkpoint a run resumes was saved."""


def callback_keys(callbacks: Sequence[Callback]) -> List[str]:
    """Each callback's key in a checkpoint: its class name, numbered from the second of a
    class (`Name`, `Name.1`, ...) in the order the callbacks were given."""
    seen: Dict[str, int] = {}
    keys = []
    for cb in callbacks:
        name = type(cb).__name__
        keys.append(name if name not in seen else f"{name}.{seen[name]}")
        seen[name] = seen.get(name, 0) + 1
    return keys


def callback_failed(e: Exception, callback: Callback, hook: str, step: int) -> None:
    """Notes under an error raised in a callback of one's own which hook raised it, at which
    step (its traceback stays: the callback's own code). Stoker's own callbacks say theirs."""
    if not type(callback).__module__.startswith(("trainer.", "data.")):
        _note(e, f"stoker: in the callback {type(callback).__module__}."
                 f"{type(callback).__qualname__}.{hook}, at step {step}")


def callback_states(callbacks: Sequence[Callback], step: int) -> Dict[str, Any]:
    """The callbacks' own states (Callback.state_dict) by their keys (callback_keys), for a
    checkpoint; an error raised in one of one's own keeps its traceback, with a line naming
    it and `step`."""
    states = {}
    for key, callback in zip(callback_keys(callbacks), callbacks):
        try:
            state = callback.state_dict()
        except Exception as e:
            callback_failed(e, callback, "state_dict", step)
            raise
        if state is not None:
            states[key] = state
    return states


def load_callback_states(callbacks: Sequence[Callback], saved: Dict[str, Any],
                         step: int) -> None:
    """Gives each callback its state from a checkpoint's `saved` ones (callback_states); an
    error raised in one of one's own keeps its traceback, with a line naming it: not the
    checkpoint's fault (it was said as the optimizer's state not fitting the run)."""
    for key, callback in zip(callback_keys(callbacks), callbacks):
        if key in saved:
            try:
                callback.load_state_dict(saved[key])
            except Exception as e:
                callback_failed(e, callback, "load_state_dict", step)
                raise

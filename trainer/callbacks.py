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

    def validation_stopped(self, loop: "Loop") -> None:
        """When a preemption signal or a Ctrl-C stopped an epoch's validation (on any rank:
        the ranks agree at its sums), before the run stops: the loop's state is the trained
        one, as its last step left it, so that the resumed run validates first
        (checkpointing saves it and raises Preempted)."""

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


def call_hook(callback: Callback, hook: str, step: int, *args: Any) -> Any:
    """`callback.<hook>(*args)`, an error raised in one of one's own noted with the hook and
    `step` (callback_failed). The hooks outside the hot loop; after_step's is inline there."""
    try:
        return getattr(callback, hook)(*args)
    except Exception as e:
        callback_failed(e, callback, hook, step)
        raise


def callback_states(callbacks: Sequence[Callback], step: int) -> Dict[str, Any]:
    """The callbacks' own states (Callback.state_dict) by their keys (callback_keys), for a
    checkpoint."""
    states = {}
    for key, callback in zip(callback_keys(callbacks), callbacks):
        state = call_hook(callback, "state_dict", step)
        if state is not None:
            states[key] = state
    return states


def load_callback_states(callbacks: Sequence[Callback], saved: Dict[str, Any],
                         step: int) -> None:
    """Gives each callback its state from a checkpoint's `saved` ones (callback_states); an
    error raised in one of one's own is its own, not the checkpoint's (it was said as the
    optimizer's state not fitting the run)."""
    for key, callback in zip(callback_keys(callbacks), callbacks):
        if key in saved:
            call_hook(callback, "load_state_dict", step, saved[key])

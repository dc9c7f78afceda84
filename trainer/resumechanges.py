"""What a resume changes against the checkpoint it continues, and which of those changes apply.

The policy: what the checkpoint's optimizer or scheduler state holds (the optimizer's lr,
betas, weight decay...; a torch scheduler's step size or gamma) continues from it, since that
state is loaded over what this run built; how the optimizer computes (fused, foreach) is this
run's; everything else (the data, the batch, the task, the schedule's length, a schedule shape
its state does not hold, such as warmup_steps) follows this run's config. The run's
`config.yaml` and its checkpoints record the values that apply: a key the checkpoint's state
kept is written with the checkpoint's value, so that a later resume from them compares against
what the run used.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from trainer import checkpoint

# optimizer settings of how it computes, not what: a resumed run applies its own
# (checkpoint.load_optimizer_state)
IMPLEMENTATION_KEYS = tuple(f"optim.{k}" for k in checkpoint.IMPLEMENTATION)
APPLIED = " (applied: how the optimizer computes, not its state)"
# what a resume compares: keys whose change alters the optimisation
RESUME_KEYS = ("seed", "data.batch_size", "trainer.accumulate_grad_batches", "data.dataset",
               "data.train_dataset", "data.val_dataset", "data.collate_fn", "optim", "sched",
               "task", "model", "trainer.precision", "trainer.grad_clip",
               "trainer.max_epochs", "trainer.max_steps")  # the last two: the schedule's length
STATES = {"optim": "optimizer", "sched": "scheduler"}  # config group -> its state's name
LENGTH_KEYS = ("trainer.max_epochs", "trainer.max_steps")
# (a cosine that had ended rises again: said where it happens, not only in the README)
LENGTH = " (the lr schedule spans the new length from its position)"


def _get(tree: Dict[str, Any], dotted: str) -> Any:
    """`tree["a"]["b"]` for "a.b"; None where a level is missing."""
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def flat(value: Any, prefix: str) -> Dict[str, Any]:
    """`value`'s leaves as dotted keys under `prefix` (an empty mapping is one leaf, {})."""
    if isinstance(value, dict):
        out: Dict[str, Any] = {}
        for k, v in value.items():
            out.update(flat(v, f"{prefix}.{k}"))
        return out or {prefix: {}}
    return {prefix: value}


def held(key: str, state: Dict[str, Any]) -> Tuple[bool, Any]:
    """Whether the checkpoint's optimizer or scheduler state holds the config key `key` (an
    argument of the optimizer, as its first parameter group has it, or a scheduler's), and
    its value there."""
    group, _, name = key.partition(".")
    if group not in STATES or not name or "." in name or name.startswith("_"):
        return False, None
    if group == "optim":
        groups = (state.get("optimizer") or {}).get("param_groups") or [{}]
        values = groups[0] if name != "params" else {}
    else:
        values = state.get("scheduler") or {}
    if name not in values:
        return False, None
    value = values[name]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return True, list(value) if isinstance(value, tuple) else value


def resume_changes(state: Dict[str, Any], cfg: DictConfig, saved_world: int, world: int
                   ) -> Tuple[List[str], Dict[str, Any]]:
    """`key old -> new` for every optimisation setting the run changes against the checkpoint
    `state` it resumes from, and the changed keys the checkpoint's state keeps, with the value
    that applies (CheckpointError for an optimizer of another class: its state cannot
    apply)."""
    saved = state.get("config") or {}
    now = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    old_optim = (saved.get("optim") or {}).get("_target_")
    if old_optim and old_optim != now["optim"].get("_target_"):
        raise checkpoint.CheckpointError(
            f"optim._target_={now['optim'].get('_target_')}: the checkpoint holds the state of "
            f"{old_optim}, which cannot apply to another optimizer; resume with that optimizer "
            "or start a new run dir")
    changes = [] if saved_world == world else [f"world size {saved_world} -> {world}"]
    kept: Dict[str, Any] = {}
    for key in RESUME_KEYS:
        a, b = flat(_get(saved, key), key), flat(_get(now, key), key)
        for k in sorted(set(a) | set(b)):
            if a.get(k) == b.get(k):
                continue
            # (a key one side lacks is unset there: its class's default, not None)
            line = f"{k} {a[k] if k in a else '(unset)'} -> {b[k] if k in b else '(unset)'}"
            is_held, value = held(k, state)
            if k in IMPLEMENTATION_KEYS:
                line += APPLIED
            elif k in LENGTH_KEYS:
                line += LENGTH
            elif is_held:
                kept[k] = a[k] if k in a else value  # (as the checkpoint's run configured it)
                line += f" (kept at {kept[k]}: the checkpoint's {STATES[k.split('.')[0]]} " \
                        "state holds it)"
            changes.append(line)
    return changes, kept


def changes_line(changes: List[str]) -> str:
    """The log line for a resume's `resume_changes`: the changes, and where the checkpoint's
    state keeps some, what that means."""
    line = "resuming with changed settings: " + "; ".join(changes)
    if not any(" (kept at " in c for c in changes):
        return line
    return (line + ". What the checkpoint's optimizer or scheduler state holds continues from "
            "it, and config.yaml records that; a new run (no trainer.resume) applies them")


def record_kept(cfg: DictConfig, kept: Dict[str, Any]) -> None:
    """Writes the values the checkpoint's state kept into the run's config, so that its
    config.yaml and checkpoints say what the run used."""
    with open_dict(cfg):
        for key, value in kept.items():
            OmegaConf.update(cfg, key, value, force_add=True)


def check_schedule_kind(cfg: DictConfig, state: Dict[str, Any], scheduler: Any,
                         path: Path) -> None:
    """A resume under another schedule (sched=...) whose scheduler is of another kind: the
    checkpoint's state would be loaded into it (a LambdaLR's into StepLR, silently) or fail on
    a key of its own. Schedules of one kind (those built on LambdaLR) take each other's."""
    old = ((state.get("config") or {}).get("sched") or {}).get("_target_")
    saved = state.get("scheduler")
    if old is None or old == cfg.sched.get("_target_") or not isinstance(saved, dict):
        return

    def public(keys):  # (torch adds private keys, and dropped `verbose`, across versions)
        return {k for k in keys if not k.startswith("_") and k != "verbose"}

    theirs, mine = public(saved), public(scheduler.state_dict())
    if theirs != mine:
        raise checkpoint.CheckpointError(
            f"sched._target_={cfg.sched._target_}: the checkpoint's scheduler state is of "
            f"another kind ({old}'s, holding {', '.join(sorted(theirs - mine or theirs))}), "
            f"which this schedule cannot continue; resume with sched._target_={old}, or start "
            f"a new run dir from its weights (trainer.init_from={path})")

"""A run continued in its own dir keeps its own settings: `python train.py trainer.resume=auto
hydra.run.dir=outputs/my-run` takes the overrides the run was launched with (its
`.hydra/overrides.yaml`) wherever the command does not set the key again, before Hydra composes
the config. Left out, they fell back to their defaults without a word of warning (a run of
`trainer.max_epochs=60` resumed in the short form ended at the default 20, exit 0). So does a
checkpoint validated with `trainer.validate_only=true trainer.init_from=<run>/checkpoints/X.pt`:
its run's model, task and data, as that run was launched.

A key the command sets wins over the run's (`trainer.max_epochs=100` extends it), and a config
group it chooses otherwise than the run did drops the run's settings inside the group
(`model=mlp` leaves out the run's `model.channels=[4,8]`, which were the cnn's; `model=cnn`
again keeps them). A `~key` of the command deletes the run's key after it is carried. Only a
resume in place (`trainer.resume=auto`, or a checkpoint inside `hydra.run.dir`, both on the
command line) or a validation of a run's checkpoint; not a sweep (`-m`), whose jobs'
overrides are the sweep's own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from trainer.checkpoint import CHECKPOINT_DIR

CARRIED: List[str] = []  # what this launch took from its run's record, said at start-up
DELETED: List[str] = []  # of those, the ones a ~key of the command deletes after
DROPPED: List[str] = []  # the record's keys inside a config group the command chose otherwise
RECORD: Optional[Path] = None  # the record it took them from
RESUMED: Optional[Path] = None  # the run dir a resume in place continues

# Hydra's flags that take a value (`--config-dir conf=x`: the value is no override)
_VALUE_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-c",
                "--cfg", "-p", "--package", "--experimental-rerun")
# a resume names its own: not the run's
_OWN = ("trainer.resume", "trainer.init_from", "trainer.validate_only")


def _overrides(args: Sequence[str]) -> Optional[list]:
    """Hydra's parse of the overrides among `args` (None where Hydra would refuse them: it
    says so itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(list(args))
    except Exception:  # noqa: BLE001  (Hydra's own error follows, in its words)
        return None


def _override_positions(args: Sequence[str]) -> List[int]:
    return [i for i, a in enumerate(args) if not a.startswith("-")
            and ("=" in a or a.startswith("~")) and not (i and args[i - 1] in _VALUE_FLAGS)]


def _in_place(resume: object, run_dir: Path) -> bool:
    """Whether trainer.resume's value continues the run in `run_dir` (auto, or one of its
    own checkpoints, as the resume itself tells them: resumefiles.in_run_dir)."""
    from trainer.resumefiles import in_run_dir

    return resume == "auto" or (isinstance(resume, str) and in_run_dir(Path(resume), run_dir))


def _source(by_key: Dict[str, Any]) -> Optional[Path]:
    """The run dir whose record this launch takes: a resume's in place, or the run of the
    checkpoint trainer.validate_only validates (`<run>/checkpoints/<file>`)."""
    resume, run = by_key.get("trainer.resume"), by_key.get("hydra.run.dir")
    if resume is not None and run is not None and not resume.is_delete() \
            and not run.is_delete():
        run_dir = run.value()
        if isinstance(run_dir, str) and "${" not in run_dir and \
                _in_place(resume.value(), Path(run_dir)):
            global RESUMED
            RESUMED = Path(run_dir)
            return RESUMED
    validate, weights = by_key.get("trainer.validate_only"), by_key.get("trainer.init_from")
    if validate is None or validate.value() is not True or weights is None or \
            not isinstance(weights.value(), str):
        return None
    folder = Path(weights.value()).parent
    return folder.parent if folder.name == CHECKPOINT_DIR else None


def _choices(run_dir: Path) -> Dict[str, Any]:
    """The config groups' choices the run was composed with (its `.hydra/hydra.yaml`)."""
    try:
        from omegaconf import OmegaConf

        choices = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.choices
        return dict(OmegaConf.to_container(choices))
    except Exception:  # noqa: BLE001  (none: the recorded overrides' choices tell)
        return {}


def _chosen_otherwise(key: str, command: Dict[str, Any], run: Dict[str, Any]) -> Optional[str]:
    """The group override of the command under which `key` lies, where it chooses otherwise
    than the run did; None where it chooses none, or the same."""
    for group, o in command.items():
        if key.startswith((group + ".", group + "/")) and not o.is_delete() and \
                str(o.value()) != str(run.get(group)):
            return o.input_line
    return None


def with_runs_own(args: List[str]) -> List[str]:
    """`args` (the command line's, after the script) with the run's own overrides put before
    the command's where it continues or validates a run and leaves them out (module
    docstring); `args` as they are otherwise. Sets CARRIED, DROPPED and RECORD."""
    global RECORD, RESUMED
    CARRIED.clear()
    DROPPED.clear()
    DELETED.clear()
    RECORD = RESUMED = None
    if any(a in ("-m", "--multirun") for a in args) or "hydra.mode=MULTIRUN" in args:
        return args
    at = _override_positions(args)
    given = _overrides([args[i] for i in at])
    if not given:
        return args
    by_key = {o.key_or_group: o for o in given}
    run_dir = _source(by_key)
    if run_dir is None:
        return args
    record = run_dir / ".hydra" / "overrides.yaml"
    try:
        from omegaconf import OmegaConf

        own = OmegaConf.to_container(OmegaConf.load(record))
    except Exception:  # noqa: BLE001  (none, or unreadable: the command's own as they are)
        return args
    parsed = _overrides(own) if isinstance(own, list) and \
        all(isinstance(a, str) for a in own) else None
    if not parsed:
        return args
    choices = {**_choices(run_dir), **{o.key_or_group: o.value() for o in parsed}}
    stated = {k for k, o in by_key.items() if not o.is_delete()}  # (~key: deletes it after)
    for o in parsed:
        key = o.key_or_group
        if key in _OWN or key == "hydra" or key.startswith(("hydra.", "hydra/")) or \
                key in stated:
            continue
        otherwise = _chosen_otherwise(key, by_key, choices)
        (DROPPED if otherwise else CARRIED).append(o.input_line)
        if not otherwise and any(o2.is_delete() and (key == k or key.startswith(k + "."))
                                 for k, o2 in by_key.items()):
            DELETED.append(o.input_line)  # (carried, so that the ~key has a key to delete)
    RECORD = record
    return args[:at[0]] + CARRIED + args[at[0]:]


def said() -> Optional[str]:
    """The start-up line naming what this launch took from its run's record, if anything."""
    if not CARRIED and not DROPPED:
        return None
    kept = [a for a in CARRIED if a not in DELETED]
    took = (f"the run's own overrides that this command does not set again apply: "
            f"{' '.join(kept)}" if kept else "none of the run's own overrides apply") + (
        f"; deleted by the command's ~key: {' '.join(DELETED)}" if DELETED else "")
    what = "resume" if RECORD is not None and RECORD.parent.parent == RESUMED else \
        "trainer.validate_only"
    return f"{what}: {took}{_left()} (from {RECORD}; a key set on the command line wins)"


def _left() -> str:
    return f"; left out, in a config group chosen otherwise: {' '.join(DROPPED)}" \
        if DROPPED else ""


def took() -> str:
    """What an error line of this launch ends with where it took anything from its run's
    record (a key the error names may be the run's, not the command's); "" otherwise."""
    if not CARRIED and not DROPPED:
        return ""
    return (f" (this launch took the run's own overrides {' '.join(CARRIED)} from {RECORD}"
            f"{_left()})")

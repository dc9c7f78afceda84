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
again keeps them). A `~key` of the command deletes the run's key after it is carried. The
run's `--config-dir`, `--config-name` and `--config-path` come too where the command gives
none of its own (its `.hydra/hydra.yaml` records them). Only a
resume in place (`trainer.resume=auto`, or a checkpoint inside `hydra.run.dir`, both on the
command line) or a validation of a run's checkpoint; not a sweep (`-m`), whose jobs'
overrides are the sweep's own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from trainer.checkpoint import CHECKPOINT_DIR

CARRIED: List[str] = []  # what this launch took from its run's record, said at start-up
DELETED: List[str] = []  # of those, the ones a ~key of the command deletes after
DROPPED: List[str] = []  # the record's keys inside a config group the command chose otherwise
FLAGS: List[str] = []  # the run's --config-dir/--config-name/--config-path, the command's own not
RECORD: Optional[Path] = None  # the record it took them from
RESUMED: Optional[Path] = None  # the run dir a resume in place continues

# Hydra's flags that take a value (`--config-dir conf=x`: the value is no override)
_VALUE_FLAGS = ("-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir", "-c",
                "--cfg", "-p", "--package", "--experimental-rerun")
# a resume names its own: not the run's
_OWN = ("trainer.resume", "trainer.init_from", "trainer.validate_only")
# a validation of a run's checkpoint takes what it computes with, not how that run trained:
# the weights it was initialised from, and the debug modes (a profile, a fast dev run)
_TRAINING = ("trainer.init_strict", "trainer.profile", "trainer.fast_dev_run", "debug")


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
    """The run dir whose record this launch takes: the run of the checkpoint
    trainer.validate_only validates (`<run>/checkpoints/<file>`; a `trainer.resume=auto`
    beside it, as the SLURM script passes, is no resume), or a resume's in place."""
    validate, weights = by_key.get("trainer.validate_only"), by_key.get("trainer.init_from")
    if validate is not None and validate.value() is True:
        if weights is None or not isinstance(weights.value(), str):
            return None
        folder = Path(weights.value()).parent
        return folder.parent if folder.name == CHECKPOINT_DIR else None
    resume, run = by_key.get("trainer.resume"), by_key.get("hydra.run.dir")
    if resume is not None and run is not None and not resume.is_delete() \
            and not run.is_delete():
        run_dir = run.value()
        if isinstance(run_dir, str) and "${" not in run_dir and \
                _in_place(resume.value(), Path(run_dir)):
            global RESUMED
            RESUMED = Path(run_dir)
            return RESUMED
    return None


def _hydras(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _hydras_record(run_dir: Path) -> Tuple[Dict[str, Any], list, List[str]]:
    """What the run's `.hydra/hydra.yaml` records: the config groups' choices it was composed
    with ({} where unreadable: the recorded overrides' choices tell), its `hydra.searchpath=...`
    override, parsed ([] without one; Hydra keeps it there, not in overrides.yaml), and the
    flags that said where its config came from (`--config-dir`, `--config-name`,
    `--config-path`): where the run's own config and config groups are found."""
    from trainer.resumefiles import config_flags

    try:
        from omegaconf import OmegaConf

        hydra = OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra
    except Exception:  # noqa: BLE001
        return {}, [], []
    try:
        flags = config_flags(hydra)
    except Exception:  # noqa: BLE001
        flags = []
    try:
        choices = dict(OmegaConf.to_container(hydra.runtime.choices))
    except Exception:  # noqa: BLE001
        choices = {}
    try:
        lines = [a for a in hydra.overrides.hydra
                 if isinstance(a, str) and a.startswith("hydra.searchpath=")]
    except Exception:  # noqa: BLE001
        lines = []
    return choices, (_overrides(lines) or []) if lines else [], flags


def _flags_not_given(args: Sequence[str], flags: List[str]) -> List[str]:
    """Of the run's config flags (pairs: `--config-dir`, a path), those the command gives no
    value of its own for, in either spelling."""
    spellings = {"--config-name": "-cn", "--config-dir": "-cd", "--config-path": "-cp"}
    out = []
    for flag, value in zip(flags[::2], flags[1::2]):
        names = (flag, spellings[flag])
        if not any(a in names or a.startswith(tuple(n + "=" for n in names)) for a in args):
            out += [flag, value]
    return out


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
    FLAGS.clear()
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
    parsed = _record(record)
    if parsed is None:
        return args
    choices, search_path, flags = _hydras_record(run_dir)
    parsed = search_path + parsed
    FLAGS[:] = _flags_not_given(args, flags)
    if not parsed and not FLAGS:
        return args
    args = _added_again(args, at, given, parsed)
    choices.update({o.key_or_group: o.value() for o in parsed})
    stated = {k for k, o in by_key.items() if not o.is_delete()}  # (~key: deletes it after)
    skipped = _OWN + (_TRAINING if RESUMED is None else ())
    for o in parsed:
        key = o.key_or_group
        if key in skipped or (_hydras(key) and key != "hydra.searchpath") or \
                key in stated or (o.is_delete() and key in by_key):  # (deleted once)
            continue  # (the run's search path: where its own config groups are found)
        otherwise = _chosen_otherwise(key, by_key, choices)
        (DROPPED if otherwise else CARRIED).append(o.input_line)
        if not otherwise and any(o2.is_delete() and (key == k or key.startswith(k + "."))
                                 for k, o2 in by_key.items()):
            DELETED.append(o.input_line)  # (carried, so that the ~key has a key to delete)
    RECORD = record
    return FLAGS + args[:at[0]] + CARRIED + args[at[0]:]


def _record(record: Path) -> Optional[list]:
    """The overrides a run's record lists, parsed (None where there is no record). A record
    that cannot be read is one line: its run's settings would otherwise fall back to their
    defaults without a word, and the record be overwritten with the command's alone."""
    if not record.exists():
        return None
    from omegaconf import OmegaConf

    from trainer.config import ConfigError

    try:
        own = OmegaConf.to_container(OmegaConf.load(record))
    except Exception as e:  # noqa: BLE001
        why = f"cannot be read ({' '.join(str(e).split())[:160]})"
    else:
        parsed = _overrides(own) if isinstance(own, list) and \
            all(isinstance(a, str) for a in own) else None
        if parsed is not None:
            return parsed
        why = "is not a list of overrides Hydra can parse"
    raise ConfigError(f"{record}: the run's record of its overrides {why}; this launch would "
                      "take the run's own settings from it: mend it (one override a line, "
                      "'- key=value'), or delete it to give every setting on the command line")


def _added_again(args: List[str], at: List[int], given: list, parsed: list) -> List[str]:
    """`args` with a key the run added (`+key=a` or `++key=a` in its record) and the command
    sets again plainly (`key=b`) given as a forced addition (`++key=b`): the key is not in
    the config without the run's `+` (or is, where the command chose a group that has it),
    and the command's value is to win."""
    added = {o.key_or_group for o in parsed if o.is_add() or o.is_force_add()}
    out = list(args)
    for i, o in zip(at, given):
        if o.key_or_group in added and not o.is_add() and not o.is_force_add() and \
                not o.is_delete():
            out[i] = "++" + args[i]
    return out


def said() -> Optional[str]:
    """The start-up line naming what this launch took from its run's record, if anything."""
    if not CARRIED and not DROPPED and not FLAGS:
        return None
    kept = FLAGS + [a for a in CARRIED if a not in DELETED]
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
    if not CARRIED and not DROPPED and not FLAGS:
        return ""
    carried = f"the run's own overrides {' '.join(FLAGS + CARRIED)}" if CARRIED or FLAGS else \
        "none of the run's own overrides"
    return f" (this launch took {carried} from {RECORD}{_left()})"

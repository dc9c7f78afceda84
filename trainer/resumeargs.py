"""A run continued in its own dir keeps its own settings: `python train.py trainer.resume=auto
hydra.run.dir=outputs/my-run` takes the overrides the run was launched with (its
`.hydra/overrides.yaml`) wherever the command does not set the key again, before Hydra composes
the config. Left out, they fell back to their defaults without a word of warning (a run of
`trainer.max_epochs=60` resumed in the short form ended at the default 20, exit 0).

A key the command sets wins over the run's (`trainer.max_epochs=100` extends it), and a config
group it chooses again drops the run's settings inside the group (`model=mlp` leaves out the
run's `model.width=32`, which was the cnn's). Only a resume in place: `trainer.resume=auto`, or a
checkpoint inside `hydra.run.dir`, both on the command line; not a sweep (`-m`), whose jobs'
overrides are the sweep's own.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

CARRIED: List[str] = []  # what this launch took from its run's record, said at start-up
RECORD: Optional[Path] = None  # the record it took them from


def _overrides(args: Sequence[str]) -> Optional[list]:
    """Hydra's parse of the overrides among `args` (None where Hydra would refuse them: it
    says so itself)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(list(args))
    except Exception:  # noqa: BLE001  (Hydra's own error follows, in its words)
        return None


def _is_override(arg: str) -> bool:
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


def _in_place(resume: object, run_dir: Path) -> bool:
    """Whether trainer.resume's value continues the run in `run_dir`."""
    if resume == "auto":
        return True
    if not isinstance(resume, str):
        return False
    return run_dir.resolve() in Path(resume).resolve().parents


def _replaced(key: str, stated: Sequence[str]) -> bool:
    """Whether the command sets `key` again, or chooses again the config group it is in."""
    return any(key == k or key.startswith((k + ".", k + "/")) for k in stated)


def with_runs_own(args: List[str]) -> List[str]:
    """`args` (the command line's, after the script) with the run's own overrides put before
    the command's where it resumes a run in place and leaves them out (module docstring);
    `args` as they are otherwise. Sets CARRIED and RECORD."""
    global RECORD
    CARRIED.clear()
    RECORD = None
    if any(a in ("-m", "--multirun") for a in args):
        return args
    at = [i for i, a in enumerate(args) if _is_override(a)]
    given = _overrides([args[i] for i in at])
    if not given:
        return args
    by_key = {o.key_or_group: o for o in given}
    resume, run = by_key.get("trainer.resume"), by_key.get("hydra.run.dir")
    if resume is None or run is None or resume.is_delete() or run.is_delete():
        return args
    run_dir = run.value()
    if not isinstance(run_dir, str) or "${" in run_dir or not _in_place(resume.value(),
                                                                        Path(run_dir)):
        return args
    record = Path(run_dir) / ".hydra" / "overrides.yaml"
    try:
        from omegaconf import OmegaConf

        own = OmegaConf.to_container(OmegaConf.load(record))
    except Exception:  # noqa: BLE001  (none, or unreadable: the command's own as they are)
        return args
    if not isinstance(own, list) or not all(isinstance(a, str) for a in own):
        return args
    parsed = _overrides(own)
    if parsed is None:
        return args
    stated = list(by_key)
    carried = [o.input_line for o in parsed
               if o.key_or_group != "trainer.resume" and not o.key_or_group.startswith("hydra")
               and not _replaced(o.key_or_group, stated)]
    if not carried:
        return args
    CARRIED.extend(carried)
    RECORD = record
    return args[:at[0]] + carried + args[at[0]:]


def said() -> Optional[str]:
    """The start-up line naming what this launch took from its run's record, if anything."""
    if not CARRIED:
        return None
    return (f"resume: the run's own overrides that this command does not set again apply: "
            f"{' '.join(CARRIED)} (from {RECORD}; a key set on the command line wins)")

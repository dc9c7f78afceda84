"""What a run settles before its first step (the ranks' agreement on settings and data is
trainer/agreement's): that the optimizer steps the way the loop calls it, which checkpoint it
continues from, loaded into the built loop; and the run's files, opened once its first step
succeeded."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from data.advice import count_of
from trainer import (checkpoint, distributed, ending, resumeargs, resumefiles,
                     rundir, schedules, stamp)
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError, plain
from trainer.overrides import override_key
from trainer.distributed import DistEnv
from trainer.logging import RunLogger, write_whole
from trainer.loop import Callback, Loop
from trainer.progress import rest_plan, steps_left, total_steps
from trainer.weights import check_model_state, init_weights, not_read_line
from trainer.resilience import Checkpointing, set_rng_state
from trainer.resumechanges import (changes_line, check_schedule_kind, flat, record_kept,
                                   resume_changes)
from trainer.strategy import unwrap


def resume_setting(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    """trainer.resume, except that a job torchrun restarted continues its own run (the run
    dir's status.json names this job) from the dir's newest checkpoint: a path given for the
    first attempt would roll the run back to it. While the dir holds none, or holds no run of
    this job (the first attempt failed before its first step), it is as given."""
    resume = cfg.trainer.resume
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and \
            rundir.this_jobs(run_dir) and resumefiles.candidates(run_dir):
        return "auto"
    return resume


def restore(cfg: DictConfig, env: DistEnv, run_dir: Path, loop: Loop,
             resume: Optional[str], gpus: List[torch.device]
             ) -> Tuple[List[str], List[str], Optional[Path]]:
    """Loads the checkpoint `resume` names into the built loop, if any; returns the warnings
    and the lines to log about it, which the caller logs once every check passed, and the
    file it resumed from."""
    found = resumefiles.find_resume(resume, run_dir)
    if found is None:
        lines = _fresh_start(cfg, run_dir, loop, resume)
        if resume == "auto" and stamp.is_launch_stamp(str(run_dir)):  # (a mistake, surely)
            key = rundir.dir_key()
            what = "sweep" if key == "hydra.sweep.dir" else "run"
            return [f"trainer.resume=auto: nothing to resume in {run_dir}, a new dir: {key} "
                    f"was left at its default (a new dated dir for every launch); name the "
                    f"{what} to continue with {key}=..."], lines[1:], None
        return [], lines, None
    path, state, skipped = found
    if cfg.trainer.fast_dev_run:  # (its one step is the run's first: resumed, it trained none)
        raise ConfigError(f"trainer.fast_dev_run=true (debug=fdr) trains a run's first step "
                          f"alone and saves nothing, and trainer.resume={resume} would continue "
                          f"{path} at step {state['step']}: nothing would be trained; drop "
                          "trainer.resume or start in a new dir")
    # damaged newer checkpoints, skipped for an older one that loads
    warnings = [f"{reason}; the previous checkpoint was used" for reason in skipped]
    rngs, old_world = state.get("rng", []), state.get("world_size", env.world_size)
    changes, kept = resume_changes(state, cfg, old_world, env.world_size)
    try:
        check_model_state(unwrap(loop.model), state, path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}{_launched_otherwise(cfg, state, path)}") from None
    check_schedule_kind(cfg, state, loop.scheduler, path)
    try:
        loop.load_training_state(state)
    except (ValueError, KeyError, RuntimeError) as e:  # parameter groups that do not fit
        raise CheckpointError(f"checkpoint {path}: its optimizer or scheduler state does not "
                              f"fit this run ({type(e).__name__}: {e})") from None
    loop.load_callback_states(state)
    over = _nothing_left(loop)  # (the restored position ends its epoch)
    warnings += _check_position(cfg, state, path, loop, old_world, over)
    record_kept(cfg, kept)  # (config.yaml and the checkpoints say what the run used)
    if not resumefiles.in_run_dir(path, run_dir):
        # another run's checkpoint: its final validation is that run's record, not this
        # one's, so a complete one is validated again here (on this world size) and
        # this run dir gets its own summary
        loop.state.validated_step = -1
    lines = []
    if resume != cfg.trainer.resume:
        lines.append(f"torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: resuming "
                     "from this run's newest checkpoint")
    # a run complete at this command's limits trains nothing (ending.nothing_to_do): what
    # the changed settings would do to it is not said (a schedule "moving", an lr "kept")
    done = loop.state.validated_step == loop.state.step and loop.reached_limit()
    if changes and not done:
        lines.append(changes_line(changes))
    if not done:
        moved, odd = _schedule_position(cfg, loop)
        (warnings if odd else lines).extend(moved)
    generator = loop.train_feed.loader.generator
    if len(rngs) == env.world_size:
        set_rng_state(rngs[env.rank], generator, gpus)
        loop.loader_rng = rngs[env.rank].get("loader")
    elif old_world != env.world_size:
        lines.append(f"the checkpoint was written by {count_of(old_world, 'rank')}, this job "
                     f"has {env.world_size}: the data position is kept in global samples "
                     f"({loop.state.position} into epoch {loop.state.epoch}); random states "
                     "start from the seed")
    # (whole global batches: the last one of an epoch may count past its samples; the end
    # of one that trainer.limit_train_batches or drop_last shortened: nothing left of it)
    ended = loop.state.position >= len(loop.train_feed.loader.dataset) or over
    into = "at the epoch's end" if ended else f"{loop.state.position} samples into the epoch"
    lines.append(f"resumed from {path} at epoch {state['epoch']} step {state['step']} "
                 f"({into})")
    if not resumefiles.in_run_dir(path, run_dir):
        lines += _complete_elsewhere(cfg, loop)
    if cfg.trainer.init_from is not None:
        line, odd = not_read_line(cfg.trainer.init_from, state, path, rundir.dir_key())
        (warnings if odd else lines).append(line)
    return warnings, lines, path


def _launched_otherwise(cfg: DictConfig, state: Dict[str, Any], path: Path,
                        verb: str = "resume") -> str:
    """For a checkpoint whose model does not fit: the model settings its run had that this
    launch has not (a short `trainer.resume=auto hydra.run.dir=...` that left out the
    run's own overrides), and where its whole resume command is (`verb`: what to do with
    them, resume or validate it)."""
    config = state.get("config") or {}
    saved = config.get("model")
    if not isinstance(saved, dict):
        return ""
    now = OmegaConf.to_container(cfg.model, resolve=True)
    theirs, ours = flat(saved, "model"), flat(now, "model")
    kept = OmegaConf.create(config)
    for key in _SIZES_THE_MODEL:  # (the data the model was sized for: another dataset's)
        theirs[key], ours[key] = (plain(OmegaConf.select(c, key, default=None), resolve=True)
                                  for c in (kept, cfg))
    differ = [k for k in dict.fromkeys([*theirs, *ours]) if theirs.get(k) != ours.get(k)]
    if not differ:
        return ""
    mine = _set_by_this_command(differ)
    advice = (f"this command sets {' '.join(mine)}: leave {'it' if len(mine) == 1 else 'them'} "
              f"out to {verb} the run as it was" if mine else
              f"{verb} it with the overrides it was launched with{_its_command(path, config)}")
    return (" (its run had other model settings: " + ", ".join(
        f"{k}={theirs.get(k, '(not set)')}" for k in differ[:3])
        + (f" (+{len(differ) - 3} more)" if len(differ) > 3 else "") + f"; {advice})")


def _set_by_this_command(keys: List[str]) -> List[str]:
    """The overrides of this launch's command line that set one of `keys` (or a group or
    key above one), as typed: a model setting changed on the command line, which the advice
    to give the run's own overrides would not mend (they may live in a config file)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    typed = list(HydraConfig.get().overrides.task)
    carried = set(resumeargs.CARRIED)  # (the run's own, put there by this launch)
    out = []
    for line in typed:
        key = override_key(line).replace("/", ".")
        if line not in carried and any(k == key or k.startswith(key + ".") for k in keys):
            out.append(line)
    return out


# the data settings a model is sized by (offered as its input_shape and num_classes)
_SIZES_THE_MODEL = ("data.input_shape", "data.num_classes", "data.dataset._target_",
                    "data.train_dataset._target_")


def _its_command(path: Path, config: Dict[str, Any]) -> str:
    """Where a checkpoint's run keeps the overrides it was launched with: its status.json's
    `resume` (a stopped run's), else Hydra's record of them (a finished run's too); the run
    its config names, where the file was copied from another run's dir (this dir's records
    are another run's)."""
    saved_in = config.get("run_dir")
    if isinstance(saved_in, str) and saved_in and path.parent.name == checkpoint.CHECKPOINT_DIR \
            and os.path.realpath(saved_in) != os.path.realpath(path.parent.parent) \
            and os.path.isdir(saved_in):  # (a run dir moved since: its records came with it)
        return (f"; the file was saved by the run in {saved_in}, not this dir's"
                + _its_command(Path(saved_in) / checkpoint.CHECKPOINT_DIR / path.name, {}))
    if path.parent.name != checkpoint.CHECKPOINT_DIR:
        return ""
    run = path.parent.parent
    try:
        said = json.loads((run / rundir.STATUS).read_text()).get("resume")
    except (OSError, ValueError, AttributeError):
        said = None
    if said:
        return f"; {run / rundir.STATUS}'s \"resume\" gives its whole command"
    overrides = run / ".hydra" / "overrides.yaml"
    return f"; {overrides} lists them" if overrides.is_file() else ""


def _fresh_start(cfg: DictConfig, run_dir: Path, loop: Loop, resume: Optional[str]
                 ) -> List[str]:
    """The lines of a run that resumes nothing: trainer.resume=auto's finding none, and the
    weights trainer.init_from loads (here, where no checkpoint's weights win over them)."""
    lines = ([f"trainer.resume=auto: no checkpoint in {run_dir / checkpoint.CHECKPOINT_DIR}: "
              f"a fresh start (the run to continue is named by {rundir.dir_key()})"]
             if resume == "auto" else [])
    if cfg.trainer.init_from is not None:
        validating = cfg.trainer.validate_only
        try:
            lines.append(init_weights(unwrap(loop.model), cfg.trainer.init_from,
                                      cfg.trainer.init_strict, training=not validating))
        except CheckpointError as e:
            if not validating:
                raise
            # the settings the file's run had, where it is a run's checkpoint
            path = Path(cfg.trainer.init_from)
            try:
                had = _launched_otherwise(cfg, checkpoint.load(path, "cpu"), path, "validate")
            except (CheckpointError, OSError, AttributeError):
                had = ""
            raise CheckpointError(f"{e}{had}") from None
        distributed.broadcast_weights(unwrap(loop.model))  # (one model, whatever each read)
        # config.yaml and the checkpoints name the file wherever a later launch runs from
        # (a requeue compares it: not_read_line)
        record_kept(cfg, {"trainer.init_from": str(Path(cfg.trainer.init_from).resolve())})
    return lines


def _complete_elsewhere(cfg: DictConfig, loop: Loop) -> List[str]:
    """Another run's checkpoint that completed its run (its limit, or early stopping): the
    line saying this run trains nothing and validates it again for its own record."""
    complete = ending.complete_because(cfg, loop)
    if complete is None:
        return []
    why, how = complete
    return [f"nothing to train: its run is complete ({why}); it is validated again for this "
            f"run dir's record; {how}"]


def _check_position(cfg: DictConfig, state: Dict[str, Any], path: Path, loop: Loop,
                    old_world: int, over: bool) -> List[str]:
    """CheckpointError for a restored position past the end of this run's training set (the
    checkpoint's data was another); a warning when its run had another number of samples
    (`over`: the position ends its epoch, `_nothing_left`)."""
    # a sanity bound: the position counts whole global batches (an epoch's last one may pass
    # the dataset's end: 23 x 64 = 1472 for 1438 samples), and a checkpoint at an epoch's last
    # step is saved before it resets to 0
    n = len(loop.train_feed.loader.dataset)
    old_batch = ((state.get("config") or {}).get("data") or {}).get("batch_size") \
        or cfg.data.batch_size
    had = state.get("train_samples")
    if loop.state.position > n + int(old_batch) * old_world:
        raise CheckpointError(f"checkpoint {path}: its position, {loop.state.position} samples "
                              f"into epoch {loop.state.epoch}, is past the end of this run's "
                              f"{n} training samples ("
                              + (f"its run had {had}" if had is not None else "another dataset?")
                              + "); resume over the data it trained on, or start a new run "
                              f"from its weights alone: trainer.init_from={path}")
    said = _held_out_changed(state, path, loop)
    if had is None or had == n:  # (the sampler's order is a function of the length)
        return said
    if over:  # (within the last global batch of the smaller set)
        return [f"checkpoint {path}: its run had {had} training samples, this one has {n}: "
                f"epoch {loop.state.epoch} of them ends before its position, "
                f"{loop.state.position} samples in, so it is over (validated first where it "
                "was not); later epochs are whole", *said]
    return [f"checkpoint {path}: its run had {had} training samples, this one has {n}: epoch "
            f"{loop.state.epoch} goes on {loop.state.position} samples in, over another order "
            "of them (some may come twice in it, or not at all); later epochs are whole", *said]


def _nothing_left(loop: Loop) -> bool:
    """Whether the restored position leaves nothing of its epoch to train (the end of one
    that trainer.limit_train_batches, drop_last or a smaller set shortened). The sampler's
    start is put back: the run's plan (total_steps) counts whole epochs."""
    loader, position = loop.train_feed.loader, loop.state.position
    sampler = getattr(loader, "sampler", None)
    if not position or not hasattr(sampler, "set_start"):
        return False
    before = sampler.start
    try:
        return not rest_plan(loader, loop.train_limit, loop.cfg.accumulate_grad_batches,
                             position, loader.batch_size * loop.world)
    finally:
        sampler.start = before


def _held_out_changed(state: Dict[str, Any], path: Path, loop: Loop) -> List[str]:
    """A warning where the checkpoint's run held out other validation files than this run's
    draw (data.dataset.val_fraction draws them anew when a class's files change): the model
    trained on some of the files it is now validated on, which nothing said."""
    had = state.get("held_out")
    now = getattr(getattr(loop.val_feed, "source", None), "held_out", None)
    if had is None or now is None or had == now:
        return []
    return [f"checkpoint {path}: its run held out other validation files than this one "
            "(data.dataset.val_fraction draws them from each class's files, which changed): "
            "the model has trained on some of the files it is now validated on, so its "
            "validation values are no longer of unseen data; put the files back as they were, "
            "or start a new run"]


def _schedule_position(cfg: DictConfig, loop: Loop) -> Tuple[List[str], bool]:
    """A resume whose steps per epoch differ from its checkpoint's (another world size, batch
    or accumulation) moves a schedule that spans the run (built with its step count: the
    warmup_cosine) to the step its position would have under this run's plan: the schedule
    then ends where the run does, its lr going on from the point of the run it reached
    (counted in its old steps, a cosine would be cut short or run past its end). A schedule
    of a step count of one's own (StepLR's step_size) counts on in steps. The line saying
    so, and whether it is a warning (a schedule with no formula of the step to move by
    stays where it is)."""
    t, scheduler = cfg.trainer, loop.scheduler
    if not schedules.spans_the_run(scheduler):
        return [], False
    loader = loop.train_feed.loader
    left = steps_left(loader, loop.train_limit, t.accumulate_grad_batches, loop.state,
                      t.max_epochs, t.max_steps)
    now = getattr(scheduler, "last_epoch", None)
    if left is None or not isinstance(now, int):
        return [], False
    total = total_steps(cfg, loader, loop.train_limit)[0]
    target = max(0, total - left)
    if target == now:
        return [], False
    lr = loop.optimizer.param_groups[0]["lr"]
    why = (f"this run's plan puts its position at step {target} of the {total} its schedule "
           f"spans ({left} left)")
    if not schedules.move_to(scheduler, target):
        own = getattr(scheduler, "total_steps", None)  # (OneCycleLR's: the checkpoint's)
        if isinstance(own, int) and now + left > own:
            raise ConfigError(
                f"sched: {type(scheduler).__name__} spans the checkpoint's {own} steps, and "
                f"from its step {now} this run takes {left} more (another world size, batch "
                "or accumulation): it would step past its end; resume with the checkpoint's, "
                "or start a new run")
        return [f"the lr schedule ({type(scheduler).__name__}) stays at its step {now}, while "
                f"{why}: it has no formula of the step to move by, so its lr no longer follows "
                "the run's progress; resume with the checkpoint's world size, batch and "
                "accumulation, or start a new run"], True
    return [f"the lr schedule moves from its step {now} to {target}: {why}, so that it ends "
            f"with the run (lr {lr:.4g} -> {loop.optimizer.param_groups[0]['lr']:.4g})"], False


def check_optimizer_step(optimizer) -> None:
    """The loop calls `optimizer.step()` once per window, with no closure."""
    import inspect

    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is closure.empty:
        raise ConfigError(f"optim: {type(optimizer).__name__}.step() needs a closure that "
                          "evaluates the loss again (several times a step), which the loop, "
                          "one forward and backward per micro-batch, does not give; use an "
                          "optimizer stepped without one (adamw, sgd, ...)")


class FirstStepOutputs(Callback):
    """Opens the run's files (`open_outputs`) once: after the first optimizer step, or at
    the logger's first write if that comes first (the same step's metrics row). `writing`:
    from then on, the run dir holds this run's files (rank 0)."""

    def __init__(self, cfg: DictConfig, env: DistEnv, run_dir: Path, logger: RunLogger,
                 loop: Loop, checkpointing: Checkpointing):
        self.args = (cfg, env, run_dir, logger, loop.train_feed)
        self.checkpointing = checkpointing
        self.logger = logger
        # where the run starts: rows a killed attempt logged past it leave metrics.jsonl
        self.step, self.validated_step = loop.state.step, loop.state.validated_step
        self.opened = False

    @property
    def writing(self) -> bool:
        return self.opened and self.logger.write

    def open(self) -> None:
        if not self.opened:
            self.opened = True
            open_outputs(*self.args, self.step, self.validated_step)
            if self.logger.write:
                self.checkpointing.set_aside(self.step, self.logger.dropped_rows)

    def after_step(self, loop) -> None:
        self.open()


def open_outputs(cfg: DictConfig, env: DistEnv, run_dir: Path, logger: RunLogger,
                 train_feed, step: int, validated_step: int) -> None:
    """The run's files, from rank 0, once every check passed: the resolved config, Hydra's
    record, the class names of a dataset that has them (`classes.json`: class i is the i-th
    name), metrics.jsonl and TensorBoard."""
    if not logger.write:
        return
    write_whole(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    classes = getattr(getattr(train_feed, "source", None), "classes", None)
    if isinstance(classes, (list, tuple)) and all(
            isinstance(c, (str, int)) and not isinstance(c, bool) for c in classes):
        write_whole(run_dir / "classes.json", json.dumps(list(classes), indent=1) + "\n")
    elif classes is not None:  # (an attribute of one's own dataset that is something else)
        logger.warning("data: the training dataset's classes attribute (%s) is not a list of "
                       "class names (str or int): classes.json is not written",
                       type(classes).__name__)
    rundir.record_hydra(run_dir, cfg)
    resume = cfg.trainer.resume
    rundir.write_running(run_dir, resume if resume not in (None, "auto") else None)
    dropped = logger.open(step, validated_step)
    if dropped:
        logger.info("%s", dropped_rows_line(dropped, step))


def dropped_rows_line(dropped: int, step: int) -> str:
    """The log's line for the rows of metrics.jsonl a resume dropped (those past its step)."""
    one = dropped == 1
    return (f"metrics.jsonl: {dropped} {'row' if one else 'rows'} an earlier attempt logged "
            f"after step {step} (the resumed one) {'was' if one else 'were'} dropped: those "
            "steps are trained again")

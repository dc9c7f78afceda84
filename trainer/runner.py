"""run(cfg): environment -> seed -> data -> model -> strategy -> optimizer -> restore -> fit.

This is the only place that builds components from the config; the loop receives them built.
"""
from __future__ import annotations

import atexit
import copy
import json
import logging
import os
import random
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.loader import LoaderStalled
from trainer import checkpoint, components, distributed, rundir, schedules, speed
from trainer.cli import (EXIT_CONFIG, EXIT_INTERRUPTED, USER_ERRORS, SignalledAgain, describe, fail,
                         wants_traceback)
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError, RunSpec, Strategy, monitor_mode, resolve
from trainer.feeds import build_feeds, feed_advice
from trainer.distributed import DistEnv
from trainer.liveness import Heartbeat, PeerLost
from trainer.logging import RunLogger, profiler
from trainer.loop import (Callback, FitState, Loop, NonFiniteLoss, skipped_files,
                          steps_per_epoch)
from trainer.precision import MixedPrecision, optimizer_choice
from trainer.resilience import (Checkpointing, Preempted, Preemption, changes_line,
                                resume_changes, set_rng_state)
from trainer.rundir import RunDirLock
from trainer.strategy import unwrap, wrap
from trainer.task import Task

log = logging.getLogger("stoker")
STALL_ADVICE_ABOVE = 0.10  # share of step time spent waiting for data that earns advice
STALL_ADVICE_STEPS = 10  # ... in a run of this many optimizer steps at least: a shorter one's
# wait is mostly the loader's start-up (a fast dev run's one step), which advice cannot fix


# failures said in one line (exit 2 for the user's errors, else 1); others keep a traceback
ONE_LINE = (*USER_ERRORS, NonFiniteLoss, PeerLost, LoaderStalled, OSError)


def run(cfg: DictConfig) -> Dict[str, Any]:
    """Command-line entry: `train`, with configuration and checkpoint errors turned into one
    line on stderr and exit code 2, OS errors (a full disk, a read-only dir) and a non-finite
    loss into one line and exit code 1, a preemption into exit code 75 (a traceback stays for
    anything else). README "Exit codes" lists them."""
    try:
        return train(cfg)
    except Preempted as e:
        if distributed.detect().is_main:  # every rank stops alike: one line says it
            log.warning("%s", e)
        raise SystemExit(e.code) from None
    except ONE_LINE as e:
        _sweep_job_failed(e)
        if wants_traceback():
            raise
        if isinstance(e, PeerLost):
            _end_without_peer(e)
        fail(e, code=exit_code(e))
    except BaseException as e:
        _sweep_job_failed(e)
        raise


def _end_without_peer(e: PeerLost) -> NoReturn:
    """Says `e` (any rank: rank 0 may be the one lost) and ends the process with exit code 1,
    Python's exit handlers run but not C++'s teardown: the backend's threads may still wait on
    the lost peer, and destroying them then aborts the process (SIGABRT, 'terminate called
    without an active exception') after the line was said."""
    try:
        fail(e, code=exit_code(e), any_rank=True)
    except SystemExit as done:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(done.code)


def _sweep_job_failed(e: BaseException) -> None:
    """A sweep job that failed before it opened its files (a refused setting of its own, a
    first batch its task refuses) leaves its status.json in the job dir Hydra made for it,
    where nothing else would say how it ended; the sweep itself stops there (Hydra's launcher
    runs no job after a failed one). A job dir with a status.json keeps it."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or not distributed.detect().is_main:
        return
    h = HydraConfig.get()
    job_dir = Path(h.runtime.output_dir)
    if h.mode != RunMode.MULTIRUN or not job_dir.is_dir() or (job_dir / rundir.STATUS).exists():
        return
    record_failure(job_dir, e)


def record_failure(run_dir: Path, e: BaseException) -> None:
    """`run_dir`'s status.json for a run that ended with `e`."""
    rundir.write_status(run_dir, exit_code(e), status_error(e),
                        word=("exited: SystemExit raised during the run"
                              if type(e) is SystemExit else None))


def status_error(e: BaseException) -> str:
    """status.json's error line: a crash (not a mistake the run names in one line) keeps its
    exception's type."""
    if type(e) is SystemExit:  # sys.exit() in the user's code, mid-run
        return f"SystemExit({e.code!r})"
    crash = exit_code(e) == 1 and not isinstance(e, ONE_LINE)
    text = describe(e)
    if crash and not text.startswith(f"{type(e).__name__}:"):  # (a worker's line has it)
        return f"{type(e).__name__}: {text}"
    return text


def exit_code(e: Optional[BaseException]) -> int:
    """The process's exit code for a run that ended with `e` (None: success)."""
    if e is None:
        return 0
    if isinstance(e, Preempted):
        return e.code
    if isinstance(e, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(e, SignalledAgain):
        return e.code
    if isinstance(e, SystemExit):  # as Python exits with it: None is 0, a message is 1
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    return EXIT_CONFIG if isinstance(e, USER_ERRORS) else 1


def train(cfg: DictConfig, env: Optional[DistEnv] = None,
          callbacks: Sequence[Callback] = ()) -> Dict[str, Any]:
    """Trains as `cfg` says and returns the run summary (losses, accuracy, rates, paths).
    `callbacks` (trainer.loop.Callback) are called after the built-in ones at every step and
    epoch: the Python API's hook for code of your own.

    Raises ConfigError for a value that cannot work and CheckpointError for an unusable
    checkpoint, both before any training step.
    """
    try:
        cfg.run_dir
    except OmegaConfBaseException as e:  # composed outside train.py: no Hydra run dir
        raise ConfigError(f"run_dir: cannot be resolved ({type(e).__name__}); a config composed "
                          "with hydra.compose needs a run_dir=PATH override") from None
    empty = _empty_hydra_dir()
    if empty:  # `hydra.run.dir=$UNSET`: the run would write into the current directory
        what = empty.split(".")[1]  # run or sweep
        raise ConfigError(f"{empty} is empty: name the {what}'s directory "
                          f"({empty}=outputs/my-{what}), or leave the key out for a new dated "
                          "one")
    env = env or distributed.detect()
    distributed.end_with_launcher()
    if not env.is_main:  # other ranks say warnings only (distributed.warn prefixes the rank)
        logging.getLogger().setLevel(logging.WARNING)
    spec = resolve(cfg, env.world_size, env.local_rank, env.launched)
    if cfg.trainer.fast_dev_run:  # one train and one val batch, then exit, nothing saved
        cfg = copy.deepcopy(cfg)
        cfg.trainer.max_epochs, cfg.trainer.max_steps = 1, 1
        cfg.trainer.save_checkpoint = False
    with distributed.process_group(env, spec.device, cfg.trainer.ddp.timeout_s,
                                   ddp=spec.strategy == Strategy.ddp):
        return _train(cfg, env, spec, callbacks)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator


def _process_flags(cfg: DictConfig) -> None:
    t = cfg.trainer
    torch.autograd.set_detect_anomaly(bool(t.detect_anomaly))
    if t.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; harmless on CPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    _deterministic(bool(t.deterministic), compiling=bool(t.compile.enabled))
    speed.backend_flags(t.tf32, t.cudnn_benchmark, t.deterministic)


def _deterministic(mode: bool, compiling: bool) -> None:
    """torch.use_deterministic_algorithms(mode), without its start-up cost where it has none
    to set: the public call also sets torch.compile's own flag, importing torch._inductor
    (about 1.5 s), which only a compiled model reads."""
    if compiling or "torch._inductor" in sys.modules:  # inductor's flag too, every time
        torch.use_deterministic_algorithms(mode)
    elif torch.are_deterministic_algorithms_enabled() != mode:
        torch._C._set_deterministic_algorithms(mode)


def _empty_hydra_dir() -> Optional[str]:
    """The Hydra key naming this launch's output dir when it was given empty, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None
    h = HydraConfig.get()
    key, value = (("hydra.sweep.dir", h.sweep.dir) if h.mode == RunMode.MULTIRUN
                  else ("hydra.run.dir", h.run.dir))
    return key if not str(value or "").strip() else None


def _limits(cfg: DictConfig) -> Tuple[Optional[int], Optional[int]]:
    t = cfg.trainer
    if t.fast_dev_run:
        return 1, 1
    if t.overfit_batches:
        return t.overfit_batches, t.limit_val_batches
    return t.limit_train_batches, t.limit_val_batches


def _model_and_task(cfg: DictConfig, spec: RunSpec):
    """The user's model (offered data.input_shape/num_classes where it takes them) on its
    device and wrapped for the strategy, and the task on the same device."""
    d = cfg.data
    offered = {"input_shape": None if d.input_shape is None else list(d.input_shape),
               "num_classes": d.num_classes}
    model = components.build(cfg.model, "model", offered,
                             hint="; model=custom starts from no keys but _target_")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model._target_={cfg.model._target_}: builds a "
                          f"{type(model).__name__}, not a torch.nn.Module")
    model = speed.memory_format(model, d.channels_last)
    task = components.build(cfg.task, "task")
    if not isinstance(task, Task):
        raise ConfigError(f"task._target_={cfg.task._target_}: builds a {type(task).__name__}; "
                          "a task must subclass trainer.task.Task")
    task.setup(model)  # the user's own module, not a wrapper of it
    model = speed.compile_model(wrap(model, spec.strategy, spec.device, cfg.trainer.ddp),
                                cfg.trainer.compile)
    return model, task.to(spec.device)


def _start_banner(cfg: DictConfig, env: DistEnv, spec: RunSpec, logger: RunLogger,
                  run_dir: Path, n_train: int) -> None:
    logger.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
    logger.info("run dir %s | device %s | strategy %s | precision %s | world size %d",
                run_dir, spec.device, spec.strategy.value, spec.precision.value, env.world_size)
    logger.info("global batch %d = per-rank batch %d x accumulation %d x world size %d "
                "| %d training samples", spec.global_batch, cfg.data.batch_size,
                cfg.trainer.accumulate_grad_batches, env.world_size, n_train)


def _resume_setting(cfg: DictConfig, run_dir: Path) -> Optional[str]:
    """trainer.resume, except that a job torchrun restarted continues its own run (the run
    dir's status.json names this job) from the dir's newest checkpoint: a path given for the
    first attempt would roll the run back to it. While the dir holds none, or holds no run of
    this job (the first attempt failed before its first step), it is as given."""
    resume = cfg.trainer.resume
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and \
            rundir.this_jobs(run_dir) and checkpoint.candidates(run_dir):
        return "auto"
    return resume


def _restore(cfg: DictConfig, env: DistEnv, run_dir: Path, loop: Loop,
             resume: Optional[str], gpus: List[torch.device]
             ) -> Tuple[List[str], List[str], Optional[Path]]:
    """Loads the checkpoint `resume` names into the built loop, if any; returns the warnings
    and the lines to log about it, which the caller logs once every check passed, and the
    file it resumed from."""
    found = checkpoint.find_resume(resume, run_dir)
    if found is None:
        return [], ([f"trainer.resume=auto: no checkpoint in {run_dir / checkpoint.CHECKPOINT_DIR}"
                     ": a fresh start (the run to continue is named by hydra.run.dir)"]
                    if resume == "auto" else []), None
    path, state, skipped = found
    # damaged newer checkpoints, skipped for an older one that loads
    warnings = [f"{reason}; the previous checkpoint was used" for reason in skipped]
    rngs, old_world = state.get("rng", []), state.get("world_size", env.world_size)
    changes = resume_changes(state.get("config", {}), cfg, old_world, env.world_size)
    checkpoint.check_model_state(unwrap(loop.model), state, path)
    try:
        loop.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as e:  # parameter groups that do not fit
        raise CheckpointError(f"checkpoint {path}: its optimizer or scheduler state does not "
                              f"fit this run ({type(e).__name__}: {e})") from None
    # a sanity bound: the position counts whole global batches (an epoch's last one may pass
    # the dataset's end: 23 x 64 = 1472 for 1438 samples), and a checkpoint at an epoch's last
    # step is saved before it resets to 0
    n = len(loop.train_feed.loader.dataset)
    old_batch = ((state.get("config") or {}).get("data") or {}).get("batch_size") \
        or cfg.data.batch_size
    if loop.state.position > n + int(old_batch) * old_world:
        raise CheckpointError(f"checkpoint {path}: its position, {loop.state.position} samples "
                              f"into epoch {loop.state.epoch}, is past the end of this run's "
                              f"{n} training samples (another dataset?)")
    if not checkpoint.in_run_dir(path, run_dir):
        # another run's checkpoint: its final validation is that run's record, not this
        # one's, so a complete one is validated again here (on this world size) and
        # this run dir gets its own summary
        loop.state.validated_step = -1
    lines = []
    if resume != cfg.trainer.resume:
        lines.append(f"torchrun restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: resuming "
                     "from this run's newest checkpoint")
    if changes:
        lines.append(changes_line(changes))
    generator = loop.train_feed.loader.generator
    if len(rngs) == env.world_size:
        set_rng_state(rngs[env.rank], generator, gpus)
        loop.loader_rng = rngs[env.rank].get("loader")
    elif old_world != env.world_size:
        lines.append(f"the checkpoint was written by {old_world} ranks, this job has "
                     f"{env.world_size}: the data position is kept in global samples "
                     f"({loop.state.position} into epoch {loop.state.epoch}); random states "
                     "start from the seed")
    lines.append(f"resumed from {path} at epoch {state['epoch']} step {state['step']} "
                 f"({loop.state.position} samples into the epoch)")
    return warnings, lines, path


def _check_optimizer_step(optimizer) -> None:
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


# settings every rank must share: the steps each takes and when, which samples (the sampler's
# seed and order), and when the ranks meet (logging, validation, checkpoints)
_SHARED = ("seed", "data.batch_size", "data.eval_batch_size", "data.drop_last", "data.shuffle",
           "trainer.accumulate_grad_batches", "trainer.max_epochs", "trainer.max_steps",
           "trainer.limit_train_batches", "trainer.limit_val_batches",
           "trainer.overfit_batches", "trainer.val_every_n_epochs", "trainer.log_every_n_steps",
           "trainer.max_bad_steps", "trainer.precision", "trainer.save_checkpoint",
           "trainer.fast_dev_run", "trainer.resume", "trainer.compile.enabled",
           "trainer.checkpoint.every_n_steps", "trainer.checkpoint.every_n_epochs",
           "trainer.checkpoint.async_save", "trainer.checkpoint.monitor",
           "trainer.checkpoint.mode", "trainer.ddp.static_graph",
           "trainer.ddp.find_unused_parameters", "trainer.ddp.sync_batchnorm",
           "trainer.ddp.bucket_cap_mb")


def _same_settings_everywhere(cfg: DictConfig, device: torch.device) -> None:
    """Every rank must run with the same `_SHARED` settings (an override that reads the rank's
    environment, `${oc.env:RANK}`, could give them different ones): ranks with different
    batch sizes or limits take different numbers of steps, and gloo aborts the process on the
    mismatched collective while NCCL hangs. One small all-reduce at start-up, before any other
    collective of the run; ConfigError on every rank, naming the keys."""
    if distributed.world_size() == 1:
        return
    values = []
    for key in _SHARED:
        v = OmegaConf.select(cfg, key)
        v = getattr(v, "value", v)  # an enum's value
        values.append(float(v) if isinstance(v, (int, float)) else  # (bools too)
                      float(zlib.crc32(repr(v).encode())))  # (null: repr None's)
    low, high = distributed.spread(values, device)
    differ = [f"{key} ({lo:g} to {hi:g})" if isinstance(OmegaConf.select(cfg, key), int)
              else key for key, lo, hi in zip(_SHARED, low, high) if lo != hi]
    if differ:
        raise ConfigError(f"the ranks run with different settings: {', '.join(differ)}; every "
                          "rank must have the same ones (an override that reads the rank's "
                          "environment?)")


def _same_data_everywhere(train_feed, val_feed, device: torch.device) -> None:
    """Every rank must have built datasets of the same lengths: the samplers cut one index
    range into shards, and ranks with different ones would take different numbers of steps
    (gloo aborts the process on the mismatched collective, NCCL hangs). One small all-reduce
    at start-up; ConfigError on every rank."""
    if distributed.world_size() == 1:
        return
    sizes = [len(train_feed.loader.dataset),
             len(val_feed.loader.dataset) if val_feed is not None else -1]
    for split, lo, hi in zip(("training", "validation"), *distributed.spread(sizes, device)):
        if hi != lo:
            raise ConfigError(
                f"data: the ranks built {split} sets of different lengths ({int(lo)} to "
                f"{int(hi)} samples); every rank must build the same dataset (one that reads "
                "RANK, or files that differ between nodes?)")


def _build(cfg: DictConfig, env: DistEnv, spec: RunSpec, run_dir: Path, logger: RunLogger,
           prof, preemption: Preemption, resume: Optional[str],
           callbacks: Sequence[Callback] = ()) -> Tuple[Loop, Checkpointing]:
    train_feed, val_feed, data_lines = build_feeds(cfg, env, spec.device)
    _same_data_everywhere(train_feed, val_feed, spec.device)
    train_loader = train_feed.loader
    # re-seed so the initial weights depend on the seed alone, not on how much randomness
    # building the datasets and loaders happened to draw
    seed_everything(cfg.seed)
    model, task = _model_and_task(cfg, spec)
    mode = monitor_mode(cfg, task.higher_is_better() if val_feed is not None else {})
    factory = components.build(cfg.optim, "optim")
    params = [p for p in model.parameters() if p.requires_grad]
    chosen = optimizer_choice(factory, spec.precision, spec.device, params)
    optimizer = components.call(factory, "optim", cfg.optim, params, **chosen)
    _check_optimizer_step(optimizer)
    train_limit, val_limit = _limits(cfg)
    if hasattr(train_loader, "limit"):  # a run-on loader hands out what the loop takes
        train_loader.limit = train_limit
    per_epoch = steps_per_epoch(train_loader, train_limit, cfg.trainer.accumulate_grad_batches)
    n_rank = len(train_loader.sampler)
    if per_epoch == 0:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size}: no optimizer step per epoch "
                          f"with {n_rank} training samples on this rank "
                          f"(data.drop_last={cfg.data.drop_last})")
    too_big = ([f"data.batch_size={cfg.data.batch_size} is more than the {n_rank} training "
                f"samples on this rank: every epoch is one batch of {n_rank}"]
               if n_rank < cfg.data.batch_size else [])  # (with drop_last: refused above)
    total = per_epoch * cfg.trainer.max_epochs
    if cfg.trainer.max_steps > 0:
        total = min(total, cfg.trainer.max_steps)
    scheduler = components.call(schedules.build, "sched", cfg.sched,
                                components.build(cfg.sched, "sched"), optimizer, total)
    precision = MixedPrecision(spec.precision, spec.device)
    checkpointing = Checkpointing(cfg, env, run_dir, logger, cfg.trainer.save_checkpoint,
                                  preemption=preemption, mode=mode, device=spec.device,
                                  gpus=spec.gpus)
    loop = Loop(cfg=cfg.trainer, model=model, task=task, optimizer=optimizer,
                scheduler=scheduler, precision=precision, train_feed=train_feed,
                val_feed=val_feed, device=spec.device, logger=logger, state=FitState(),
                train_limit=train_limit, val_limit=val_limit,
                callbacks=[*([ProfilerSteps(prof)] if cfg.trainer.profile else []),
                           checkpointing, *callbacks],
                input_shape=cfg.data.input_shape)
    # the first line to the log comes after every check: a refused run adds nothing to the
    # train.log of the run whose dir it was pointed at
    warnings, lines, resumed = _restore(cfg, env, run_dir, loop, resume, spec.gpus)
    if resumed is not None and checkpoint.in_run_dir(resumed, run_dir):
        # an earlier step of this run: what it saved after that step is set aside with the
        # run's first files (every rank reads the same dir, so they agree on best.pt)
        checkpointing.roll_back(checkpoint.abandoned(run_dir, resumed, loop.state.step))
    _start_banner(cfg, env, spec, logger, run_dir, len(train_loader.dataset))
    if task.note:
        logger.info("%s", task.note)
    monitor = cfg.trainer.checkpoint.monitor
    unused = ([f"trainer.checkpoint.monitor={monitor} keeps no best.pt: "
               "trainer.save_checkpoint=false saves no checkpoint"]
              if monitor and not cfg.trainer.save_checkpoint and not cfg.trainer.fast_dev_run
              else [])
    for line in [*too_big, *unused, *warnings]:
        distributed.warn(env, "%s", line)
    if chosen:
        lines.append("optim.fused=null -> true: fp16's GradScaler steps a fused optimizer "
                     "without reading its inf flag to the host each step "
                     "(optim.foreach=true keeps PyTorch's CUDA default)")
    for line in [*data_lines, *lines]:
        logger.info("%s", line)
    return loop, checkpointing


class ProfilerSteps(Callback):
    """Advances a torch.profiler schedule once per optimizer step."""

    def __init__(self, prof):
        self.prof = prof

    def after_step(self, loop: Loop) -> None:
        self.prof.step()


def _train(cfg: DictConfig, env: DistEnv, spec: RunSpec,
           callbacks: Sequence[Callback]) -> Dict[str, Any]:
    t = cfg.trainer
    run_dir = Path(cfg.run_dir)
    _process_flags(cfg)
    seed_everything(cfg.seed)
    # an earlier job of a sweep started CUDA; before CUDA starts there is nothing to reset,
    # and the call would fail
    if torch.cuda.is_initialized():
        for gpu in spec.gpus:
            torch.cuda.reset_peak_memory_stats(gpu)
    logger = RunLogger(run_dir, main=env.is_main, write=env.is_main and not t.fast_dev_run,
                       tensorboard=t.tensorboard, progress_bar=t.progress_bar)
    lock = RunDirLock(run_dir)
    resume = _resume_setting(cfg, run_dir)
    outputs = None
    start = time.perf_counter()
    loop = None
    try:
        _same_settings_everywhere(cfg, spec.device)  # (the first collective of the run)
        if not t.fast_dev_run:  # a fast dev run writes nothing, so it may share a dir
            rundir.agreed(lambda: (lock.acquire(), rundir.check_fresh_start(run_dir, resume)),
                          env)
        with profiler(run_dir, t.profile and env.is_main, spec.device) as prof, \
                Preemption(env, saving=t.save_checkpoint and not t.fast_dev_run) as preemption:
            loop, checkpointing = _build(cfg, env, spec, run_dir, logger, prof, preemption,
                                         resume, callbacks)
            if loop.complete():  # a finished run resumed again (a requeued job): keep its record
                return _nothing_to_do(cfg, run_dir, loop, logger)
            # the run's files come once its first optimizer step succeeded (or before the
            # first metrics row, whichever is first): a resume the first batch refuses (a
            # task that does not fit the data) leaves the run dir as it was
            outputs = _FirstStepOutputs(cfg, env, run_dir, logger, loop, checkpointing)
            loop.callbacks.insert(0, outputs)
            logger.before_first_write = outputs.open
            heartbeat = Heartbeat(env.rank, env.world_size, lambda: (loop.state.step, loop.phase))
            with heartbeat:
                try:
                    summary = loop.fit()
                    _save_final(loop, checkpointing, run_dir, t.max_bad_steps)
                except NonFiniteLoss as e:  # which state is left to resume from
                    checkpointing.finish()
                    raise NonFiniteLoss(f"{e}; {_last_good(run_dir)}") from None
                except RuntimeError as e:  # a collective that timed out: name the rank
                    lost = heartbeat.explain(e, cfg.trainer.ddp.timeout_s)
                    if lost is None:
                        raise
                    # (its line says it all: not the backend's text)
                    raise PeerLost(f"{lost}; {_last_good(run_dir)}") from None
        last = run_dir / checkpoint.CHECKPOINT_DIR / checkpoint.LAST
        summary["checkpoint"] = str(last) if t.save_checkpoint and last.exists() else ""
        best = checkpointing.best_record()
        if best is not None and t.save_checkpoint:
            summary["best"] = best
        skipped = skipped_files(loop.train_feed, loop.val_feed)
        if skipped:
            distributed.warn(env, "data: %d unreadable files were skipped (data.dataset."
                             "on_error=skip), e.g. %s", len(skipped), ", ".join(skipped[:3]))
        summary.update(skipped_files=len(skipped))
        summary.update(wall_s=time.perf_counter() - start, global_batch=spec.global_batch,
                       world_size=env.world_size, strategy=spec.strategy.value,
                       precision=cfg.trainer.precision.value,
                       peak_mem_mb=peak_memory_mb(spec))
        logger.summary(summary)
        if outputs.writing:
            rundir.write_status(run_dir, 0, "")
        _final_summary(summary, env)
        # on CUDA what the GPU waited: a host ahead of its queued steps waits at no cost
        gpu_idle = "run_device_wait_frac" in summary
        stalled = summary["run_device_wait_frac" if gpu_idle else "run_data_wait_frac"]
        if stalled > STALL_ADVICE_ABOVE and loop.state.step >= STALL_ADVICE_STEPS \
                and not t.fast_dev_run:
            logger.info("%s", feed_advice(cfg.data, loop.train_feed, spec.device, stalled,
                                          env.local_world_size, gpu_idle))
        return summary
    except BaseException as e:
        if outputs is not None and outputs.writing:
            record_failure(run_dir, e)
        raise
    finally:
        if loop is not None:  # the loaders' workers, also after an error
            loop.train_feed.close()
            if loop.val_feed is not None:
                loop.val_feed.close()
        logger.close()
        lock.release()


def _save_final(loop: Loop, checkpointing: Checkpointing, run_dir: Path,
                max_bad_steps: int) -> None:
    """The final state saved (skipped if its step is saved already) and every write done, or
    NonFiniteLoss where the run ended on losses that were not finite."""
    bad = loop.bad_steps()  # (collective: every rank takes the same branch)
    if bad and max_bad_steps:  # fewer than max_bad_steps, but the final state is broken
        raise NonFiniteLoss(
            f"the run ended with a loss that was not finite for its last {bad} optimizer "
            f"steps (fewer than trainer.max_bad_steps={max_bad_steps}); its final state was "
            "not saved")
    checkpointing.save(loop)
    checkpointing.finish()


def _last_good(run_dir: Path) -> str:
    """What a run stopped for losses that were not finite leaves to resume from (no checkpoint
    is saved with such a loss)."""
    last = checkpoint.candidates(run_dir)
    return f"the last good checkpoint is {last[0]}" if last else "no checkpoint was saved"


def _nothing_to_do(cfg: DictConfig, run_dir: Path, loop: Loop,
                   logger: RunLogger) -> Dict[str, Any]:
    """What a run resumed from its final checkpoint returns, writing nothing: the summary its
    run dir holds (where this rank can read it), and one line saying so."""
    t, state = cfg.trainer, loop.state
    logger.info("nothing to train: the run is complete at epoch %d step %d (trainer.max_epochs="
                "%d, trainer.max_steps=%d) and its files are left as they are; raise either to "
                "train on", state.epoch, state.step, t.max_epochs, t.max_steps)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    return {**summary, "epochs": state.epoch, "steps": state.step, "complete": True}


class _FirstStepOutputs(Callback):
    """Opens the run's files (`_open_outputs`) once: after the first optimizer step, or at
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
            _open_outputs(*self.args, self.step, self.validated_step)
            if self.logger.write:
                self.checkpointing.set_aside(self.step)

    def after_step(self, loop) -> None:
        self.open()


def _open_outputs(cfg: DictConfig, env: DistEnv, run_dir: Path, logger: RunLogger,
                  train_feed, step: int, validated_step: int) -> None:
    """The run's files, from rank 0, once every check passed: the resolved config, Hydra's
    record, the class names of a dataset that has them (`classes.json`: class i is the i-th
    name), metrics.jsonl and TensorBoard."""
    if not logger.write:
        return
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    classes = getattr(getattr(train_feed, "source", None), "classes", None)
    if classes is not None:
        (run_dir / "classes.json").write_text(json.dumps(list(classes), indent=1) + "\n")
    rundir.record_hydra(run_dir, cfg)
    resume = cfg.trainer.resume
    rundir.write_running(run_dir, resume if resume not in (None, "auto") else None)
    dropped = logger.open(step, validated_step)
    if dropped:
        logger.info("metrics.jsonl: %d rows an earlier attempt logged after step %d (the "
                    "resumed one) were dropped: those steps are trained again", dropped,
                    step)


def peak_memory_mb(spec: RunSpec) -> float:
    """Peak memory of this run: CUDA allocations since it began on the busiest of its GPUs
    (reset at its start, so a sweep's jobs in one process each report their own), resident
    set size of the process on CPU."""
    gpus = spec.gpus
    if gpus:
        return max(torch.cuda.max_memory_allocated(d) for d in gpus) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _final_summary(s: Dict[str, Any], env: DistEnv) -> None:
    if not env.is_main:
        return
    val = " ".join(f"{k} {v:.4f}" for k, v in s.items() if k.startswith("val_")) \
        or "no validation"
    gpu = (f" (GPU idle for data {100 * s['run_device_wait_frac']:.1f}%)"
           if "run_device_wait_frac" in s else "")
    log.info("done: %d epochs, %d steps in %.1fs (training %.1fs, validation %.1fs, "
             "checkpoints %.1fs) | %s | %.0f samples/s | waiting for data %.1f%% of step "
             "time%s%s", s["epochs"], s["steps"], s["wall_s"], s["run_train_s"], s["run_val_s"],
             s["run_checkpoint_s"], val, s["run_samples_per_s"], 100 * s["run_data_wait_frac"],
             gpu, f" | checkpoint {s['checkpoint']}" if s["checkpoint"] else "")
    if "best" in s:
        b = s["best"]
        log.info("best.pt: step %d, %s %.4f", b["step"], b["monitor"], b["value"])

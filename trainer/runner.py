"""run(cfg): environment -> seed -> data -> model -> strategy -> optimizer -> restore -> fit.

This is the only place that builds components from the config; the loop receives them built.
"""
from __future__ import annotations

import copy
import gc
import logging
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.cache import release_shm
from data.cachewait import WriterGone
from trainer import (agreement, checkpoint, components, distributed, ending, failure,
                     liveness, resumeargs, resumefiles, rundir, schedules, speed, startup,
                     sweep)
from trainer.checks import monitor_mode, resolve
from trainer.validation import PeerFailedValidation, validate_once
from trainer.cli import fail, say, wants_traceback
from trainer.config import ConfigError, RunSpec, Strategy
from trainer.feedadvice import too_many_workers
from trainer.firstbatch import head_mismatch
from trainer.feeds import build_feeds
from trainer.distributed import DistEnv
from trainer.launchvars import LaunchError, check_launch
from trainer.earlystop import EarlyStopping
from trainer.liveness import Heartbeat, PeerLost
from trainer.logging import RunLogger, profiler
from trainer.loop import Callback, Loop
from trainer.progress import FitState, batch_limits, total_steps
from trainer.precision import MixedPrecision, optimizer_choice
from trainer.preemption import Preempted, Preemption
from trainer.resilience import Checkpointing
from trainer.runlock import RunDirLock
from trainer.strategy import wrap
from trainer.task import Task, raised_in_own_code
from trainer.windowlog import NonFiniteLoss

log = logging.getLogger("stoker")


def run(cfg: DictConfig) -> Dict[str, Any]:
    """Command-line entry: `train`, with configuration and checkpoint errors turned into one
    line on stderr and exit code 2, OS errors (a full disk, a read-only dir) and a non-finite
    loss into one line and exit code 1, a preemption into exit code 75 (a traceback stays for
    anything else). README "Exit codes" lists them."""
    validating = bool(OmegaConf.select(cfg, "trainer.validate_only", default=False))
    try:
        return train(cfg)
    except Preempted as e:
        if distributed.detect().is_main:  # every rank stops alike: one line says it
            log.warning("%s", e)
        raise SystemExit(e.code) from None
    except ending.ONE_LINE as e:
        ending.sweep_job_failed(e)
        if wants_traceback():
            if ending.stops_sweep():
                ending.end_sweep(e, validating)
            raise
        stops = ending.stops_sweep()
        if isinstance(e, PeerLost):
            if stops:  # (before: the process ends at once after its own line)
                ending.say_sweep_stopped(validating=validating)
            ending.end_without_peer(e)
        try:  # (a launch the variables cannot describe, a rank that could not join, or that
            # lost the writer of its node's cache, which may be rank 0: each says it)
            fail(e, code=ending.exit_code(e), any_rank=isinstance(
                e, (LaunchError, distributed.JoinFailed, WriterGone)))
        finally:
            if stops:  # the last line: which job stopped the sweep, how to run on
                ending.say_sweep_stopped(e, validating)
    except BaseException as e:
        ending.sweep_job_failed(e)
        if isinstance(e, Exception) and ending.stops_sweep():
            ending.end_sweep(e, validating)
        at = raised_in_own_code(e, not_the_projects=True) if type(e) is SystemExit else ""
        if at:  # sys.exit() in the user's code: the process ended, silent, even with 0 in a
            # sweep whose next jobs never ran
            ending.said_exit(e, at, validating)
        raise


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose(overrides: Sequence[str] = (), config_name: str = "train") -> DictConfig:
    """The config `train.py` would compose from `overrides` (the command line's arguments,
    `hydra.searchpath=[file://DIR]` for a folder of configs of one's own included), from the
    project's conf/, for `train`. A bad override is a ConfigError in the command line's one
    line (`... did you mean trainer.max_epochs?`), not Hydra's chained exceptions. Inside a
    Hydra context of the program's own (`initialize_config_dir`), that context's configs."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from trainer import oneline

    try:
        if GlobalHydra.instance().is_initialized():
            return hydra_compose(config_name, overrides=list(overrides))
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return hydra_compose(config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(oneline.describe(e)) from None


def train(cfg: DictConfig, env: Optional[DistEnv] = None,
          callbacks: Sequence[Callback] = ()) -> Dict[str, Any]:
    """Trains as `cfg` says and returns the run summary (losses, accuracy, rates, paths).
    `callbacks` (trainer.loop.Callback) are called after the built-in ones, but before the
    checkpointing, at every step and epoch: the Python API's hook for code of your own.

    Raises ConfigError for a value that cannot work and CheckpointError for an unusable
    checkpoint, both before any training step.
    """
    if not isinstance(cfg, DictConfig):  # (a dict of one's own: an AttributeError below)
        raise ConfigError(f"train: takes the DictConfig that trainer.runner.compose(overrides) "
                          f"returns, got {type(cfg).__name__}; change the config with "
                          "overrides there (a plain dict loses the keys' types and checks)")
    try:
        cfg.run_dir
    except OmegaConfBaseException as e:  # composed outside train.py: no Hydra run dir
        raise ConfigError(f"run_dir: cannot be resolved ({type(e).__name__}); a config composed "
                          "outside train.py (trainer.runner.compose, hydra.compose) needs a "
                          "run_dir=PATH override") from None
    _check_launcher()
    empty = _empty_hydra_dir()
    if empty:  # `hydra.run.dir=$UNSET`: the run would write into the current directory
        what = empty.split(".")[1]  # run or sweep
        raise ConfigError(f"{empty} is empty: name the {what}'s directory "
                          f"({empty}=outputs/my-{what}), or leave the key out for a new dated "
                          "one")
    rundir.check_is_hydras(cfg)
    rundir.check_plain_files(Path(cfg.run_dir))
    if env is None:
        check_launch()
        env = distributed.detect()
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
        put_back = speed.process_flags(cfg.trainer)
        try:
            return _train(cfg, env, spec, callbacks)
        except Exception as e:
            # (rank 0 says its own; a peer's own, a one-line error or a crash's last line,
            # reaches rank 0's report of losing it and its status.json: not a loss of its own,
            # which another survivor would pass off as the lost rank's error)
            if env.world_size > 1 and not liveness.from_a_lost_peer(e) and \
                    not isinstance(e, Preempted):
                liveness.record_error(env.rank, ending.status_error(e))
                if isinstance(e, ending.ONE_LINE) and env.is_main and not wants_traceback():
                    # said now, the job's store still up to tell the others it is: a rank
                    # whose same error ended it first had torchrun end this one before its
                    # line, said after the process group's teardown (no line at all)
                    say(e)
                    e.said_early = True
                    liveness.mark_said(env)
                elif isinstance(e, ending.ONE_LINE) and not wants_traceback():
                    e.rank0_asked = True  # (cli.fail asks no more)
                    if liveness.unmet_by_rank_0(env.rank):
                        e.said_by_its_rank = env.rank  # (cli.fail; a crash says its traceback)
            raise
        finally:  # (a program that trains from Python gets its own settings back)
            put_back()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every device's generator


def _check_launcher() -> None:
    """A sweep launcher of Hydra's (hydra/launcher=slurm) launches sweeps (-m) only: a run
    without -m would train here, where its user meant to submit it."""
    if not sweep.in_sweep() and "submitit" in ending.launcher():
        raise ConfigError("hydra/launcher=slurm: submits sweeps (-m) only, and this command "
                          "would train here; add -m to submit it as a job (one job for one "
                          "setting), or leave the launcher out")


def _empty_hydra_dir() -> Optional[str]:
    """The Hydra key naming this launch's output dir when it was given empty, else None."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    h = HydraConfig.get()
    key, value = (("hydra.sweep.dir", h.sweep.dir) if sweep.in_sweep()
                  else ("hydra.run.dir", h.run.dir))
    return key if not str(value or "").strip() else None


def _model_and_task(cfg: DictConfig, spec: RunSpec):
    """The user's model (offered data.input_shape/num_classes where it takes them) on its
    device and wrapped for the strategy, and the task on the same device."""
    model = speed.memory_format(components.build_model(cfg), cfg.data.channels_last)
    task = components.build(cfg.task, "task")
    if not isinstance(task, Task):
        raise ConfigError(f"task._target_={cfg.task._target_}: builds a {type(task).__name__}; "
                          "a task must subclass trainer.task.Task")
    if type(task).loss is Task.loss:  # (the base's raises NotImplementedError at step 1)
        raise ConfigError(f"task._target_={cfg.task._target_}: {type(task).__name__} defines "
                          "no loss(output, batch); a task computes its loss (README \"A task "
                          "and a metric of your own\")")
    task.setup(model)  # the user's own module, not a wrapper of it
    model = speed.compile_model(wrap(model, spec.strategy, spec.device, cfg.trainer.ddp,
                                     cfg.trainer.deterministic), cfg.trainer.compile)
    return model, task.to(spec.device)


def _start_banner(cfg: DictConfig, env: DistEnv, spec: RunSpec, logger: RunLogger,
                  run_dir: Path, n_train: int) -> None:
    if cfg.trainer.print_config:
        logger.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
    logger.info("run dir %s | device %s | strategy %s | precision %s | world size %d",
                run_dir, spec.device, spec.strategy.value, spec.precision.value, env.world_size)
    logger.info("global batch %d = per-rank batch %d x accumulation %d x world size %d "
                "| %d training samples", spec.global_batch, cfg.data.batch_size,
                cfg.trainer.accumulate_grad_batches, env.world_size, n_train)


def _own_callbacks(cfg: DictConfig, given: Sequence[Any]) -> List[Callback]:
    """The user's callbacks: trainer.callbacks' nodes (by name, in their order), then those
    given to `train` from Python; each checked to be a trainer.loop.Callback instance."""
    built = [(f"trainer.callbacks.{name}", components.build(node, f"trainer.callbacks.{name}"))
             for name, node in (cfg.trainer.get("callbacks") or {}).items() if node is not None]
    for key, cb in [*built, *((f"callbacks[{i}]", cb) for i, cb in enumerate(given))]:
        if isinstance(cb, type) and issubclass(cb, Callback):
            raise ConfigError(f"{key}: the class {cb.__name__}, not an instance of it: "
                              f"give {cb.__name__}(...)")
        if not isinstance(cb, Callback):
            raise ConfigError(f"{key}: {type(cb).__module__}.{type(cb).__qualname__} is not a "
                              "trainer.loop.Callback (subclass it: after_step, after_epoch, "
                              "should_stop, state_dict)")
    return [cb for _, cb in built] + list(given)


def _build(cfg: DictConfig, env: DistEnv, spec: RunSpec, run_dir: Path, logger: RunLogger,
           prof, preemption: Preemption, resume: Optional[str],
           callbacks: Sequence[Callback] = ()) -> Tuple[Loop, Checkpointing]:
    train_feed, val_feed, data_lines = build_feeds(cfg, env, spec.device)
    agreement.same_data_everywhere(train_feed, val_feed, spec.device)
    train_loader = train_feed.loader
    # re-seed so the initial weights depend on the seed alone, not on how much randomness
    # building the datasets and loaders happened to draw
    seed_everything(cfg.seed)
    model, task = _model_and_task(cfg, spec)
    mode = monitor_mode(cfg, task.higher_is_better() if val_feed is not None else {},
                        task.entry_metrics)
    task.monitored = cfg.trainer.checkpoint.monitor if mode else None
    factory = components.build(cfg.optim, "optim")
    params = [p for p in model.parameters() if p.requires_grad]
    chosen = optimizer_choice(factory, spec.precision, spec.device, params)
    optimizer = components.call(factory, "optim", cfg.optim, params, **chosen)
    startup.check_optimizer_step(optimizer)
    train_limit, val_limit = batch_limits(cfg, train_loader, val_feed)
    if hasattr(train_loader, "limit"):  # a run-on loader hands out what the loop takes
        train_loader.limit = train_limit
    total, too_big = total_steps(cfg, train_loader, train_limit)
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
                # the checkpointing last: each checkpoint holds every other callback's
                # state as of its own step and epoch (a resume neither repeats nor skips one)
                callbacks=[*([ProfilerSteps(prof)] if cfg.trainer.profile else []),
                           *_early_stopping(cfg, mode), *_own_callbacks(cfg, callbacks),
                           checkpointing],
                input_shape=cfg.data.input_shape)
    loop.stop_asked = lambda: preemption.requested
    if cfg.trainer.save_checkpoint and not cfg.trainer.fast_dev_run:  # (not an epoch later)
        checkpoint.check_loadable(loop.state_dict())
    # the first line to the log comes after every check: a refused run adds nothing to the
    # train.log of the run whose dir it was pointed at
    warnings, lines, resumed = startup.restore(cfg, env, run_dir, loop, resume, spec.gpus)
    past = ending.past_the_limit(cfg, loop)
    if past is not None:  # (said before the resume's lines, which tell of a run not to come)
        raise ConfigError(past)
    if resumed is not None and resumefiles.in_run_dir(resumed, run_dir):
        # an earlier step of this run: what it saved after that step is set aside with the
        # run's first files (every rank reads the same dir, so they agree on best.pt)
        checkpointing.roll_back(resumefiles.abandoned(run_dir, resumed, loop.state.step))
    _start_banner(cfg, env, spec, logger, run_dir, len(train_loader.dataset))
    if task.note:
        logger.info("%s", task.note)
    # every rank's alike (same_settings_everywhere, same_data_everywhere, one checkpoint):
    # said once
    for line in [*rundir.unused_dir_key(), *_training_warnings(cfg, env, loop, too_big),
                 *warnings]:
        logger.warning("%s", line)
    if chosen:
        lines.append("optim.fused=null -> true: fp16's GradScaler steps a fused optimizer "
                     "without reading its inf flag to the host each step "
                     "(optim.foreach=true keeps PyTorch's CUDA default)")
    carried = resumeargs.said()
    for line in [*data_lines, *([carried] if carried else []), *lines]:
        logger.info("%s", line)
    return loop, checkpointing


def _training_warnings(cfg: DictConfig, env: DistEnv, loop: Loop, too_big: List[str]
                       ) -> List[str]:
    """The start-up warnings of a training's steps and saves (none for trainer.validate_only):
    `too_big` (limits and a warmup past the run's steps), a monitor with nothing saved, more
    loader workers than the CPUs take."""
    if cfg.trainer.validate_only:
        return []
    monitor = cfg.trainer.checkpoint.monitor
    unused = ([f"trainer.checkpoint.monitor={monitor} keeps no best.pt: "
               "trainer.save_checkpoint=false saves no checkpoint"]
              if monitor and not cfg.trainer.save_checkpoint and not cfg.trainer.fast_dev_run
              and not cfg.trainer.early_stopping.patience else [])
    head = head_mismatch(loop.model, cfg.data.get("num_classes")) \
        if getattr(loop.task, "name", None) == "model_loss" else None
    return [*too_big, *unused, *too_many_workers(cfg.data, loop.train_feed, env.local_world_size),
            *([head] if head else [])]


def _early_stopping(cfg: DictConfig, mode: Optional[str]) -> List[Callback]:
    """The early-stopping callback where trainer.early_stopping.patience is set."""
    e = cfg.trainer.early_stopping
    return [EarlyStopping(cfg.trainer.checkpoint.monitor, mode, e.patience, e.min_delta)] \
        if e.patience else []


class ProfilerSteps(Callback):
    """Advances a torch.profiler schedule once per optimizer step."""

    def __init__(self, prof):
        self.prof = prof

    def after_step(self, loop: Loop) -> None:
        self.prof.step()


def _reset_peak_memory(spec: RunSpec) -> None:
    """The GPUs' peak memory counts from this job on, where an earlier job of a sweep started
    CUDA (before CUDA starts there is nothing to reset, and the call would fail)."""
    if torch.cuda.is_initialized():
        # its model and optimizer may still be held by a reference cycle (an exception caught
        # while building keeps frames that hold them) until a full collection: freed first,
        # or they would count in this job's peak and crowd its memory
        gc.collect()
        for gpu in spec.gpus:
            torch.cuda.reset_peak_memory_stats(gpu)


def _train(cfg: DictConfig, env: DistEnv, spec: RunSpec,
           callbacks: Sequence[Callback]) -> Dict[str, Any]:
    t = cfg.trainer
    run_dir = Path(cfg.run_dir)
    seed_everything(cfg.seed)
    _reset_peak_memory(spec)
    logger = RunLogger(run_dir, main=env.is_main, write=env.is_main and not t.fast_dev_run,
                       tensorboard=t.tensorboard, progress_bar=t.progress_bar)
    lock = RunDirLock(run_dir)
    try:
        resume = startup.resume_setting(cfg, run_dir)
    except BaseException:  # (the logger holds Python's warnings: given back)
        logger.close()
        raise
    outputs = None
    start = time.perf_counter()
    loop = checkpointing = None
    failing = False
    ours = False  # the run dir is this run's to write (its checks passed)
    try:
        agreement.same_settings_everywhere(cfg, spec.device)  # (the run's first collective)
        if not t.fast_dev_run:  # a fast dev run writes nothing, so it may share a dir
            rundir.agreed(lambda: (lock.acquire(), rundir.check_fresh_start(
                run_dir, resume, t.validate_only)), env)
            ours = env.is_main
        else:  # (but its train.log lines: not into another run's log)
            rundir.agreed(lambda: rundir.check_dev_run_dir(run_dir), env)
        with profiler(run_dir, t.profile and env.is_main, spec.device) as prof, \
                Preemption(env, saving=t.save_checkpoint and not t.fast_dev_run) as preemption:
            loop, checkpointing = _build(cfg, env, spec, run_dir, logger, prof, preemption,
                                         resume, callbacks)
            preemption.stop_before_training()
            if t.validate_only and loop.val_feed is None:
                raise ConfigError("trainer.validate_only=true: the data has no validation set "
                                  "(data.dataset's val split, or data.val_dataset)")
            if loop.complete():  # a finished run resumed again (a requeued job): keep its record
                return ending.nothing_to_do(cfg, run_dir, loop, logger)
            # the run's files come once its first optimizer step succeeded (or before the
            # first metrics row, whichever is first): a resume the first batch refuses (a
            # task that does not fit the data) leaves the run dir as it was
            outputs = startup.FirstStepOutputs(cfg, env, run_dir, logger, loop, checkpointing)
            loop.callbacks.insert(0, outputs)
            logger.before_first_write = outputs.open
            summary = _fit(cfg, env, run_dir, loop, checkpointing)
        summary.update(wall_s=time.perf_counter() - start)
        ending.report(cfg, env, spec, loop, checkpointing, logger, summary, outputs.writing)
        return summary
    except BaseException as e:
        failing = True
        said = failure.left_behind(e, cfg, env, run_dir, loop, checkpointing, outputs,
                                   ours)
        if said is not None:
            raise said from None
        raise
    finally:
        if loop is not None:  # the loaders' workers, also after an error
            loop.train_feed.close()
            if loop.val_feed is not None:
                loop.val_feed.close()
        release_shm()  # (a sweep's next job runs in this process: not at its exit)
        try:  # (a full disk: the flush at close fails again, and must not replace the
            logger.close()  # error that named the file, nor keep the lock)
        except OSError:
            if not failing:
                raise
        finally:
            lock.release()


def _fit(cfg: DictConfig, env: DistEnv, run_dir: Path, loop: Loop,
         checkpointing: Checkpointing) -> Dict[str, Any]:
    """`loop.fit()` and the final save, watched by the heartbeat. A non-finite stop, or a
    collective that timed out on a lost peer, is re-raised in one line that says which state
    is left to resume from (and, for the peer, which rank stopped)."""
    heartbeat = Heartbeat(env.rank, env.world_size, lambda: (loop.state.step, loop.phase))
    with heartbeat:
        try:
            if cfg.trainer.validate_only:
                return validate_once(loop, cfg.trainer.init_from)
            summary = loop.fit()
            ending.save_final(loop, checkpointing, run_dir, cfg.trainer.max_bad_steps)
            return summary
        except NonFiniteLoss as e:
            checkpointing.finish()
            raise NonFiniteLoss(f"{e}; {ending.last_good(run_dir)}") from None
        except PeerFailedValidation as e:  # (saved: Checkpointing.validation_failed)
            if cfg.trainer.validate_only:  # (it trains nothing: no state to name)
                raise
            raise PeerFailedValidation(f"{e}; {ending.last_good(run_dir)}") from None
        except RuntimeError as e:
            lost = heartbeat.explain(e, cfg.trainer.ddp.timeout_s)
            if lost is None:
                raise
            # (its line says it all: not the backend's text)
            raise PeerLost(f"{lost}; {ending.last_good(run_dir)}") from None

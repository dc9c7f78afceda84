"""How a run ends: a finished run's summary, files and advice; the exit code and status.json
line for what stopped it, the failures said in one line, and the ending of a process whose
peer was lost (README "Exit codes")."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, NoReturn, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from data.advice import count_of
from data.cachewait import WriterGone
from data.loader import LoaderStalled
from data.workerdeath import LoaderWorkerDied
from trainer import checkpoint, distributed, resumefiles, rundir, runlock, stamp, sweepdirs
from trainer.sweep import in_sweep, runs_jobs_here
from trainer.cli import (EXIT_CONFIG, EXIT_INTERRUPTED, USER_ERRORS, SignalledAgain, complete,
                         describe, exit_now, fail)
from trainer.config import RunSpec
from trainer.distributed import DistEnv, JoinFailed
from trainer.feedadvice import feed_advice
from trainer.feeds import skipped_files
from trainer.liveness import OWN_WAIT_S, PeerLost
from trainer.logging import RunLogger
from trainer.loop import Loop
from trainer.preemption import Preempted
from trainer.resilience import Checkpointing
from trainer.task import raised_in_users_code, stoker_notes
from trainer.validation import PeerFailedValidation, values_line
from trainer.windowlog import NonFiniteLoss, OutOfMemory, empty_hint

log = logging.getLogger("stoker")
STALL_ADVICE_ABOVE = 0.10  # share of step time spent waiting for data that earns advice
STALL_ADVICE_STEPS = 10  # ... in a run of this many optimizer steps at least: a shorter one's
# wait is mostly the loader's start-up (a fast dev run's one step), which advice cannot fix

# failures said in one line (exit 2 for the user's errors, else 1); others keep a traceback
ONE_LINE = (*USER_ERRORS, NonFiniteLoss, OutOfMemory, PeerLost, JoinFailed, LoaderStalled,
            LoaderWorkerDied, WriterGone, OSError)


def end_without_peer(e: PeerLost) -> NoReturn:
    """Says `e` (any rank: rank 0 may be the one lost) and ends the process with exit code 1,
    Python's exit handlers run but not C++'s teardown: the backend's threads may still wait on
    the lost peer, and destroying them then aborts the process (SIGABRT, 'terminate called
    without an active exception') after the line was said."""
    validating = isinstance(e, PeerFailedValidation)  # (rank 0 lives: it says it, once)
    e.rank0_asked = True  # (cli.fail: no wait for rank 0's word; the sleep below is this one's)
    try:
        fail(e, code=exit_code(e), any_rank=not validating)
    except SystemExit as done:
        if validating and not distributed.detect().is_main:
            # rank 0 may be the rank whose validation failed, on its way to its traceback:
            # torchrun ends every rank at the first one's exit, and this one's came first
            time.sleep(OWN_WAIT_S)
        exit_now(done.code)


def launcher() -> str:
    """The `_target_` of Hydra's launcher for this launch ("" outside Hydra)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ""
    return str(OmegaConf.select(HydraConfig.get(), "launcher._target_", default="") or "")


def stops_sweep() -> bool:
    """Whether this is a job of a sweep that Hydra's basic launcher runs here, one job after
    another in this process (a launcher such as submitit's runs each job as a job of its
    own, and carries its exception back as it is)."""
    return in_sweep() and runs_jobs_here(launcher())


def sweep_job_failed(e: BaseException) -> None:
    """A sweep job that failed before it opened its files (a refused setting of its own, a
    first batch its task refuses) leaves its status.json in the job dir Hydra made for it,
    where nothing else would say how it ended; the sweep itself stops there (`end_sweep`).
    A job dir with a status.json keeps it."""
    from hydra.core.hydra_config import HydraConfig

    if not in_sweep() or not distributed.detect().is_main:
        return
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    if not job_dir.is_dir() or (job_dir / rundir.STATUS).exists():
        return
    record_failure(job_dir, e)
    if not (job_dir / ".hydra" / "overrides.yaml").exists():
        try:  # what the sweep's table shows of it: its overrides, its job number
            rundir.record_hydra(job_dir, None)
        except OSError:
            pass


def end_sweep(e: BaseException, validating: bool = False) -> NoReturn:
    """A sweep job's crash (an exception with its traceback, not a one-line refusal): the
    traceback now, and the process's exit code, which stops the sweep as a refused job does.
    Hydra's launcher would keep the exception, run the next jobs and raise it at the end, and
    under torchrun a rank that crashed would go on to the next job while its peers wait in
    this one's collectives until `trainer.ddp.timeout_s`, naming it lost, not its error."""
    import traceback

    traceback.print_exception(e)
    say_sweep_stopped(validating=validating)
    raise SystemExit(exit_code(e))


def said_exit(e: SystemExit, at: str, validating: bool = False) -> None:
    """A `sys.exit()` in the user's code during a run (`at`: where), said in one line from
    rank 0; in a sweep that stops there, the sweep's stop line too, and an exit of 0 becomes
    1 (its next jobs never ran: the sweep did not complete). Raises that exit in a sweep."""
    code = exit_code(e)
    if distributed.detect().is_main:
        print(f"stoker: the run ended on your code's sys.exit({e.code!r}){at}", file=sys.stderr,
              flush=True)
    if stops_sweep():
        say_sweep_stopped(validating=validating)
        raise SystemExit(code or 1)


def say_sweep_stopped(e: Optional[BaseException] = None, validating: bool = False) -> None:
    """One line from rank 0: which job stopped the sweep, and how to run on from there (not
    for `e` that a resume of the sweep would meet again: its dir holds another sweep; for a
    sweep of validations, `validating`, a new sweep dir: a validation goes into a new dir, and
    a relaunch with resume=auto refused its jobs')."""
    from hydra.core.hydra_config import HydraConfig

    if distributed.detect().is_main:
        h = HydraConfig.get()
        on = (" (once fixed, the same command in a new hydra.sweep.dir)" if validating else
              " (once fixed, the same command with "
              f"trainer.resume=auto hydra.sweep.dir={h.sweep.dir} "
              + ("keeps the finished ones)" if h.job.num else "runs them all)"))
        print(f"stoker: the sweep stopped at job {h.job.num}"
              + (f" ({h.runtime.output_dir})"  # a hydra.sweep.subdir of one's own
                 if str(h.job.num) != Path(h.runtime.output_dir).name else "")
              + "; the jobs after it were not run"
              + ("" if isinstance(e, sweepdirs.AnotherSweep) else on),
              file=sys.stderr, flush=True)


def record_failure(run_dir: Path, e: BaseException) -> None:
    """`run_dir`'s status.json for a run that ended with `e`."""
    rundir.write_status(run_dir, exit_code(e), status_error(e),
                        word=("exited: SystemExit raised during the run"
                              if type(e) is SystemExit else None))


def refused_before_first_step(run_dir: Path, e: BaseException) -> None:
    """A one-line error before the run's first optimizer step (a first batch the model or the
    task refuses), after train.log's first lines: on the console it is said, and in the log
    too, so that the log does not end mid-start without a reason; a dated dir this launch made
    and nothing else wrote into goes at exit, its log with it, as a launch refused earlier
    leaves none. Rank 0 (the others log to no file)."""
    log_file = os.path.abspath(run_dir / "train.log")
    root = logging.getLogger()
    handlers = [h for h in root.handlers if isinstance(h, logging.FileHandler)
                and os.path.abspath(h.baseFilename) == log_file]
    # (opened at its first line, delay=true: none yet, this launch wrote nothing there, as a
    # refused resume into another run's dir must not)
    if not any(h.stream is not None for h in handlers) or not os.path.exists(log_file):
        return
    try:
        alone = set(os.listdir(run_dir)) <= {"train.log", runlock.LOCK}  # (released next)
    except OSError:
        return
    if alone and stamp.made_here(str(run_dir)):
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()
        try:
            os.remove(log_file)
        except OSError:
            pass
        return
    to_run_log(run_dir, f"stopped before the first step: {describe(e)}")


def to_run_log(run_dir: Path, line: str) -> None:
    """`line` as an error in the run's train.log alone (the console has said it: the error
    line, a traceback), so that the log ends with why the run ended. Rank 0."""
    log_file = os.path.abspath(run_dir / "train.log")
    record = logging.LogRecord("stoker", logging.ERROR, __file__, 0, "%s", (line,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None and \
                os.path.abspath(handler.baseFilename) == log_file:
            handler.handle(record)


def status_error(e: BaseException) -> str:
    """status.json's error line: a crash (not a mistake the run names in one line) keeps its
    exception's type."""
    if type(e) is SystemExit:  # sys.exit() in the user's code, mid-run
        return f"SystemExit({e.code!r})"
    crash = exit_code(e) == 1 and not isinstance(e, ONE_LINE)
    text = describe(e) + raised_in_users_code(e)
    if crash and not text.startswith(f"{type(e).__name__}:"):  # (a worker's line has it)
        text = f"{type(e).__name__}: {text}"
    # the lines Stoker put under the traceback (what the failing code was given, which key it
    # is): the record and a peer's word kept the exception's line alone
    return "; ".join([text, *(" ".join(note.split()) for note in stoker_notes(e))])


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


def report(cfg: DictConfig, env: DistEnv, spec: RunSpec, loop: Loop,
           checkpointing: Checkpointing, logger: RunLogger, summary: Dict[str, Any],
           writing: bool) -> None:
    """Completes a finished run's `summary` (its checkpoints, skipped files, shape, peak
    memory), writes it with status.json (`writing`: rank 0 holds the run's files), says it, and
    advises on the input pipeline where the steps waited for data."""
    t, run_dir = cfg.trainer, Path(cfg.run_dir)
    last = run_dir / checkpoint.CHECKPOINT_DIR / checkpoint.LAST
    summary["checkpoint"] = str(last) if t.save_checkpoint and last.exists() else None
    best = checkpointing.best_record()
    if best is not None and t.save_checkpoint:
        summary["best"] = best
    if checkpointing.mode is not None:  # what a sweep's table ranks its jobs by
        summary["monitor"] = {"key": t.checkpoint.monitor, "mode": checkpointing.mode}
    skipped = skipped_files(loop.train_feed, loop.val_feed)
    if skipped:
        distributed.warn(env, "data: %s skipped (data.dataset.on_error=skip), e.g. %s",
                         count_of(len(skipped), "unreadable file", was=True),
                         ", ".join(skipped[:3]))
    summary.update(skipped_files=len(skipped), global_batch=spec.global_batch,
                   world_size=env.world_size, strategy=spec.strategy.value,
                   precision=t.precision.value, peak_mem_mb=peak_memory_mb(spec),
                   warnings=logger.warnings.count)
    logger.summary(summary)
    if writing:
        rundir.write_status(run_dir, 0, "")
    complete()  # (from here a signal is no failure: the run is complete)
    final_summary_line(summary, env)
    # on CUDA what the GPU waited: a host ahead of its queued steps waits at no cost
    gpu_idle = "run_device_wait_frac" in summary
    stalled = summary.get("run_device_wait_frac" if gpu_idle else "run_data_wait_frac", 0.0)
    if stalled > STALL_ADVICE_ABOVE and loop.state.step >= STALL_ADVICE_STEPS \
            and not t.fast_dev_run and env.is_main:  # (it times a few samples: rank 0's line)
        logger.info("%s", feed_advice(cfg.data, loop.train_feed, spec.device, stalled,
                                      env.local_world_size, gpu_idle))
    busy = busy_cpu_line(loop.run_queued_s, loop.run_train_s, torch.get_num_threads(),
                         spec.device)
    if busy and env.is_main:  # (advice, as the data-wait line's)
        logger.info("%s", busy)


BUSY_CPU_ABOVE = 0.25  # the training thread's share of its time queued for a CPU, warned past


def busy_cpu_line(queued_s: Optional[float], train_s: float, threads: int,
                  device: torch.device) -> Optional[str]:
    """A warning for a run on a CPU that other work shares, with PyTorch's threads past one:
    each operation's threads wait on each other, so one thread taken by another process
    stalls every step (a new user's default job trained 25 to 60 times slower so, the
    data-wait share telling nothing). None where the training thread seldom waited for a
    CPU, ran one thread, or on a GPU (whose host work is the step's launching)."""
    if device.type != "cpu" or threads <= 1 or not queued_s or train_s < 1.0:
        return None
    share = queued_s / train_s
    if share <= BUSY_CPU_ABOVE:
        return None
    return (f"the training thread waited for a CPU {share:.0%} of its time: other work shares "
            f"this machine's cores, and PyTorch's {threads} threads wait on each other at every "
            "operation, so each one taken stalls the step; OMP_NUM_THREADS=1 python train.py "
            "... (or fewer threads) is often many times faster then (README \"A CPU that other "
            "work shares\")")


def save_final(loop: Loop, checkpointing: Checkpointing, run_dir: Path,
                max_bad_steps: int) -> None:
    """The final state saved (skipped if its step is saved already) and every write done, or
    NonFiniteLoss where the run ended on losses that were not finite."""
    bad = loop.bad_steps()  # (collective: every rank takes the same branch)
    if bad and max_bad_steps:  # fewer than max_bad_steps, but the final state is broken
        raise NonFiniteLoss(
            f"the run ended with a loss that was not finite for its last {bad} optimizer "
            f"steps (fewer than trainer.max_bad_steps={max_bad_steps}); its final state was "
            "not saved" + empty_hint(loop, bad))
    # (its last validation ranked for best.pt too: one after the last epoch's callbacks
    # has not been; one that was is no better than itself)
    checkpointing.save_ranked(loop, loop.last_val, periodic=True)
    checkpointing.finish()


def last_good(run_dir: Path) -> str:
    """What a run stopped for losses that were not finite leaves to resume from (no checkpoint
    is saved with such a loss)."""
    last = resumefiles.candidates(run_dir)
    return f"the last good checkpoint is {last[0]}" if last else "no checkpoint was saved"


def complete_because(cfg: DictConfig, loop: Loop) -> Optional[Tuple[str, str]]:
    """Why the run trains no more (a callback's stop, such as early stopping, else its
    limit), and what would train on; None while it has more to train. (Asks the callbacks
    once: an all-reduce under several ranks.)"""
    reason, t = loop.stop_reason(), cfg.trainer
    if reason:
        return f"it stopped early: {reason}", (
            "raise trainer.early_stopping.patience (or set it to 0) to train on"
            if "trainer.early_stopping" in reason else
            "the callback that stopped it decides whether it trains on")
    if not loop.reached_limit():
        return None
    state = loop.state  # (each limit it reached must go past it: "raise either" was not
    needs = [f"trainer.{key}={now + 1} or more" for key, limit, now in  # enough where both)
             (("max_epochs", t.max_epochs, state.epoch), ("max_steps", t.max_steps, state.step))
             if 0 < limit <= now]
    return (f"trainer.max_epochs={t.max_epochs}, trainer.max_steps={t.max_steps}",
            f"give {' and '.join(needs)} to train on")


def past_the_limit(cfg: DictConfig, loop: Loop) -> Optional[str]:
    """Why a resumed run is past a limit the command lowered (trainer.max_steps below its
    step, trainer.max_epochs at or below the epoch it is inside), as one line; None else.
    It ended there at once and rewrote its files as a run ending at that limit: its last
    checkpoints, a validation row, the status "completed", a schedule at its end."""
    state, t = loop.state, cfg.trainer
    if state.validated_step == state.step:
        return None  # (a run complete at its step: nothing_to_do says so)
    keep = "its files are left as they are"
    if t.max_steps > 0 and state.step > t.max_steps:
        return (f"trainer.max_steps={t.max_steps}: the run is at step {state.step} already, "
                f"past it; {keep}; give trainer.max_steps={state.step} or more")
    if 0 < t.max_steps <= state.step:
        return None  # (ended at its step limit: validated and saved there)
    if 0 < t.max_epochs < state.epoch or (t.max_epochs == state.epoch and state.position > 0):
        return (f"trainer.max_epochs={t.max_epochs}: the run is at epoch {state.epoch} step "
                f"{state.step} already, past it; {keep}; give trainer.max_epochs="
                f"{state.epoch + (1 if state.position else 0)} or more to finish its epoch, "
                f"or trainer.max_steps={state.step} to end it where it is")
    return None


def nothing_to_do(cfg: DictConfig, run_dir: Path, loop: Loop,
                   logger: RunLogger) -> Dict[str, Any]:
    """What a run resumed from its final checkpoint returns, writing nothing: the summary its
    run dir holds (where this rank can read it), and one line saying so."""
    state = loop.state
    why, how = complete_because(cfg, loop)  # (complete: not None)
    logger.info("nothing to train: the run is complete at epoch %d step %d (%s) and its files "
                "are left as they are; %s", state.epoch, state.step, why, how)
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    return {**summary, "epochs": state.epoch, "steps": state.step, "complete": True}


def peak_memory_mb(spec: RunSpec) -> float:
    """Peak memory of this run: CUDA allocations since it began on the busiest of its GPUs
    (reset at its start, so a sweep's jobs in one process each report their own), resident
    set size of the process on CPU."""
    gpus = spec.gpus
    if gpus:
        return max(torch.cuda.max_memory_allocated(d) for d in gpus) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def final_summary_line(s: Dict[str, Any], env: DistEnv) -> None:
    if not env.is_main:
        return
    val = values_line({k: v for k, v in s.items() if k.startswith("val_")}) or "no validation"
    if s.get("validate_only"):
        log.info("validated %s: %s over %s in %.1fs (validation %.1fs)", s["weights"], val,
                 count_of(s["validated_samples"], "sample"), s["wall_s"], s["run_val_s"])
        if s.get("warnings"):
            log.info("%s above", count_of(s["warnings"], "warning"))
        return
    gpu = (f" (GPU idle for data {100 * s['run_device_wait_frac']:.1f}%)"
           if "run_device_wait_frac" in s else "")
    # (by its time, not its samples: a batch of one's own whose size cannot be told counts 0)
    rates = ("no training step in this launch" if not s["run_train_s"] else
             f"{s['run_samples_per_s']:.0f} samples/s"
             + (f" ({s['run_tokens_per_s']:.0f} tokens/s)" if "run_tokens_per_s" in s else "")
             + f" | waiting for data {100 * s['run_data_wait_frac']:.1f}% of step time{gpu}")
    log.info("done: %s, %s in %.1fs (training %.1fs, validation %.1fs, "
             "checkpoints %.1fs) | %s | %s%s", count_of(s["epochs"], "epoch")
             + (" (stopped early)" if "stopped_early" in s else ""),
             count_of(s["steps"], "step"), s["wall_s"], s["run_train_s"], s["run_val_s"],
             s["run_checkpoint_s"], val, rates,
             f" | checkpoint {s['checkpoint']}" if s["checkpoint"] else "")
    if s.get("warnings"):  # (the config dump may have pushed them off the screen)
        log.info("%s above", count_of(s["warnings"], "warning"))
    if "best" in s:
        b = s["best"]
        log.info("best.pt: step %d, %s %.4f", b["step"], b["monitor"], b["value"])

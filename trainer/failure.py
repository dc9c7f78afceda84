"""What a run that raised leaves behind: its background checkpoint write completed, its
failure recorded where its run dir keeps one, and the error to raise in one line instead (a
loader worker's death, a lost peer)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from data.workerdeath import worker_died
from trainer import ending, liveness, rundir, startup, validation
from trainer.cli import SignalledAgain
from trainer.components import raised_in_torch_optim, says_no_memory
from trainer.distributed import DistEnv
from trainer.liveness import PeerLost
from trainer.loop import Loop
from trainer.config import first_line
from trainer.oneline import describe
from trainer.preemption import Preempted
from trainer.resilience import Checkpointing
from trainer.windowlog import OutOfMemory

log = logging.getLogger("stoker")


def left_behind(e: BaseException, cfg: DictConfig, env: DistEnv, run_dir: Path,
                loop: Optional[Loop], checkpointing: Optional[Checkpointing],
                outputs: Optional[startup.FirstStepOutputs], ours: bool
                ) -> Optional[BaseException]:
    """What a run that raised `e` leaves behind (its background checkpoint write completed,
    its failure recorded) and the error to raise instead of `e`: a loader worker's death, a
    lost peer or a step out of memory said in one line; None to raise `e` itself."""
    if checkpointing is not None and not isinstance(e, (KeyboardInterrupt, SignalledAgain)):
        # the checkpoint being written in the background is the last good state: complete
        # it before the process ends (a second signal stops at once: cli._exit)
        unwritten = checkpointing.saver.settle()
        if unwritten is not None and env.is_main:
            log.warning("checkpoint: the last background write failed too: %s",
                        describe(unwritten))
    # (said in one line wherever the training thread met it; how, from its process)
    died = worker_died(e, [] if loop is None else [
        feed.loader for feed in (loop.train_feed, loop.val_feed) if feed is not None]) or \
        out_of_memory(e, loop)
    lost = _record_failure(died or e, env, run_dir, loop, outputs, ours,
                           cfg.trainer.ddp.timeout_s)
    return lost or died


def out_of_memory(e: BaseException, loop: Optional[Loop]) -> Optional[OutOfMemory]:
    """The one line for a step of the loop that ran out of memory (a traceback from inside
    torch's allocator before): where (the optimizer's first step allocates its state, two
    values a parameter for AdamW), and what to shrink. None for other errors."""
    if loop is None or loop.phase not in ("training", "validating", "sanity check") or \
            not isinstance(e, (RuntimeError, MemoryError)) or \
            not says_no_memory(e) or \
            "in DataLoader worker" in str(e):  # (a worker's: its traceback tells, not a step)
        return None
    optim = raised_in_torch_optim(e, innermost=False)
    params = sum(p.numel() for p in loop.params)
    text = first_line(e)  # (CUDA's runs on for a paragraph: its first sentences)
    text = text if len(text) <= 300 else text[:text.rfind(" ", 0, 300)] + " ..."
    where = ("in the optimizer's step, which allocates its state at the first (AdamW two "
             "values a parameter; optim=sgd one, or none without momentum)" if optim else
             "in a validation batch's forward" if loop.phase == "validating" else
             f"in {validation.SANITY}" if loop.phase == "sanity check" else
             "in the forward and backward")
    return OutOfMemory(f"out of memory at step {loop.state.step} {where}, for a model of "
                       f"{params:,} parameters ({text}); a smaller "
                       "data.batch_size (trainer.accumulate_grad_batches=k keeps the global "
                       "batch), trainer.precision=bf16, or a smaller model")


def _record_failure(e: BaseException, env: DistEnv, run_dir: Path, loop: Optional[Loop],
                    outputs: Optional[startup.FirstStepOutputs],
                    ours: bool, timeout_s: float) -> Optional[PeerLost]:
    """Leaves a failed run's record where the run dir should keep one; `ours`: the dir's
    checks passed, so it is this run's to write. Returns the error that names a lost peer (with
    its own error) when `e` was a collective whose peer ended, to be raised instead of `e`."""
    lost = liveness.lost_at(e, env.rank, env.world_size,
                            None if outputs is None else loop.state.step, timeout_s)
    e = lost or e
    if (outputs is not None and outputs.writing) or (ours and lost is not None) or (
            ours and isinstance(e, Exception) and not isinstance(e, ending.ONE_LINE)
            and not (run_dir / rundir.STATUS).exists()):
        # before the first step, a crash or a lost peer (what is said in one line is said
        # on the console, and leaves no dir behind) into a dir with no run's record
        ending.record_failure(run_dir, e)
        if isinstance(e, Exception) and not isinstance(e, Preempted):  # (it says so itself)
            where = "before the first step" if outputs is None else f"at step {loop.state.step}"
            ending.to_run_log(run_dir, f"failed {where}: {ending.status_error(e)}")
    elif ours and isinstance(e, ending.ONE_LINE):
        ending.refused_before_first_step(run_dir, e)
    return lost

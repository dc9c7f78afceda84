"""Surviving interruptions: full training state in and out of checkpoints (the signals that
stop a run: trainer/preemption.py).

A checkpoint holds everything a run needs to continue as if never stopped: weights,
optimizer, scheduler, GradScaler, progress (epoch, step, position inside the epoch in global
samples), every rank's RNG states (python, numpy, torch CPU, every CUDA device, the loader's
generator), the resolved config and the world size. Checkpoints are taken only at
optimizer-step boundaries, never inside an accumulation window.
"""
from __future__ import annotations

import contextlib
import math
import random
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from trainer import checkpoint, distributed, resumefiles, saver
from trainer.logging import write_whole
from trainer.distributed import DistEnv
from trainer.earlystop import improves
from trainer.liveness import writer_barrier
from trainer.loop import Callback
from trainer.cli import EXIT_INTERRUPTED
from trainer.oneline import describe
from trainer.config import async_checkpoints
from trainer.preemption import EXIT_PREEMPTED, Preempted, Preemption

def rng_state(loader_state: Optional[torch.Tensor],
              gpus: Sequence[torch.device] = ()) -> Dict[str, Any]:
    """This process's random states, in types a weights-only load accepts; `loader_state`
    is the state the loader's generator must have when the resumed epoch starts. On CUDA
    the generators of `gpus`, the ones the rank computes on (its own; all of dp's), in that
    order: a resume that sees another set of GPUs (a full node, then one GPU per task)
    restores the rank's own all the same."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                       "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}}
    if gpus:
        state["cuda_used"] = [torch.cuda.get_rng_state(gpu) for gpu in gpus]
    if loader_state is not None:
        state["loader"] = loader_state
    return state


def set_rng_state(state: Dict[str, Any], loader_generator: Optional[torch.Generator],
                  gpus: Sequence[torch.device] = ()) -> None:
    """Restores what `rng_state` saved: the CUDA generators of the GPUs the saving rank
    used, in order, onto this rank's `gpus` (as many as both have); a checkpoint of an
    earlier version saved every visible GPU's, by index."""
    random.setstate(_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    for gpu, saved in zip(gpus, state.get("cuda_used", [])):
        torch.cuda.set_rng_state(saved, gpu)
    if "cuda" in state and "cuda_used" not in state:
        for gpu in gpus:
            if gpu.index < len(state["cuda"]):
                torch.cuda.set_rng_state(state["cuda"][gpu.index], gpu)
    if loader_generator is not None and "loader" in state:
        loader_generator.set_state(state["loader"])


def _tuples(obj):
    """random.setstate needs tuples where a round trip may have produced lists."""
    return tuple(_tuples(v) for v in obj) if isinstance(obj, (list, tuple)) else obj


def gather(obj: Any) -> List[Any]:
    """`obj` from every rank, in rank order (a one-element list in a single process)."""
    if not distributed.is_active():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    with distributed.waiting():
        dist.all_gather_object(out, obj)
    return out


def capture(loop, config: Dict[str, Any], env: DistEnv,
            gpus: Sequence[torch.device] = ()) -> Dict[str, Any]:
    """The full training state (collective: every rank must call it; rank 0 gets it all).
    `config`: the run's resolved config as a plain container (resolved once per run);
    `gpus`: the GPUs whose random states are saved (see rng_state)."""
    generator = loop.train_feed.loader.generator
    # mid-epoch the loader must replay this epoch's iterator, so its generator state from
    # the epoch's start; at an epoch's end (its last step's position too: a save there, the
    # validation after it stopped or killed), its state now, past the draws of the epoch's
    # iterator (a resume there takes no more of the epoch: the next epoch's iterator drew
    # this one's worker seeds again)
    mid = 0 < loop.state.position < loop.epoch_end
    loader = loop.loader_rng if mid else (
        generator.get_state() if generator is not None else None)
    rngs = gather(rng_state(loader, gpus))
    return {**loop.state_dict(), "rng": rngs, "world_size": env.world_size,
            "config": config}


class Checkpointing(Callback):
    """Decides when the loop saves: every N steps, every N epochs, on preemption, at the
    end; tracks best.pt (`monitor` in the checked `mode`, see checks.monitor_mode); never
    saves a state whose recent losses were not finite."""

    def __init__(self, cfg: DictConfig, env: DistEnv, run_dir: Path, logger, enabled: bool,
                 preemption: Optional[Preemption] = None, mode: Optional[str] = None,
                 device: torch.device = torch.device("cpu"),
                 gpus: Sequence[torch.device] = ()):
        c = OmegaConf.to_object(cfg.trainer.checkpoint)  # plain values: read every step
        self.cfg, self.env, self.c, self.logger = cfg, env, c, logger
        # resolved once, at the first save: the config does not change once the run is built
        # and restored (a resume records there what the checkpoint's state kept), and
        # resolving it took half of a small checkpoint's time
        self._config: Optional[Dict[str, Any]] = None
        self.device, self.gpus = device, list(gpus)
        folder = Path(run_dir) / checkpoint.CHECKPOINT_DIR
        if enabled and folder.exists() and not folder.is_dir():  # every rank: all stop alike
            raise checkpoint.CheckpointWriteError(
                f"checkpoints cannot be written in {folder}: a file is in the way of the "
                "folder; move it, or set trainer.save_checkpoint=false")
        named = [*checkpoint.step_files(folder), folder / checkpoint.LAST,
                 folder / checkpoint.BEST] if enabled and folder.is_dir() else []
        folders = [p.name for p in named if p.is_dir()]
        if folders:  # (a save failed at it after the training, "Is a directory")
            raise checkpoint.CheckpointWriteError(
                f"checkpoints cannot be written in {folder}: {folders[0]} is a folder, named as "
                "the run names its checkpoints; move it, or set trainer.save_checkpoint=false")
        self.saver = saver.Checkpointer(run_dir, c.keep_last, False,
                                             enabled=enabled and env.is_main)
        if env.world_size > 1:  # (every rank builds it here: the group its writes wait in)
            distributed.write_group(c.timeout_s)
        self.enabled, self.preemption, self.mode = enabled, preemption, mode
        self.run_dir = run_dir
        self.best: Optional[float] = None  # the monitored value best.pt holds ...
        self.best_step = -1  # ... and its step
        self.saved_validated = -1  # the saved state's validated_step
        self.unranked = False  # a monitored value that was not finite has been reported
        self.abandoned: List[Path] = []  # checkpoints of a rolled-back timeline (roll_back)

    def roll_back(self, abandoned: List[Path]) -> None:
        """The run resumed from an earlier step of its own: `abandoned` (resumefiles.abandoned)
        goes aside at `set_aside`; without its best.pt, the first validation makes a new one."""
        self.abandoned = abandoned
        if any(p.name == checkpoint.BEST for p in abandoned):
            self.best, self.best_step = None, -1

    def set_aside(self, step: int, rows: Sequence[str] = ()) -> None:
        """Rank 0, with the run's first files: moves the rolled-back checkpoints aside, with
        the metrics.jsonl `rows` that timeline logged past `step` (which left metrics.jsonl:
        they were dropped before, with the timeline's checkpoints kept)."""
        folder = resumefiles.set_aside(self.abandoned, step)
        if folder is not None:
            if rows:
                write_whole(folder / "metrics.jsonl", "".join(row + "\n" for row in rows))
            summary = self.run_dir / "summary.json"  # (that timeline's numbers and last.pt:
            if summary.is_file():  # the new one writes its own at its end)
                summary.replace(folder / summary.name)
            self.logger.info(
                "%s: resumed at step %d of this run, so the %d checkpoint files saved after it "
                "(%s)%s moved to %s, out of the way of trainer.resume=auto and keep_last; "
                "nothing was deleted", folder.parent, step, len(self.abandoned),
                ", ".join(p.name for p in self.abandoned),
                (f", the {len(rows)} metrics.jsonl rows logged after it" if rows else "")
                + (" and its summary.json" if (folder / "summary.json").is_file() else ""),
                folder.name)
        self.abandoned = []

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """best.pt's value, so that a resumed run replaces it only with a better one."""
        record = self.best_record()
        return None if record is None else {**record, "mode": self.mode}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Takes the saved best only where it still describes this run's best.pt: the same
        key and direction, and the file there (a checkpoint of another run starts afresh)."""
        if ((state.get("monitor"), state.get("mode")) == (self.c.monitor, self.mode)
                and math.isfinite(float(state["value"]))  # (an older version's nan best)
                and (self.run_dir / checkpoint.CHECKPOINT_DIR / checkpoint.BEST).exists()):
            self.best, self.best_step = float(state["value"]), int(state["step"])

    def best_record(self) -> Optional[Dict[str, Any]]:
        """For the summary: what best.pt holds (None without a monitor or a validation)."""
        if not self.c.monitor or self.best is None:
            return None
        return {"monitor": self.c.monitor, "value": self.best, "step": self.best_step}

    def save(self, loop, best: bool = False) -> bool:
        """Saves the loop's state (collective); a step already saved is saved again only
        to become best.pt, or once it has been validated (the final state: a run resumed from
        it knows it is complete). False where it refused to (a loss that is not finite)."""
        if not self.enabled or (self.saver.last_saved_step == loop.state.step and not best
                                and self.saved_validated == loop.state.validated_step):
            return True
        bad = loop.bad_steps()  # agreed: no rank goes into capture's gather alone
        if bad:
            from trainer.windowlog import check_finite

            check_finite(loop, bad)  # past trainer.max_bad_steps: stopped here, not at the
            # next logging boundary (a run of max_bad_steps=4 went on for 19 such steps)
            self.logger.warning(  # (agreed: said once)
                "not saving a checkpoint at step %d: the loss is not finite; %s",
                loop.state.step, "the last good checkpoint stays" if
                self.saver.last_saved_step is not None or resumefiles.candidates(self.run_dir)
                else "no checkpoint was saved before it")
            return False
        phase, loop.phase = loop.phase, "checkpointing"
        start = time.perf_counter()
        if self._config is None:
            self._config = OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
        state = capture(loop, self._config, self.env, self.gpus)
        size = checkpoint.state_bytes((state["model"], state["optimizer"]))
        if distributed.is_active():  # whether ranks wait in the barrier below: agreed
            size = int(distributed.all_reduce_max(
                torch.tensor([float(size)], device=self.device)).item())
        async_save = async_checkpoints(self.c, self.device, size)
        with self._writing():
            self.saver.save(state, loop.state.step, best=best, async_save=async_save)
            self.saved_validated = loop.state.validated_step
            if not async_save:
                # rank 0 writes, the others wait for a complete file: longer than a collective
                writer_barrier(self.c.timeout_s, self.cfg.trainer.ddp.timeout_s)
        loop.run_checkpoint_s += time.perf_counter() - start
        loop.phase = phase
        return True

    def after_step(self, loop) -> None:
        n = self.c.every_n_steps
        if n and loop.state.step % n == 0:
            self.save(loop)
        self._stop_if_agreed(loop)

    def _stop_if_agreed(self, loop, now: bool = False) -> None:
        """Saves and raises Preempted once the ranks agree a stop was asked for (`now`: the
        agreement read at once, Preemption.agreed)."""
        if self.preemption is not None and self.preemption.agreed(now):
            self.save(loop)
            self.finish()
            ctrl_c = self.preemption.kind == 2
            saved = (f"checkpoint saved, resume with {resumefiles.resume_said(self.run_dir)}"
                     if self.enabled else "no checkpoint saved (trainer.save_checkpoint=false)")
            sweep = resumefiles.sweep_resume_args() if self.enabled else None
            if sweep:  # (the jobs after this one never ran)
                saved += f"; or the whole sweep with {sweep}"
            raise Preempted(f"stopped on {'a Ctrl-C' if ctrl_c else 'a preemption signal'} at "
                            f"step {loop.state.step}; {saved}",
                            EXIT_INTERRUPTED if ctrl_c else EXIT_PREEMPTED)

    def after_epoch(self, loop, val: Optional[Dict[str, float]]) -> None:
        n = self.c.every_n_epochs
        self.save_ranked(loop, val, periodic=bool(n and loop.state.epoch % n == 0))
        if loop.reached_limit():
            # the run's last epoch, validated: it completes now (its summary, the status
            # "completed"). Stopped here as preempted, its resume found nothing to train and
            # left the run "preempted" for ever, with no summary.json
            return
        # a signal during the epoch's validation stops here, at the epoch's end, not a step
        # into the next epoch (under DDP too: the ranks agree at once, not a step later)
        self._stop_if_agreed(loop, now=True)

    def validation_stopped(self, loop) -> None:
        """A signal stopped the validation (every rank hears of it alike): the trained state
        is saved as its last step left it, and the run stops (Preempted)."""
        self._stop_if_agreed(loop, now=True)

    def validation_failed(self, loop) -> None:
        """The trained state saved before the validation's error is said (the steps since
        the last save went with it), and written: the error ends the process. Under DDP only
        where every rank raised alike (a rank's shard that raised is agreed at the sums: its
        peers raise too); a rank alone in an error may have peers waiting in the validation's
        collectives, which a save's would not meet."""
        if not self.enabled or (self.env.world_size > 1 and not loop.val_failure_agreed):
            return
        try:
            saved = self.save(loop)
            self.finish()  # (under DDP a peer's exit ends this process: the file first)
        except Exception as e:  # noqa: BLE001  (the validation's error is the one said last)
            self.logger.warning("validation failed after step %d, and saving the trained "
                                "state failed too: %s", loop.state.step, describe(e))
            return
        if saved:
            self.logger.warning(
                "validation failed after step %d: the trained state is saved in %s "
                "(trainer.resume=auto continues from it once the validation data or metric "
                "is mended; that validation is not taken again before the run's end)",
                loop.state.step, self.run_dir / checkpoint.CHECKPOINT_DIR / checkpoint.LAST)

    def save_ranked(self, loop, val: Optional[Dict[str, float]], periodic: bool) -> None:
        """Saves the state where `val` makes a new best.pt, or where `periodic`. The end of
        a run calls it with its last validation too: one after the last epoch's callbacks
        (max_steps inside an epoch, another run's complete checkpoint validated again)."""
        best, previous = False, (self.best, self.best_step)
        if self.c.monitor and val and self.c.monitor in val:
            value = val[self.c.monitor]
            # a value that is not a number ranks with none (earlystop.improves)
            if not math.isfinite(value) and not self.unranked and self.env.is_main:
                self.unranked = True
                distributed.warn(self.env, "trainer.checkpoint.monitor=%s is %s at step %d: "
                                 "not a value to rank, so it never becomes best.pt",
                                 self.c.monitor, value, loop.state.step)
            if improves(value, self.best, self.mode):  # (set first: the saved state holds it)
                self.best, self.best_step, best = value, loop.state.step, True
        if best or periodic:
            saved = self.save(loop, best=best)
            if best and not saved:  # not written: best.pt holds the previous one
                self.best, self.best_step = previous

    def finish(self) -> None:
        """Waits for a background write, then for every rank (all files complete)."""
        with self._writing():
            self.saver.wait()
            writer_barrier(self.c.timeout_s, self.cfg.trainer.ddp.timeout_s)

    @contextlib.contextmanager
    def _writing(self):
        """A second preemption signal lets the write in this block finish (Preemption)."""
        if self.preemption is None:
            yield
            return
        before, self.preemption.writing = self.preemption.writing, True
        try:
            yield
        finally:
            self.preemption.writing = before

"""How many operations a training step dispatches: is the step bound by the host's launches?

    python scripts/count_ops.py                                   # the default job
    python scripts/count_ops.py experiment=tokens_transformer model.layers=6 optim.foreach=true
    python scripts/count_ops.py --skip 20 --steps 40 --out ops.json data=synthetic model=cnn

Trains the config as train.py does (the overrides last, then trainer.max_steps = skip + steps
and no checkpoints; one process, nothing written but a temporary run dir) and counts the ATen
operations the training thread dispatches during `--steps` optimizer steps after the first
`--skip` (start-up and the first steps' allocations left out): forward, backward, optimizer,
the launcher's own, and the logging boundaries' and epoch ends' share (validation runs once,
after the last step, and is not counted; loader workers' and other threads' operations are
not the training thread's). Each operation is of a kind: `work` (roughly one kernel on a
GPU; a multi-tensor `_foreach_*` operation launches several), `view` (a tensor's metadata, no
kernel), `marker` (a profiler range) or `read` (`item()` and the like: a host sync when the
tensor is on a GPU, none for a CPU tensor such as AdamW's step counts, which the counter
cannot tell apart; other operations that sync, such as `nonzero`, count as work). Under
torchrun every rank counts its own steps (collectives included) and rank 0 reports.

Why count: on a GPU each `work` operation is roughly one kernel launch, and each costs the
host some microseconds of Python, dispatch and launch. A step whose GPU work is shorter than
its operations x that cost is bound by the host: the GPU idles between kernels and the
throughput follows the host's speed. Fewer, larger operations help (larger batches, a fused
or multi-tensor optimizer, torch.compile).

A CPU gives the count of a GPU run of the same config closely, not exactly: PyTorch's
optimizers take the multi-tensor path by default only on CUDA (`optim.foreach=true` shows it
on a CPU); on CUDA, batches formed on the host add a copy per tensor and the prefetcher's
`record_stream` calls; autocast casts a few operations differently on CPU and CUDA; fp16 (CUDA
only) adds the GradScaler's operations; and `data.num_workers=auto` resolves by the machine's
cores (with no workers, the collate's operations are the training thread's). A compiled
model's steps run kernels that a dispatch mode does not see: `trainer.compile.enabled=true` is
refused.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchlib import (at_least, check_out, machine, prog, run_main, table,  # noqa: E402
                      write_json)

COLUMNS = ["op", "per_step", "kind"]
HOST_READ = "aten._local_scalar_dense.default"  # item(), bool(), int() of a tensor


def kind(name: str, is_view: bool) -> str:
    """What an operation costs a GPU: `work` (a kernel, roughly), `view` (metadata only),
    `marker` (a profiler range), `read` (a value read to the host: a sync from a GPU)."""
    if is_view:
        return "view"
    if name.startswith("profiler."):
        return "marker"
    return "read" if name == HOST_READ else "work"


def count(overrides: List[str], skip: int, steps: int) -> Dict[str, Any]:
    """Operations dispatched per optimizer step of `overrides`' training, steps skip+1 to
    skip+steps: {"per_step": total, "work", "view", "marker", "read": the total by `kind`,
    "ops": {op name: per step}, "kinds": {op name: kind}}."""
    from hydra import compose, initialize_config_dir
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.config import ConfigError
    from trainer.loop import Callback
    from trainer.runner import train

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()
            self.kinds: Dict[str, str] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            self.ops[name] += 1
            if name not in self.kinds:
                self.kinds[name] = kind(name, func.is_view)
            return func(*args, **(kwargs or {}))

    counter = Counter()
    last = skip + steps

    counting = []

    class Span(Callback):  # counts from the end of step `skip` to the end of step `last`
        def after_step(self, loop) -> None:
            if loop.state.step == skip:
                counter.__enter__()
                counting.append(True)
            elif loop.state.step == last:
                counter.__exit__(None, None, None)
                counting.pop()

    with tempfile.TemporaryDirectory(prefix="stoker-ops-") as tmp:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[
                *overrides, f"hydra.run.dir={tmp}", f"run_dir={tmp}",
                f"trainer.max_steps={last}", "trainer.save_checkpoint=false",
                "trainer.progress_bar=false", "trainer.val_every_n_epochs=1000000",
                "trainer.limit_val_batches=1"])  # validated once, after the last step
        if cfg.trainer.compile.enabled:
            raise ConfigError("trainer.compile.enabled=true: a compiled step runs kernels a "
                              "dispatch mode does not see; count the eager step "
                              "(trainer.compile.enabled=false)")
        try:
            summary = train(cfg, callbacks=[Span()])
        finally:
            if counting:  # the run ended inside the span
                counter.__exit__(None, None, None)
    if summary["steps"] < last:
        raise ConfigError(f"the run stopped after {summary['steps']} steps, before step "
                          f"{last} (--skip {skip} + --steps {steps}); raise "
                          "trainer.max_epochs or the data's size, or count fewer steps")
    ops = {k: v / steps for k, v in counter.ops.most_common()}
    totals = {k: sum(v for op, v in ops.items() if counter.kinds[op] == k)
              for k in ("work", "view", "marker", "read")}
    return {"per_step": sum(ops.values()), **totals, "ops": ops, "kinds": counter.kinds}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip", type=at_least(1), default=20, help="optimizer steps before counting")
    p.add_argument("--steps", type=at_least(1), default=20, help="optimizer steps counted")
    p.add_argument("--top", type=at_least(1), default=25, help="operations listed")
    p.add_argument("--out", type=Path, help="write the counts as JSON here")
    p.add_argument("overrides", nargs="*", help="config overrides, as for train.py")
    a = p.parse_intermixed_args(argv)  # options before, between or after the overrides
    check_out(p, a.out)
    from trainer.cli import USER_ERRORS, fail, import_from_cwd
    from trainer.distributed import detect
    from trainer.preemption import Preempted

    import_from_cwd()  # the user's own modules, as train.py finds them

    try:
        got = count(a.overrides, a.skip, a.steps)
    except USER_ERRORS as e:
        fail(e)
    except Preempted as e:  # a Ctrl-C or SIGTERM stops the run at a step: nothing counted
        if detect().is_main:
            print(f"{prog()}: {str(e).split(';')[0]}; nothing counted or written",
                  file=sys.stderr, flush=True)
        raise SystemExit(e.code) from None
    result = {"machine": machine(), "overrides": a.overrides, "skip": a.skip,
              "steps": a.steps, **got}
    if not detect().is_main:  # under torchrun: every rank counts, rank 0 reports
        return result
    rows = [{"op": k, "per_step": v, "kind": got["kinds"][k]}
            for k, v in list(got["ops"].items())[:a.top]]
    print(table(rows, COLUMNS))
    print(f"{got['per_step']:.1f} operations a step: {got['work']:.1f} that do work (about "
          f"one kernel each on a GPU), {got['view']:.1f} views, {got['marker']:.1f} profiler "
          f"markers, {got['read']:.1f} reads of a value to the host (each a sync where the "
          "tensor is on a GPU; AdamW's step counts are CPU tensors)")
    if a.out:
        write_json(a.out, result)
        print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    run_main(main)

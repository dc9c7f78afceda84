"""The runners scripts/bench_overhead.py times, each in a fresh process (its docstring says
what each one is and how it is read): a hand-written loop (`plain_loop`), the same steps
through Lightning (`lightning_loop`) and through Stoker's `train()` (`stoker`), and the two in
one process in turn (`lockstep`, `lockstep_null`). Every runner starts from the same weights
and trains in the same order, so that they compute the same steps.
"""
from __future__ import annotations

import cProfile
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-3
SEED = 42  # train.py's seed: the initial weights and the epochs' order
EPOCHS = 100000  # Stoker's runs end at --steps (trainer.max_steps), never at an epoch


class Clock:
    """Wall and CPU time between the end of step `warmup` and the end of step `steps`, and
    the fastest of `segments` equal stretches in between: other processes' bursts on a shared
    machine slow some stretches, rarely all of them. With `profile` (a file's path) the same
    steps run under cProfile, and the file gets each function's time per step."""

    def __init__(self, warmup: int, steps: int, device, segments: int = 5,
                 profile: Optional[str] = None):
        self.warmup, self.steps, self.device = warmup, steps, device
        self.every = max(1, (steps - warmup) // segments)
        self.marks: List[tuple] = []
        self.profile, self.profiler = profile, cProfile.Profile() if profile else None

    def tick(self, step: int) -> None:
        if step >= self.warmup and ((step - self.warmup) % self.every == 0
                                    or step == self.steps):
            if self.device.type == "cuda":
                import torch

                torch.cuda.synchronize(self.device)
            self.marks.append((step, time.perf_counter(), time.process_time()))
            if self.profiler is not None and len(self.marks) == 1:  # (the timed steps')
                self.profiler.enable()
            elif self.profiler is not None and step == self.steps:
                self.profiler.disable()
                profile_steps(self.profiler, step - self.marks[0][0], self.profile)

    def result(self, batch: int) -> Dict[str, float]:
        (s0, w0, c0), (s1, w1, c1) = self.marks[0], self.marks[-1]
        n = s1 - s0
        best = min((b[1] - a[1]) / (b[0] - a[0]) for a, b in zip(self.marks, self.marks[1:]))
        return {"samples_per_s": n * batch / (w1 - w0), "step_us": 1e6 * (w1 - w0) / n,
                "cpu_us": 1e6 * (c1 - c0) / n, "best_step_us": 1e6 * best}


def profile_steps(profiler: cProfile.Profile, steps: int, path: str, top: int = 40) -> None:
    """Writes the `top` functions by their own time, each as microseconds and calls per step
    (profiled steps run slower than unprofiled ones: read the shares, not the totals)."""
    profiler.create_stats()
    stats = profiler.stats  # {(file, line, name): (cc, calls, tottime, cumtime, callers)}
    total = sum(v[2] for v in stats.values()) or 1e-9  # (no call timed: an empty table)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = [f"{steps} steps profiled, {1e6 * total / steps:.0f} us of own time per step",
             f"{'own_us':>8} {'share':>6} {'cum_us':>8} {'calls':>6}  function"]
    for (file, line, name), (_, calls, own, cum, _) in rows:
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        lines.append(f"{1e6 * own / steps:8.1f} {own / total:6.1%} {1e6 * cum / steps:8.1f} "
                     f"{calls / steps:6.1f}  {where}")
    Path(path).write_text("\n".join(lines) + "\n")


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _trainers_math() -> None:
    """The hand-written runners compute as train.py does by default (trainer.tf32=true,
    trainer.cudnn_benchmark=true): on CUDA, TF32 matmuls and convolutions and cuDNN's
    autotuned algorithms, so that a ratio measures the loop, not the kernels. The same calls as
    trainer/speed.py's, without importing it (a plain process starts with torch alone)."""
    import torch

    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True


def _parts(w: Dict[str, Any]):
    """The dataset and model of workload `w`, built as train.py builds them: the model right
    after seeding with SEED (train.py's `seed`), so every runner starts from the same weights."""
    import torch

    from data.datasets import DigitsDataset, SyntheticDataset
    from trainer.models import MLP, SmallCNN

    if w["name"] == "tiny":
        ds = DigitsDataset("train")
        torch.manual_seed(SEED)
        return ds, MLP([1, 8, 8], 10)
    ds = SyntheticDataset("train", num_samples=w["samples"], input_shape=[3, 32, 32])
    torch.manual_seed(SEED)
    return ds, SmallCNN([3, 32, 32], 10)


def _sampler(ds):
    """The order every runner trains in: torch's DistributedSampler (one replica), whose epoch
    permutation (seed + epoch) is the one Stoker's sampler draws."""
    from torch.utils.data import DistributedSampler

    return DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=SEED)


def _batches(w: Dict[str, Any], ds, device, indexed: bool):
    """An endless iterator of (x, y) batches on `device`, reshuffled every epoch."""
    import torch

    if indexed:  # tensors in memory (on the device), batches by indexing a permutation
        x, y = (t.to(device) for t in ds.tensors)
        g = torch.Generator()
        for epoch in itertools.count():
            g.manual_seed(SEED + epoch)  # DistributedSampler's permutation, as a tensor
            order = torch.randperm(len(y), generator=g).to(device)
            for idx in order.split(w["batch"]):
                yield x[idx], y[idx]
    sampler = _sampler(ds)
    loader = torch.utils.data.DataLoader(
        ds, batch_size=w["batch"], sampler=sampler, num_workers=w["workers"],
        persistent_workers=w["workers"] > 0, prefetch_factor=2 if w["workers"] else None,
        pin_memory=device.type == "cuda")
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def param_sum(model) -> float:
    """A fingerprint of the weights: runners that took the same steps end with the same one
    (up to float rounding)."""
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def plain_stepper(w: Dict[str, Any], indexed: bool):
    """The hand-written reference: its model and a function that takes one step."""
    import torch
    import torch.nn.functional as F

    device = _device()
    _trainers_math()
    ds, model = _parts(w)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = _batches(w, ds, device, indexed)

    def step() -> None:
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return model, step


def plain_loop(w: Dict[str, Any], indexed: bool = False) -> Dict[str, float]:
    """The hand-written reference's steps, timed."""
    model, step = plain_stepper(w, indexed)
    clock = Clock(w["warmup"], w["steps"], _device(), profile=w.get("profile"))
    for n in range(1, w["steps"] + 1):
        step()
        clock.tick(n)
    return dict(clock.result(w["batch"]), param_sum=param_sum(model))


def lightning_loop(w: Dict[str, Any]) -> Dict[str, float]:
    """The same steps through Lightning's Trainer (no logger, no checkpoint files)."""
    try:
        import lightning as L
    except ImportError:
        import pytorch_lightning as L
    import torch
    import torch.nn.functional as F

    _trainers_math()
    ds, model = _parts(w)
    loader = torch.utils.data.DataLoader(  # Lightning calls the sampler's set_epoch
        ds, batch_size=w["batch"], sampler=_sampler(ds), num_workers=w["workers"],
        persistent_workers=w["workers"] > 0, prefetch_factor=2 if w["workers"] else None,
        pin_memory=torch.cuda.is_available())
    clock = Clock(w["warmup"], w["steps"], _device())

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = model

        def training_step(self, batch, i):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def on_train_batch_end(self, *args):
            clock.tick(self.global_step)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    trainer = L.Trainer(max_steps=w["steps"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(Module(), loader)
    return dict(clock.result(w["batch"]), param_sum=param_sum(model))


def _stoker_cfg(w: Dict[str, Any], placement: str, run_dir: str):
    from hydra import compose, initialize_config_dir

    common = [f"hydra.run.dir={run_dir}", f"run_dir={run_dir}", "trainer.progress_bar=false",
              "sched=constant", f"optim.lr={LR}", f"trainer.max_steps={w['steps']}",
              f"trainer.max_epochs={EPOCHS}", f"data.batch_size={w['batch']}",
              f"data.num_workers={w['workers']}", f"data.placement={placement}",
              "trainer.val_every_n_epochs=100000", "trainer.limit_val_batches=1",
              "trainer.save_checkpoint=false", f"seed={SEED}"]
    if w["name"] == "cnn":
        common += ["data=synthetic", "model=cnn", f"data.dataset.num_samples={w['samples']}"]
    common += w.get("overrides", [])
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose("train", overrides=common)


def stoker(w: Dict[str, Any], placement: str, run_dir: str) -> Dict[str, float]:
    """train.py's steps, in this process, timed by a callback."""
    from trainer.loop import Callback
    from trainer.runner import train

    cfg = _stoker_cfg(w, placement, run_dir)
    clock = Clock(w["warmup"], w["steps"], _device(), profile=w.get("profile"))
    final: Dict[str, float] = {}

    class Tick(Callback):
        def after_step(self, loop) -> None:
            clock.tick(loop.state.step)
            if loop.state.step == w["steps"]:
                final["param_sum"] = param_sum(loop.model)

    train(cfg, callbacks=[Tick()])
    return dict(clock.result(w["batch"]), **final)


class Pairing:
    """The lockstep timing of two loops taking one step each in turn: after each of the first
    loop's steps, `follow` takes the second's. The first's time runs from the end of the
    second's previous step to the start of this one, the second's is its own; both are kept,
    in microseconds, for steps after `warmup`."""

    def __init__(self, warmup: int, device):
        self.warmup, self.device = warmup, device
        self.first: List[float] = []
        self.second: List[float] = []
        self.mark = time.perf_counter()  # when the second loop's last step ended

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    def follow(self, step: int, second_step) -> None:
        """The first loop's `step` just ended: times it, then takes and times the second's."""
        self._sync()
        now = time.perf_counter()
        second_step()
        self._sync()
        self.mark, last = time.perf_counter(), self.mark
        if step > self.warmup:
            self.first.append(1e6 * (now - last))
            self.second.append(1e6 * (self.mark - now))

    def result(self, batch: int, **final: float) -> Dict[str, float]:
        """Whole-run and best-stretch (the fastest of five equal stretches, as Clock's) step
        times: the first loop's as Stoker's, the second's as the plain counterpart's."""
        n = len(self.first)
        parts = min(5, n)
        stretches = [slice(i * n // parts, (i + 1) * n // parts) for i in range(parts)]
        best = [min(sum(v[s]) / len(v[s]) for s in stretches) for v in (self.first, self.second)]
        return {"samples_per_s": 1e6 * batch * n / sum(self.first),
                "step_us": sum(self.first) / n, "plain_step_us": sum(self.second) / n,
                "best_step_us": best[0], "plain_best_step_us": best[1], **final}


def lockstep(w: Dict[str, Any], placement: str, run_dir: str) -> Dict[str, float]:
    """Stoker's steps and the plain counterpart's in one process, one after the other: after
    each of Stoker's steps a callback takes one plain step. Each step's time is paired with
    the other's a millisecond away, so the machine's drifts (seconds long on a shared host)
    fall on both; what is left is the launcher's work per step (epoch crossings and logging
    boundaries included) against the hand-written step's."""
    from trainer.loop import Callback
    from trainer.runner import train

    model, plain_step = plain_stepper(w, indexed=placement == "device")
    cfg = _stoker_cfg(w, placement, run_dir)
    final: Dict[str, float] = {}
    pairing = Pairing(w["warmup"], _device())

    class Alternate(Callback):
        def after_step(self, loop) -> None:
            pairing.follow(loop.state.step, plain_step)
            if loop.state.step == w["steps"]:
                final["param_sum"] = param_sum(loop.model)
                final["plain_param_sum"] = param_sum(model)

    train(cfg, callbacks=[Alternate()])
    return pairing.result(w["batch"], **final)


def lockstep_null(w: Dict[str, Any]) -> Dict[str, float]:
    """Two plain loops one step each in turn, timed by the same Pairing as `lockstep`: the
    first stands in Stoker's place. Identical work, so the ratio is the harness's own reading
    of no difference."""
    first_model, first = plain_stepper(w, indexed=False)
    model, second = plain_stepper(w, indexed=False)
    pairing = Pairing(w["warmup"], _device())
    for n in range(1, w["steps"] + 1):
        first()
        pairing.follow(n, second)
    return pairing.result(w["batch"], param_sum=param_sum(first_model),
                          plain_param_sum=param_sum(model))


def child(kind: str, w: Dict[str, Any]) -> Dict[str, float]:
    if w["threads"]:
        import torch

        torch.set_num_threads(w["threads"])
    if kind.startswith("plain"):
        return plain_loop(w, indexed=kind == "plain_indexed")
    if kind == "lightning":
        return lightning_loop(w)
    if kind == "lockstep_null":
        return lockstep_null(w)
    with tempfile.TemporaryDirectory(prefix="stoker-overhead-") as tmp:
        if kind.startswith("lockstep"):
            return lockstep(w, "device" if kind == "lockstep_device" else "host", tmp)
        return stoker(w, "device" if kind == "stoker_device" else "host", tmp)

"""Shared test helpers (paths, config composition, process launchers) and test-only
components, reachable by `_target_` from a real `python train.py` process.

Tests import helpers from here, never from conftest.py or another test file; conftest.py keeps
only fixtures and pytest hooks. No pytest import: a `python train.py` process imports this.
"""
from __future__ import annotations

import copy
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Tuple

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import trainer.config  # noqa: F401  (registers train_schema)
from data.datasets import DigitsDataset
from scripts.processes import descendants, kill_session
from tests import warm
from trainer.models import MLP
from trainer.task import Task
from trainer.tasks import Classification

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# Fast, quiet, single-process, CPU: what every test starts from unless it overrides it.
CPU_OVERRIDES = [
    "trainer.accelerator=cpu",
    "trainer.progress_bar=false",
    "data.num_workers=0",
]


def compose_cfg(run_dir: Path, *overrides: str) -> DictConfig:
    """The real conf/train.yaml composed with CPU overrides, then `overrides`, with `run_dir`
    (as `run_dir=...` would set it): a copy of its own of the config those overrides composed
    the first time in this process (Hydra takes 0.2 s of CPU a composition, hundreds of them
    a suite; the conf folder does not change under it)."""
    cfg = copy.deepcopy(_composed(overrides))
    cfg.run_dir = str(run_dir)
    return cfg


@__import__("functools").lru_cache(maxsize=64)
def _composed(overrides: Tuple[str, ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["run_dir=unset", *CPU_OVERRIDES, *overrides])


def run_cli(args: List[str], cwd: Path = ROOT, timeout: float = 240,
            module: str | None = None, env_extra: dict | None = None,
            preexec_fn=None) -> subprocess.CompletedProcess:
    """Runs `python train.py ARGS` (or `python -m module ARGS`) as a user would."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "STOKER_TRACEBACK")}
    env.update({"PYTHONUNBUFFERED": "1", **(env_extra or {})})
    cmd = [sys.executable, "-m", module] if module else [sys.executable, str(ROOT / "train.py")]
    return bounded(cmd + args, cwd, env, timeout, preexec_fn)


# On PYTHONPATH of every process `bounded` starts: its sitecustomize makes SIGUSR2 dump stacks.
STACKS = ROOT / "tests" / "stacks"


class Hung(AssertionError):
    """A process still running at its timeout: the message holds what each of its processes
    was doing (state, kernel wait channel, Python stacks) when it was killed."""


def bounded(cmd, cwd, env, timeout, preexec_fn=None) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a session of its own, ended
    within `timeout` seconds: past it, every process of its tree is asked for its stacks
    (SIGUSR2, see STACKS), then killed, and Hung is raised with what they said."""
    proc = started(cmd, cwd, with_stacks(env), preexec_fn=preexec_fn)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        states = stacks_then_kill(proc)
        out, err = proc.communicate(timeout=30)
        raise Hung(f"still running after {timeout} s: {' '.join(map(str, cmd))}\n"
                   f"its processes: {states}\nits stdout's end:\n{out[-2000:]}\n"
                   f"its stderr's end (stacks after SIGUSR2):\n{err[-12000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def started(cmd, cwd, env, preexec_fn=None, merged: bool = False, default_signals=()):
    """`subprocess.Popen(cmd, ...)` in a session of its own, text pipes (`merged`: stderr into
    stdout's), the signals `default_signals` at their default disposition whatever the
    suite's: forked from a warm process where it can be (tests/warm.py), else a new
    interpreter (always with a `preexec_fn`)."""
    proc = warm.start(cmd, cwd, env, preexec_fn, merged, default_signals)
    if proc is None:
        def defaults() -> None:
            for sig in default_signals:
                signal.signal(sig, signal.SIG_DFL)
            if preexec_fn is not None:
                preexec_fn()

        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                                text=True, start_new_session=True, preexec_fn=defaults
                                if default_signals or preexec_fn is not None else None)
    return proc


def with_stacks(env: dict) -> dict:
    """`env` with STACKS on the path: its Python processes dump their stacks on SIGUSR2."""
    return {**env, "PYTHONPATH": os.pathsep.join(
        [str(STACKS), *filter(None, [env.get("PYTHONPATH")])])}


def stacks_then_kill(proc: subprocess.Popen) -> str:
    """Every process of `proc`'s tree asked for its stacks (SIGUSR2, into their output), then
    killed; what the kernel said each was doing, before."""
    tree = [proc.pid, *descendants(proc.pid)]
    states = "; ".join(_doing(pid) for pid in tree)
    for pid in tree:  # one at a time: their dumps share a pipe, and would interleave
        try:
            os.kill(pid, signal.SIGUSR2)
        except OSError:
            pass
        time.sleep(0.5)
    time.sleep(2)  # (the dumps written; the pipes are read by the caller)
    kill_session(proc.pid, tree)
    return states


def _doing(pid: int) -> str:
    """`pid (name) state wchan=...`: what the kernel says a process waits in, or why not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        wchan = Path(f"/proc/{pid}/wchan").read_text() or "-"
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return f"{pid} (gone)"
    state = stat[stat.rindex(")") + 2:].split()[0]
    return f"{pid} {stat[stat.index('('):stat.rindex(')') + 1]} {state} wchan={wchan} " \
           f"threads={threads}"


def snapshot(folder: Path) -> dict:
    """Every file under `folder` with its bytes: to show nothing was written."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def read_metrics(run_dir: Path) -> List[dict]:
    """The rows of a run dir's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def params_of(model: torch.nn.Module) -> List[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def numbered(n):
    """n samples, sample i being (tensor [i, i], i): each says which it is."""
    ids = torch.arange(n)
    return torch.utils.data.TensorDataset(torch.stack([ids, ids], 1).float(), ids)


class KilledInWorker(torch.utils.data.Dataset):
    """Digits whose sample 40, made in a loader worker, kills the worker's process (as the
    out-of-memory killer would): PyTorch's SIGCHLD handler then raises wherever the training
    thread is, the model's forward included."""

    def __init__(self, split: str = "train"):
        self.digits = DigitsDataset(split)

    def __len__(self) -> int:
        return len(self.digits)

    def __getitem__(self, i: int):
        if i == 40 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.digits[i]


class KilledWhileCaching(torch.utils.data.Dataset):
    """32 blank 1x8x8 samples; in SLURM task 0's process (its node's cache writer) the sixth
    kills the process, as the out-of-memory killer would in the middle of the write."""

    def __init__(self, split: str = "train"):
        self.split = split

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        if i == 5 and self.split == "train" and os.environ.get("SLURM_PROCID") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.zeros(1, 8, 8), i % 10


DROP = object()  # `whole(at, key=DROP)`: a training state without that key


def whole(at: int, **changes) -> dict:
    """A training state with every piece a resume needs (values a tiny run would have)."""
    state = {"model": {}, "optimizer": {"state": {}, "param_groups": []}, "scheduler": {},
             "epoch": 0, "step": at, "position": 0, "world_size": 1, "rng": [{}],
             "config": {"seed": 0}}
    state.update(changes)
    return {k: v for k, v in state.items() if v is not DROP}


def make_memmap_root(root: Path, n: int = 40, shape=(3, 8, 8), classes: int = 4,
                     dtype: str = "float32") -> Path:
    """A small prepared dataset (as scripts/prepare_data.py writes it) under `root`."""
    from data.cache import write_arrays
    from data.datasets import SyntheticDataset

    for split in ("train", "val"):
        write_arrays(SyntheticDataset(split, num_samples=n, input_shape=shape,
                                      num_classes=classes, dtype=dtype), root / split)
    (root / "meta.json").write_text(json.dumps(
        {"input_shape": list(shape), "num_classes": classes, "splits": {}}))
    return root


def children_left(before, timeout: float = 30) -> list:
    """The child processes started since `before` (a set of `multiprocessing.active_children()`
    taken earlier) still alive after up to `timeout` seconds of waiting for them to end.
    Children of earlier tests (a loader whose iterator a traceback still holds) are not
    counted: they are not the ones a test asks about."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in multiprocessing.active_children() if p not in before]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def dead_pid() -> int:
    """The pid of a process that has ended (a run whose owner is gone)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True)
    return int(proc.stdout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Launching train.py under torchrun, as users do (tests/test_train.py, tests/trainer/test_speed.py).
QUIET = ["trainer.progress_bar=false", "data.num_workers=0"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def launch(cmd, cwd, timeout=180, env=None):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "STOKER_"))},
           "PYTHONUNBUFFERED": "1", **(env or {})}
    return bounded(cmd, cwd, env, timeout)


def slurm_tasks(tmp_path, ntasks, args, timeout=180):
    """`ntasks` train.py processes launched as srun launches them (no torchrun: rank 0's
    process holds the job's store), in `tmp_path`; their exit codes and outputs. Tasks not
    ended within `timeout` seconds are killed, and Hung names what each was doing."""
    port = free_port()
    procs = []
    for rank in range(ntasks):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HYDRA_", "STOKER_", "RANK", "WORLD_SIZE"))}
        env.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(ntasks),
                   SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_JOB_ID="4242",
                   SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "train.py"), *QUIET, *args],
                                      cwd=tmp_path, env=with_stacks(env),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    except subprocess.TimeoutExpired:
        # (one that ended is reaped: its pid may be another's now)
        states = {rank: stacks_then_kill(p) for rank, p in enumerate(procs) if p.poll() is None}
        outs = [p.communicate(timeout=30)[0] for p in procs]
        said = "\n".join(f"task {rank} (exit {p.returncode}; {states.get(rank, 'ended')}):\n"
                         f"{out[-6000:]}" for rank, (p, out) in enumerate(zip(procs, outs)))
        raise Hung(f"not all ended after {timeout} s: train.py {' '.join(args)}\n{said}") \
            from None
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    return [p.returncode for p in procs], outs


def torchrun(nproc, args, cwd, timeout=180, multirun=False, env=None):
    cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", str(ROOT / "train.py"),
                      *(["-m"] if multirun else []), *QUIET, *args]
    return launch(cmd, cwd, timeout, env)


def made_once(suite_dir: Path, name: str, make) -> Path:
    """`suite_dir / name`, made by `make(folder)` once for the whole suite run (conftest's
    `suite_dir`): the first worker to ask makes it, the others wait for it and share it (to
    read, not to change). A make that raises leaves it unmade: the next to ask makes it again,
    in an empty folder."""
    import fcntl
    import shutil

    folder, done = suite_dir / name, suite_dir / f"{name}.done"
    with open(suite_dir / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released as the file closes, or its worker dies)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            make(folder)
            done.touch()
    return folder


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_weights(summary):
    return torch.load(summary["checkpoint"], weights_only=True)["model"]


class TrainOnlyDigits(DigitsDataset):
    """Digits whose val split cannot be built (a run that validates nothing must not ask)."""

    def __init__(self, split: str = "train", **kw):
        if split != "train":
            raise RuntimeError(f"the {split} split was built")
        super().__init__(split, **kw)


class ConnectionLostDigits(DigitsDataset):
    """Digits whose `at`-th training sample raises the ConnectionError of a service the
    dataset reads from (an OSError of the dataset's own, not a loader worker's end)."""

    def __init__(self, split: str = "train", at: int = 40, **kw):
        super().__init__(split, **kw)
        self.at = at if split == "train" else -1

    def __getitem__(self, i):
        if i == self.at:
            raise ConnectionError("the feature server went away")
        return super().__getitem__(i)


class FailingOnRankDigits(DigitsDataset):
    """Digits whose `fail_index`-th sample raises on rank `fail_rank` (of a torchrun job)."""

    def __init__(self, split: str = "train", fail_rank: int = 1, fail_index: int = 0, **kw):
        super().__init__(split, **kw)
        self.armed = split == "train" and int(os.environ.get("RANK", "0")) == fail_rank
        self.fail_index = fail_index
        self.seen = 0

    def __getitem__(self, i):
        self.seen += 1
        if self.armed and self.seen > self.fail_index:
            raise RuntimeError(f"injected failure on rank {os.environ.get('RANK')}")
        return super().__getitem__(i)


class NaNAfterMLP(__import__("trainer.models", fromlist=["MLP"]).MLP):
    """An MLP whose training forward returns NaN logits from its `nan_after`-th call on."""

    def __init__(self, *args, nan_after: int = 10, **kwargs):
        super().__init__(*args, **kwargs)
        self.nan_after, self.calls = nan_after, 0

    def forward(self, x):
        out = super().forward(x)
        if self.training:
            self.calls += 1
            if self.calls > self.nan_after:
                out = out * float("nan")
        return out


# --- components of the "bring your own" tests: written as a user would write them ----------

class PaddedTokens(torch.utils.data.Dataset):
    """Dict samples {"input_ids": int64 tokens} of varying length (min_len..max_len) from a
    successor table, so a language model can learn them; batches are padded by `pad_collate`."""

    def __init__(self, split: str = "train", num_samples: int = 64, vocab_size: int = 48,
                 min_len: int = 4, max_len: int = 24, seed: int = 0):
        gen = torch.Generator().manual_seed(seed * 2 + (split == "val"))
        successor = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
        self.rows = []
        for _ in range(num_samples):
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
            row = [int(torch.randint(vocab_size, (1,), generator=gen))]
            for _ in range(n - 1):
                noise = float(torch.rand(1, generator=gen)) < 0.1
                row.append(int(torch.randint(vocab_size, (1,), generator=gen)) if noise
                           else int(successor[row[-1]]))
            self.rows.append(torch.tensor(row))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def pad_collate(samples, pad_id: int = 0):
    """Pads to the longest sample: input_ids (pad_id), attention_mask, labels (-100 on padding)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(samples), longest), dtype=torch.int64)
    for i, s in enumerate(samples):
        ids[i, :len(s["input_ids"])] = s["input_ids"]
        mask[i, :len(s["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100)}


def collate_padding_with(pad_id: int):
    """A factory of collates: `pad_collate` bound to `pad_id`."""
    import functools

    return functools.partial(pad_collate, pad_id=pad_id)


def tiny_gpt2(vocab_size: int = 48, context: int = 32, layers: int = 2, width: int = 32):
    """A Hugging Face GPT-2 language model built from a config: no download."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=width,
                                      n_layer=layers, n_head=2, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def tag_collate(samples):
    """`pad_collate`'s batch with token tags for labels: each token's parity (a per-token
    classification, -100 on padding), for an encoder that tags tokens."""
    batch = pad_collate(samples)
    batch["labels"] = (batch["input_ids"] % 2).masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def tiny_bert_tagger(vocab_size: int = 48, width: int = 32, layers: int = 2):
    """A Hugging Face BERT token classifier (2 tags) built from a config: no download."""
    from transformers import BertConfig, BertForTokenClassification

    torch.manual_seed(0)
    return BertForTokenClassification(BertConfig(
        vocab_size=vocab_size, hidden_size=width, num_hidden_layers=layers,
        num_attention_heads=2, intermediate_size=2 * width, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2))


class Diabetes(torch.utils.data.Dataset):
    """scikit-learn's diabetes regression data (442 samples, 10 features), standardised
    targets, a fixed 80/20 split."""

    def __init__(self, split: str = "train"):
        from sklearn.datasets import load_diabetes

        x, y = load_diabetes(return_X_y=True)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        idx = order[:354] if split == "train" else order[354:]
        y = (y - y.mean()) / y.std()
        self.x = torch.tensor(x, dtype=torch.float32)[idx] * 10
        self.y = torch.tensor(y, dtype=torch.float32)[idx]

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class FailingValDigits(DigitsDataset):
    """Digits whose val split's `fail_index`-th sample raises (past the sanity check's batch:
    the validation after an epoch's training fails)."""

    def __init__(self, split: str = "train", fail_index: int = 300, **kw):
        super().__init__(split, **kw)
        self.fail_index = fail_index if split == "val" else -1

    def __getitem__(self, i):
        if i == self.fail_index:
            raise ValueError(f"bad validation sample {i}")
        return super().__getitem__(i)


class OddDigits(DigitsDataset):
    """Digits whose train split leaves its last sample out: 1437, which 2 ranks cannot share
    evenly."""

    def __init__(self, split: str = "train", **kw):
        super().__init__(split, **kw)
        if split == "train":
            self.tensors = tuple(t[:-1] for t in self.tensors)
            self.x, self.y = self.tensors


class SlowDigits(DigitsDataset):
    """Digits that take `delay` seconds a sample to read: a feed slower than any small step."""

    def __init__(self, split: str = "train", delay: float = 0.001, **kw):
        super().__init__(split, **kw)
        self.delay = delay

    def __getitem__(self, i):
        time.sleep(self.delay)
        return super().__getitem__(i)


class NaNRowDigits(DigitsDataset):
    """Digits whose training split holds `rows` rows of NaN pixels (a tensor dataset still:
    kept on the device, batched by indexing)."""

    def __init__(self, split: str = "train", rows: int = 3, **kw):
        super().__init__(split, **kw)
        if split == "train":
            self.x[:rows] = float("nan")


class SlowValDigits(DigitsDataset):
    """Digits whose val split takes `delay` seconds a sample to read; training's are quick."""

    def __init__(self, split: str = "train", delay: float = 0.5, **kw):
        super().__init__(split, **kw)
        self.delay = delay if split == "val" else 0.0

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        return super().__getitem__(i)


class SignalsInValidation(DigitsDataset):
    """Digits whose val split sends its own process SIGTERM when it reads the rank's first
    sample the `at`-th time (the sanity check reads it first), on rank `rank` only: a
    preemption signal that comes during an epoch's validation (data.num_workers=0). `noise`:
    the train split's samples get that much random noise (an augmentation drawn in the
    loader's workers, from the seeds the loader's generator gives them)."""

    def __init__(self, split: str = "train", at: int = 2, rank: int = 1, noise: float = 0.0,
                 **kw):
        super().__init__(split, **kw)
        self.at, self.rank, self.reads, self.val = at, rank, 0, split == "val"
        self.first, self.noise = None, noise

    def __getitem__(self, i):
        self.first = i if self.first is None else self.first
        if self.val and i == self.first and int(os.environ.get("RANK", "0")) == self.rank:
            self.reads += 1
            if self.reads == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
        x, y = super().__getitem__(i)
        return (x + self.noise * torch.randn_like(x) if self.noise and not self.val else x), y


class SlowToBuildDigits(DigitsDataset):
    """Digits whose train split takes `seconds` to build (a slow listing, a cache being
    made), after touching `marker`: a signal can come while the run is built."""

    def __init__(self, split: str = "train", marker: str = "", seconds: float = 5.0, **kw):
        super().__init__(split, **kw)
        if split == "train":
            Path(marker).touch()
            time.sleep(seconds)


class ProcessReportingDigits(DigitsDataset):
    """Digits whose train split writes, as JSON into `report`, what its process was started
    with: argv, working dir, the variable STOKER_TEST_SAY, the script's folder on sys.path,
    __main__'s file, its session, whether stdout is a pipe, torch's threads, whether SIGHUP
    is ignored, every signal's disposition and how each standard stream buffers
    (tests/test_warm.py); on a torchrun rank, into `report`.RANK, with the interpreter's own
    command line, its parent's pid and its hash of a string."""

    def __init__(self, split: str = "train", report: str = "", **kw):
        super().__init__(split, **kw)
        if split == "train":
            import stat

            main = sys.modules["__main__"]
            said = {
                "argv": sys.argv, "cwd": os.getcwd(), "say": os.environ.get("STOKER_TEST_SAY"),
                "path0": sys.path[0], "main": getattr(main, "__file__", None),
                "session": os.getsid(0) == os.getpid(),
                "pipe": stat.S_ISFIFO(os.fstat(1).st_mode), "threads": torch.get_num_threads(),
                "sighup_ignored": signal.getsignal(signal.SIGHUP) == signal.SIG_IGN,
                "signals": {str(int(sig)): _disposition(sig)
                            for sig in sorted(signal.valid_signals())},
                "streams": {name: [type(getattr(sys, name).buffer).__name__,
                                   getattr(sys, name).name,
                                   getattr(sys, name).line_buffering,
                                   getattr(sys, name).write_through,
                                   getattr(sys, name).encoding, getattr(sys, name).errors]
                            for name in ("stdin", "stdout", "stderr")}}
            if "RANK" in os.environ:
                said.update(cmdline=Path("/proc/self/cmdline").read_text().split("\0")[:-1],
                            parent=os.getppid(), hash=hash("stoker"))
                report = f"{report}.{os.environ['RANK']}"
            Path(report).write_text(json.dumps(said))
            print("reported to stdout")
            print("reported to stderr", file=sys.stderr)


def _disposition(sig: int) -> str:
    """A signal's disposition as Python knows it: "default", "ignored", a handler's name, or
    "other" (set outside Python)."""
    handler = signal.getsignal(sig)
    if handler in (signal.SIG_DFL, signal.SIG_IGN):
        return {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored"}[handler]
    return getattr(handler, "__name__", "other") if handler is not None else "other"


class DictDigits(DigitsDataset):
    """Digits as dict samples {"image", "label", "name"}: a string the default collate would
    turn into a list, batched by `stack_images` instead."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return {"image": x, "label": y, "name": f"digit-{i}"}


class UnevenKeysDigits(DigitsDataset):
    """Dict digits {"image", "labels"} of which every 7th names its label "label"."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return {"image": x, "label" if i % 7 == 3 else "labels": y}


def stack_images(samples):
    return {"image": torch.stack([s["image"] for s in samples]),
            "label": torch.stack([s["label"] for s in samples]),
            "names": [s["name"] for s in samples]}


class PickyNet(torch.nn.Module):
    """A model whose constructor fails on some values of the right kind (a width that is no
    multiple of 8: ValueError) and on values of another (torch's TypeError); an array default
    (`scale`), which == cannot compare with a bool's truth."""

    def __init__(self, input_shape, num_classes: int, width: int = 64, norm: "str | None" = "bn",
                 hidden: "int | list" = 32, bias=True, scale=np.ones(2)):
        super().__init__()
        self.layer = torch.nn.Linear(int(torch.tensor(input_shape).prod()), width, bias=bias)
        if width % 8:
            raise ValueError("width must be a multiple of 8")
        if norm not in ("bn", "ln", None):
            raise ValueError(f"unknown norm {norm}")
        self.head = torch.nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.layer(x.flatten(1)))


class TwoHeads(torch.nn.Module):
    """Digit class and parity from one trunk: a dict output."""

    def __init__(self, input_shape, num_classes: int, width: int = 64):
        super().__init__()
        n = int(torch.tensor(input_shape).prod())
        self.trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(n, width),
                                         torch.nn.ReLU())
        self.digit = torch.nn.Linear(width, num_classes)
        self.parity = torch.nn.Linear(width, 2)

    def forward(self, image):
        h = self.trunk(image)
        return {"digit": self.digit(h), "parity": self.parity(h)}


class DigitAndParity(Task):
    """A task of one's own: two cross-entropies, metrics on the digit head."""

    def __init__(self, parity_weight: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.parity_weight = parity_weight

    def forward(self, model, batch):
        return model(batch["image"])

    def loss(self, output, batch):
        f = torch.nn.functional
        return (f.cross_entropy(output["digit"], batch["label"]) + self.parity_weight
                * f.cross_entropy(output["parity"], batch["label"] % 2))

    def metric_inputs(self, output, batch):
        return output["digit"], batch["label"]


class WithUnusedBranch(MLP):
    """An MLP with a layer whose output never reaches the loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unused = torch.nn.Linear(4, 4)


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset (no __len__ / __getitem__)."""

    def __init__(self, split: str = "train"):
        self.split = split

    def __iter__(self):
        return iter([(torch.zeros(1, 8, 8), torch.tensor(0))] * 4)


class StringDigits(DigitsDataset):
    """Digits whose inputs are plain objects: nothing the default collate can batch."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return object(), y


class CountedClassesDigits(DigitsDataset):
    """Digits whose `classes` attribute is their number, not their names."""

    classes = 10


class NamedClassesDigits(DigitsDataset):
    """Digits naming their classes, as a dataset of one's own may (`classes`)."""

    classes = [f"digit {d}" for d in range(10)]


class SplitNamedDigits(DigitsDataset):
    """Digits whose validation split names 9 classes, its training split 10."""

    def __init__(self, split: str = "train", **kwargs):
        super().__init__(split, **kwargs)
        self.classes = [f"digit {d}" for d in range(10 if split == "train" else 9)]


class OneNamedDigits(DigitsDataset):
    classes = ["digit"]


class FlatNamedDigits(NamedClassesDigits):
    """Named digits as a table's rows: 64 features, no image."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x.flatten(), y


class Float64Digits(DigitsDataset):
    """Digits as numpy gives them: float64 inputs."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x.double(), y


class ThreadLeavingMLP(MLP):
    """An MLP whose constructor starts a thread that is no daemon and sleeps an hour (a
    user's uploader, say): Python's exit waits for it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import threading

        threading.Thread(target=time.sleep, args=(3600,), name="uploader").start()


class DrawingMLP(MLP):
    """An MLP whose forward draws from torch's, python's and numpy's random streams in eval
    mode too (a sampling model's way): a pass the run makes outside training would shift
    training's dropout."""

    def forward(self, x):
        random.random(), np.random.rand()
        return super().forward(x) + 0 * torch.rand(1, device=x.device)


class ShiftedLabelDigits(DigitsDataset):
    """Digits whose labels are 10..19: outside the 10 classes a classifier of them has."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, y + 10


class TripleDigits(DigitsDataset):
    """Digits with a third item per sample, (x, y, weight): more than (inputs, target)."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, y, torch.tensor(1.0)


class NamedLabelDigits(DigitsDataset):
    """Digits labelled by name ("digit 3"), not by number."""

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, f"digit {y}"


class DyingWorkerDigits(DigitsDataset):
    """Digits whose training loader worker ends its own process at its `at`-th sample, by
    `signal` (KILL as the out-of-memory killer does, SEGV as a crash in native code). (The
    validation split's workers live: a second death, of a validation worker prefetching in
    the background, could come while the training process forks, where PyTorch's SIGCHLD
    handler raising inside an at-fork hook printed "Exception ignored" and a traceback.)"""

    def __init__(self, split: str = "train", at: int = 100, signal: str = "KILL", **kw):
        super().__init__(split, **kw)
        self.at, self.signal, self.seen = at if split == "train" else -1, signal, 0

    def __getitem__(self, i):
        self.seen += 1
        if self.seen == self.at and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), getattr(signal, f"SIG{self.signal}"))
        return super().__getitem__(i)


class Sentences(DigitsDataset):
    """Samples that are strings: the default collate makes a batch a list of strings."""

    def __getitem__(self, i):
        return f"sample {i}"


class SelfLossMLP(MLP):
    """An MLP whose forward takes (inputs, targets) and returns only {"loss": ...}."""

    def forward(self, x, y):
        return {"loss": torch.nn.functional.cross_entropy(super().forward(x), y)}


class StallingDigits(DigitsDataset):
    """Digits whose `at`-th sample read stops (SIGSTOP) or hangs (sleeps) the process reading
    it: on rank `rank` of a torchrun job, in the main process or a loader worker."""

    def __init__(self, split: str = "train", rank: int = 0, at: int = 100,
                 how: str = "stop", **kw):
        super().__init__(split, **kw)
        self.armed = split == "train" and int(os.environ.get("RANK", "0")) == rank
        self.at, self.how, self.seen = at, how, 0

    def __getitem__(self, i):
        self.seen += 1
        if self.armed and self.seen == self.at:
            if self.how == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                __import__("time").sleep(3600)
        return super().__getitem__(i)


class NaNOnRankMLP(MLP):
    """An MLP whose training forward returns NaN logits on rank `rank` from call `after` on."""

    def __init__(self, *args, rank: int = 1, after: int = 3, **kwargs):
        super().__init__(*args, **kwargs)
        self.armed = int(os.environ.get("RANK", "0")) == rank
        self.after, self.calls = after, 0

    def forward(self, x):
        out = super().forward(x)
        if self.training and self.armed:
            self.calls += 1
            if self.calls > self.after:
                out = out * float("nan")
        return out


class Empty(torch.utils.data.Dataset):
    def __init__(self, split: str = "train"):
        self.split = split

    def __len__(self):
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


class Scripted(torch.nn.Module):
    """A validation metric whose values are given in advance (`Scripted.values`, one per
    validation, taken at its reset), to decide deterministically what a run's best checkpoint
    must be; which direction is better it leaves to `trainer.checkpoint.mode`. (The trial on
    the first training batch, which resets nothing, computes 0.)"""
    values: List[float] = []

    def __init__(self):
        super().__init__()
        self.value = 0.0

    def update(self, preds, target) -> None:
        pass

    def reset(self) -> None:
        self.value = Scripted.values.pop(0)

    def compute(self) -> torch.Tensor:
        return torch.tensor(self.value)


class KeywordMetric(torch.nn.Module):
    """A metric that takes any keyword, as torchmetrics' do (**kwargs), and needs one."""

    def __init__(self, num_classes: int, **kwargs):
        super().__init__()
        self.num_classes = num_classes


def accuracy_of(num_classes: int = 3):
    """A factory of metrics: a function that returns one."""
    from torchmetrics.classification import MulticlassAccuracy

    return MulticlassAccuracy(num_classes=num_classes)


class BrokenMetric(torch.nn.Module):
    """A metric whose update (`fails="update"`) or compute raises inside its own code."""

    def __init__(self, fails: str = "update"):
        super().__init__()
        self.fails, self.updates = fails, 0

    def update(self, preds, target) -> None:
        if self.fails == "update":
            raise ZeroDivisionError("a bug in update")
        self.updates += 1

    def reset(self) -> None:
        self.updates = 0

    def compute(self) -> torch.Tensor:
        return torch.tensor(1.0 / (self.updates * 0))  # ZeroDivisionError (a bug in compute)


class FailsOnForward(torch.nn.Module):
    """A model of one's own with a bug: its `at`-th forward in training (`when="train"`) or
    in evaluation (`when="eval"`: the sanity check's is the first) raises."""

    def __init__(self, input_shape, num_classes: int, at: int = 3, when: str = "train"):
        super().__init__()
        self.lin = torch.nn.Linear(int(np.prod(input_shape)), num_classes)
        self.at, self.when, self.calls = at, when, 0

    def forward(self, x):
        if self.training == (self.when == "train"):
            self.calls += 1
            if self.calls == self.at:
                raise RuntimeError("a bug in the model's own forward")
        return self.lin(x.flatten(1))


class FailsInCompute(torch.nn.Module):
    """A metric (a count of samples, not synced over ranks) whose compute raises on rank
    `rank` (-1: every rank) from its `at`-th computation on (its copies tried by the sanity
    check count their own)."""

    higher_is_better = True

    def __init__(self, rank: int = -1, at: int = 2):
        super().__init__()
        self.rank, self.at, self.seen, self.computed = rank, at, 0, 0

    def update(self, preds, target) -> None:
        self.seen += len(target)

    def reset(self) -> None:
        self.seen = 0

    def compute(self) -> torch.Tensor:
        self.computed += 1
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.computed >= self.at and self.rank in (-1, rank):
            raise ValueError(f"compute failed on rank {rank}")
        return torch.tensor(float(self.seen))


class CountsByName(FailsInCompute):
    """A metric computing a dict: `seen` (this rank's samples, not synced), `one` (1.0), a
    nested `half` of `seen`, and `ids`, not one number (a MeanAveragePrecision's `classes`);
    its compute fails below `least` samples."""

    def __init__(self, rank: int = -1, at: int = 2, least: int = 0):
        super().__init__(rank, at)
        self.least = least

    def compute(self) -> dict:
        if self.seen < self.least:
            raise ValueError(f"needs {self.least} samples, has {self.seen}")
        seen = super().compute()
        return {"seen": seen, "one": 1.0, "nested": {"half": seen / 2},
                "ids": torch.tensor([3, 5])}


class NeedsSamples(torch.nn.Module):
    """A metric whose compute needs `least` samples (more than a training batch has)."""

    def __init__(self, least: int = 100):
        super().__init__()
        self.least, self.seen = least, 0

    def update(self, preds, target) -> None:
        self.seen += len(target)

    def reset(self) -> None:
        self.seen = 0

    def compute(self) -> torch.Tensor:
        if self.seen < self.least:
            raise ValueError(f"needs {self.least} samples, has {self.seen}")
        return torch.tensor(float(self.seen))


class PerSampleLoss(Classification):
    """A task whose loss forgot to reduce: one value per sample."""

    def loss(self, output, batch):
        return torch.nn.functional.cross_entropy(output, batch[1], reduction="none")


class BinaryLossOnClassLogits(Classification):
    """A task of one's own whose loss does not fit the model's output: a binary loss on 10
    classes' logits (a ValueError inside torch's loss)."""

    def loss(self, output, batch):
        return torch.nn.functional.binary_cross_entropy_with_logits(output, batch[1].float())


class NothingCounted(Classification):
    """A task whose every batch counts 0 units (a token task whose labels are all -100): its
    loss averages over nothing."""

    def count(self, batch):
        return torch.zeros((), dtype=torch.int64)

    def loss(self, output, batch):
        ignored = torch.full_like(batch[1], -100)
        return torch.nn.functional.cross_entropy(output, ignored)  # (nan: 0 / 0)


class FirstBatchesUncounted(Classification):
    """A task whose first 3 training batches count 0 units (padding alone), the rest their
    samples."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counted_batches = 0

    def count(self, batch):  # (a tensor, as a count of valid tokens is)
        self.counted_batches += 1
        return torch.tensor(0 if self.counted_batches <= 3 else super().count(batch))


class DetachedLoss(Classification):
    """A task whose loss was computed away from the graph."""

    def loss(self, output, batch):
        return super().loss(output.detach(), batch)


class ItemLoss(Classification):
    """A task whose loss is a Python number (`.item()` of the tensor)."""

    def loss(self, output, batch):
        return super().loss(output, batch).item()


class LossGoesWrong(Classification):
    """A task whose loss is fine for `after` training batches, then `how`: per sample
    (unreduced) or detached."""

    def __init__(self, how: str = "unreduced", after: int = 3, **kw):
        super().__init__(**kw)
        self.how, self.after, self.calls = how, after, 0

    def loss(self, output, batch):
        if torch.is_grad_enabled():  # (training batches only)
            self.calls += 1
        if self.calls <= self.after or not torch.is_grad_enabled():
            return super().loss(output, batch)
        if self.how == "unreduced":
            return torch.nn.functional.cross_entropy(output, batch[1], reduction="none")
        return super().loss(output.detach(), batch)


class CountGoesNegative(Classification):
    """A task whose count turns negative (a device tensor, as valid tokens are) after `after`
    training batches."""

    def __init__(self, after: int = 3, **kw):
        super().__init__(**kw)
        self.after, self.calls = after, 0

    def count(self, batch):
        self.calls += torch.is_grad_enabled()
        n = super().count(batch)
        return torch.tensor(-5 if self.calls > self.after and torch.is_grad_enabled() else n)


class ZeroCount(Classification):
    """A task whose count says its loss averages over no units."""

    def count(self, batch):
        return 0


class WordCount(Classification):
    """A task whose count is not a number."""

    def count(self, batch):
        return "many"


class ListDerived(Classification):
    """A task whose derived values are a list, not names and numbers."""

    def derived(self, values):
        return [1, 2]


class NoMetricPair(Classification):
    """A task whose metric_inputs forgot to return."""

    def metric_inputs(self, output, batch):
        return None


class NoLoss(Task):
    """A task of one's own that defines no loss."""


class ExitingMLP(MLP):
    """A model whose third forward calls sys.exit(0), as a user's debugging line might."""

    calls = 0

    def forward(self, x):
        ExitingMLP.calls += 1
        if ExitingMLP.calls == 3:
            sys.exit(0)
        return super().forward(x)


class ExitsAtMLP(MLP):
    """A model whose `at`-th forward (0: none) calls sys.exit(`code`)."""

    def __init__(self, *args, at: int = 0, code: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.code, self.calls = at, code, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            sys.exit(self.code)
        return super().forward(x)


class ReshapedDigits(DigitsDataset):
    """Digits whose 64 pixels come as (4, 16) samples, not data.input_shape's [1, 8, 8]."""

    def __init__(self, split: str = "train", **kw):
        super().__init__(split, **kw)
        self.tensors = (self.x.reshape(len(self.x), 4, 16), self.y)
        self.x = self.tensors[0]


class RankSizedDigits(torch.utils.data.Dataset):
    """Digits cut to a length that depends on the rank: a dataset that differs between ranks."""

    def __init__(self, split: str = "train", **kw):
        self.digits = DigitsDataset(split, **kw)

    def __len__(self):
        return len(self.digits) - 100 * int(os.environ.get("RANK", "0"))

    def __getitem__(self, i):
        return self.digits[i]


class RankShapedMLP(MLP):
    """An MLP whose hidden width depends on the torchrun rank: ranks 0 and 1 build parameters
    of different sizes, which DDP finds as it wraps the model."""

    def __init__(self, input_shape, num_classes, hidden=(32,), **kwargs):
        width = hidden[0] + int(os.environ.get("RANK", "0"))
        super().__init__(input_shape, num_classes, hidden=[width], **kwargs)


class ArrayStateMLP(MLP):
    """An MLP whose extra state (nn.Module.get_extra_state) is a numpy array: a safe load
    (torch.load with weights_only=True) refuses it."""

    def get_extra_state(self):
        import numpy as np

        return {"mean": np.arange(3.0)}

    def set_extra_state(self, state) -> None:
        self.extra = state


class FaultyMLP(MLP):
    """An MLP whose `at`-th training forward, on rank `rank` of a torchrun job, hangs (sleeps
    in the main thread: its heartbeat thread beats on), kills its own process, or fails with
    a one-line error of that rank's own (`refuse`); `init`: its construction fails so."""

    def __init__(self, *args, rank: int = 1, at: int = 5, how: str = "hang",
                 hang_s: float = 3600, **kwargs):
        super().__init__(*args, **kwargs)
        self.armed = int(os.environ.get("RANK", "0")) == rank
        if self.armed and how == "init":
            raise ValueError(f"width 7 is not for rank {rank}")
        self.at, self.how, self.hang_s, self.calls = at, how, hang_s, 0

    def forward(self, x):
        if self.training and self.armed:
            self.calls += 1
            if self.calls == self.at:
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.how == "refuse":
                    from trainer.config import ConfigError

                    raise ConfigError(f"data: a sample rank {os.environ['RANK']} cannot use")
                time.sleep(self.hang_s)
        return super().forward(x)


class NotADataset:
    """A class a user pointed data.dataset at by mistake: no __len__, no __getitem__."""

    def __init__(self, split: str = "train"):
        self.split = split


class EmptyVal(DigitsDataset):
    """Digits whose val split has no samples."""

    def __len__(self):
        return 0 if self.val_split else super().__len__()

    def __init__(self, split: str = "train", **kw):
        super().__init__(split, **kw)
        self.val_split = split == "val"


class Endless(Empty):
    """A stream's "endless" length given as a map-style set's: 10**13 samples."""
    def __len__(self):
        return 10 ** 13


class NegativeLength(DigitsDataset):
    def __len__(self):
        return -1


@__import__("dataclasses").dataclass
class PairBatch:
    """A batch class of a user's own (a dataclass, not a tuple or a dict)."""
    x: torch.Tensor
    y: torch.Tensor


def pair_batch(samples):
    xs, ys = zip(*samples)
    return PairBatch(torch.stack(xs), torch.tensor(ys))


class PairBatchTask(Task):
    """A task that reads PairBatch fields (digits flattened through the default MLP)."""

    def forward(self, model, batch):
        return model(batch.x)

    def count(self, batch):
        return batch.x.shape[0]

    def loss(self, output, batch):
        return torch.nn.functional.cross_entropy(output, batch.y)

    def metric_inputs(self, output, batch):
        return output, batch.y


def usage_error(capsys, main, argv: List[str]) -> str:
    """What a script's `main(argv)` (or its parser) says on stderr as it refuses `argv` with
    a usage error, exit 2 (asserted)."""
    import pytest

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL to a process started with start_new_session, its session and every process
    below it (torchrun starts each rank in a session of its own, outside torchrun's), as a
    machine's crash would end them; then reaped."""
    kill_session(proc.pid)
    proc.wait(timeout=30)


@__import__("contextlib").contextmanager
def train_until(args, marker: str, timeout: float = 120, stdout: bool = False):
    """`python train.py ARGS` in a session of its own, its stderr (`stdout`: and its stdout,
    the log's lines) read on a thread until a line holds `marker`: yields (the process, its
    lines so far) once one did with the process still running (asserted), and kills the
    session on the way out."""
    import threading

    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *QUIET, *args], cwd=ROOT,
                            stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
                            stderr=subprocess.STDOUT if stdout else subprocess.PIPE, text=True,
                            start_new_session=True)
    seen, lines = threading.Event(), []

    def read():
        for line in (proc.stdout if stdout else proc.stderr):
            lines.append(line)
            if marker in line:
                seen.set()
        seen.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert seen.wait(timeout) and proc.poll() is None, "".join(lines[-40:])
        yield proc, lines
    finally:
        kill_session(proc.pid)


def signalled_in_its_exit(proc: subprocess.Popen, lines: List[str], signals: int,
                          marker: str = "slow exit:", timeout: float = 60) -> Tuple[int, float]:
    """Once `lines` (train_until's) hold `marker` (a SlowExitMLP's exit begun), `signals`
    SIGTERMs 0.3 s apart to `proc`; returns its exit code and the seconds from the last
    signal's gap to its end."""
    deadline = time.monotonic() + timeout
    while not any(marker in ln for ln in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(signals):
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
    start = time.monotonic()
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - start


def torchrun_until(nproc, args, cwd, prefix: str = "stoker: error:", timeout: float = 150):
    """A torchrun job run until a line of its stderr starts with `prefix` (or it ends, or
    `timeout` passes), then its whole process group killed: for jobs whose remaining ranks
    are stopped or stuck, which torchrun itself would give 30 s before killing them.
    Returns (the stderr lines so far, the seconds it ran)."""
    import threading

    cmd = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}", str(ROOT / "train.py"),
                      *QUIET, *args]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "STOKER_"))},
           "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: List[str] = []
    seen = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line.rstrip("\n"))
            if line.startswith(prefix):
                seen.set()
        seen.set()  # the job ended

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen.wait(timeout)
    time.sleep(0.5)  # the other ranks' lines of the same moment
    kill_tree(proc)
    reader.join(timeout=5)
    return lines, time.monotonic() - start


class SlowExitMLP(MLP):
    """An MLP whose process, once its run is over, takes `seconds` more to end: in an exit
    handler (`phase=atexit`, before Python's own teardown) or in the teardown itself
    (`teardown`: an object's finalizer as the modules are cleared, after Python put back the
    default action of the signals it handled). Each says `slow exit: <phase>` on stderr first."""

    def __init__(self, *args, phase: str = "atexit", seconds: float = 5.0, **kwargs):
        super().__init__(*args, **kwargs)
        global _LINGERING
        if phase == "atexit":
            import atexit

            atexit.register(_slow_exit, phase, seconds)
        else:
            _LINGERING = _Lingering(phase, seconds)


def _slow_exit(phase: str, seconds: float) -> None:
    os.write(2, f"slow exit: {phase}\n".encode())
    time.sleep(seconds)


class _Lingering:
    def __init__(self, phase: str, seconds: float):
        self.phase, self.seconds = phase, seconds

    def __del__(self):
        _slow_exit(self.phase, self.seconds)


_LINGERING = None


class BatchMakingDigits(torch.utils.data.Dataset):
    """Digits whose `__getitems__(indices)` returns the batch made already, (images, labels)
    stacked (data.loader.as_is hands it on)."""

    def __init__(self, split: str = "train", **kw):
        self.digits = DigitsDataset(split, **kw)

    def __len__(self):
        return len(self.digits)

    def __getitem__(self, i):
        return self.digits[i]

    def __getitems__(self, indices):
        at = torch.as_tensor(indices)
        return self.digits.x[at], self.digits.y[at]


class SlowBuiltDigits(DigitsDataset):
    """Digits whose construction takes `seconds` on rank `rank` (of a torchrun job): a dataset
    slow to build, or stuck, on one rank before the first step."""

    def __init__(self, split: str = "train", rank: int = 1, seconds: float = 15.0, **kw):
        if int(os.environ.get("RANK", "0")) == rank:
            time.sleep(seconds)
        super().__init__(split, **kw)


class StallingInAChild(DigitsDataset):
    """Digits whose sample `at`, made in a loader worker, waits on a child process of the
    worker's (`sleep <marker>`, as a shard's `curl` or `pipe:` command would stall)."""

    def __init__(self, split: str = "train", at: int = 40, marker: str = "987.654", **kw):
        super().__init__(split, **kw)
        self.at, self.marker = at if split == "train" else -1, str(marker)

    def __getitem__(self, i):
        if i == self.at:
            subprocess.run(["sleep", self.marker])
        return super().__getitem__(i)


def processes_running(*argv: str) -> List[int]:
    """The pids of live processes whose command line is `argv` (Linux /proc)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[:-1] == [a.encode() for a in argv]:
                        found.append(int(name))
            except OSError:
                continue
    return found


class BatchNormMLP(MLP):
    """An MLP with a BatchNorm1d after its first block: one value per channel in a batch of
    one sample, which torch's BatchNorm refuses in training."""

    def __init__(self, input_shape, num_classes, hidden=(16,), **rest):
        super().__init__(input_shape, num_classes, hidden=hidden, **rest)
        self.blocks[0].append(torch.nn.BatchNorm1d(hidden[0]))


class EmptyThirdBatch(Classification):
    """A task of one's own whose third training batch counts 0 units (on rank `rank` of a
    torchrun job only, where given), and whose loss, a sum divided by its count, is then
    0 / 0 with NaN gradients (a masked loss given a batch masked out whole). Validation's
    batches count as usual."""

    def __init__(self, rank=None, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0
        self.empty = False
        self.armed = rank is None or int(os.environ.get("RANK", "0")) == rank

    def count(self, batch):
        if torch.is_grad_enabled():  # (training's batches)
            self.calls += 1
            self.empty = self.armed and self.calls == 3
            return 0 if self.empty else len(batch[1])
        return len(batch[1])

    def loss(self, output, batch):
        mask = torch.zeros(len(batch[1])) if self.empty and torch.is_grad_enabled() else \
            torch.ones(len(batch[1]))
        losses = torch.nn.functional.cross_entropy(output, batch[1], reduction="none")
        return (losses * mask).sum() / mask.sum()

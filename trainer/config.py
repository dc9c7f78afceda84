"""Typed configuration schema and its registration with Hydra.

The dataclasses below back `conf/train.yaml` through Hydra's ConfigStore (`train_schema`), so a
misspelt key (`data.num_worker=8`) or a wrong type (`data.num_workers=abc`) fails while Hydra
composes the config, before any process group, dataset or model exists. The checks the schema
cannot express (ranges, keys that only work together, what needs the environment) live in
trainer/checks.py, whose `resolve` computes the run's derived values (`RunSpec`, below).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from trainer import distributed, stamp


class ConfigError(ValueError):
    """A configuration value that cannot work; the message is one line naming the key."""


def first_line(e: BaseException, empty: Optional[str] = None) -> str:
    """An error's first line, with the next one where the first only leads to it (pydantic's
    and Hugging Face's "Validation error for field 'x':" and the reason below it); an error
    without words gives `empty`, or its type's name."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if not lines:
        return type(e).__name__ if empty is None else empty
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def rank_prefix() -> str:
    """`[rank N] ` in a process of rank N > 0 of a torchrun or SLURM job (its loader workers
    too: the launcher's variables are inherited), as every rank's warnings are said; "" on
    rank 0 and in one process. (Here, beside first_line: data/ says warnings too.)"""
    rank = os.environ.get("RANK") or (os.environ.get("SLURM_PROCID")
                                      if os.environ.get("SLURM_NTASKS", "1").strip() != "1"
                                      else None)
    return f"[rank {rank.strip()}] " if rank and rank.strip() not in ("", "0") else ""


class Precision(Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Strategy(Enum):
    auto = "auto"  # ddp under torchrun/SLURM with world size > 1, else single
    single = "single"
    ddp = "ddp"
    dp = "dp"


class Accelerator(Enum):
    auto = "auto"  # cuda when available, else cpu
    cpu = "cpu"
    cuda = "cuda"


@dataclass
class AugmentConfig:
    """Training-batch augmentation done on the device, per sample (images, N x C x H x W)."""

    crop_padding: int = 0  # random crop of the input's size from it padded by this many pixels; 0: off
    hflip: bool = False  # mirror left-right with probability 1/2


@dataclass
class DataConfig:
    # either `dataset` (a _target_ called with split="train" and split="val"), or
    # `train_dataset` and an optional `val_dataset` (each a _target_ called as it stands)
    dataset: Any = None
    train_dataset: Any = None
    val_dataset: Any = None  # null with train_dataset: no validation
    collate_fn: Any = None  # _target_ of a collate function (or a class whose instances are)
    # one sample's shape, offered to models that take it (typed Any because OmegaConf resolves
    # an interpolation merged into a null Optional[List] at once; checked in resolve instead)
    input_shape: Any = None
    num_classes: Optional[int] = None  # offered to models (and the task) that take it
    batch_size: int = 64  # per rank
    eval_batch_size: Optional[int] = None  # null: same as batch_size
    # an int >= 0, or auto: 0 for data already in memory (tensors), else this process's CPUs
    # shared among the node's ranks (typed Any to hold `auto`; checked in resolve)
    num_workers: Any = "auto"
    pin_memory: bool = True  # only takes effect on CUDA
    prefetch_factor: int = 2  # batches in flight per worker; ignored when num_workers=0
    persistent_workers: bool = True  # ignored when num_workers=0
    # training loader workers run on into the next epoch's order as an epoch ends, so the
    # next one does not start empty (data/runon.py); needs workers and persistent_workers
    prefetch_next_epoch: bool = True
    shuffle: bool = True
    drop_last: bool = False
    timeout: float = 300.0  # seconds to wait for a batch from a worker; 0: forever
    multiprocessing_context: Optional[str] = None  # null (platform default) | fork | spawn | forkserver
    cache: str = "none"  # none | memory | shm | disk | lru (data/cache.py)
    cache_dir: str = "data_cache/auto"  # data.cache=disk: where the arrays are kept between runs
    cache_mb: float = 1024.0  # data.cache=lru: MB of samples each loader worker keeps
    device_prefetch: bool = True  # CUDA: copy the next batch on a side stream during the step
    # per channel, applied on the device: null or a list of numbers (typed Any, as input_shape
    # is, so that data=shards and data=memmap can read them from the data; checked in resolve)
    normalize_mean: Any = None
    normalize_std: Any = None
    channels_last: bool = False  # 4-D inputs and the model's 4-D weights in channels_last
    # where the datasets live: auto (on the training device when it is a set of tensors within
    # device_budget_mb, else host) | host (DataLoader) | device (tensors on the device, batched
    # by indexing: no workers, no collate, no per-step host-to-device copy)
    placement: str = "auto"
    # the most tensor data auto keeps on the device, and that is gathered once an epoch
    device_budget_mb: float = 1024.0  # (per split)
    augment: AugmentConfig = field(default_factory=AugmentConfig)  # on the device, training only


MP_CONTEXTS = (None, "fork", "spawn", "forkserver")
CACHE_MODES = ("none", "memory", "shm", "disk", "lru")
PLACEMENTS = ("auto", "host", "device")


@dataclass
class DDPConfig:
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    sync_batchnorm: bool = False
    timeout_s: float = 300.0  # a collective waiting longer fails, naming the rank that stopped


@dataclass
class CompileConfig:
    enabled: bool = False  # torch.compile the model (training forward and backward)
    mode: str = "default"  # default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    backend: str = "inductor"  # any name torch.compiler.list_backends() reports
    fullgraph: bool = False  # error on a graph break instead of falling back to eager
    dynamic: Optional[bool] = None  # null: recompile with dynamic shapes only when shapes change


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0  # save every N optimizer steps; 0: off
    every_n_epochs: int = 1  # save at the end of every N epochs; 0: off
    keep_last: int = 3  # periodic checkpoints kept (last.pt and best.pt come on top)
    monitor: Optional[str] = None  # any logged validation key (val_loss, val_acc, ...): also keep best.pt
    mode: Optional[str] = None  # max | min | null: the metric's own direction
    # auto | true | false: copy to CPU, write on a background thread; auto: on CUDA, and on CPU
    # for states over 64 MB (a small state's write costs less than the competition of a
    # writing thread with training for the cores; checked in resolve)
    async_save: Any = "auto"
    timeout_s: float = 1800.0  # how long the other ranks wait for rank 0's write


@dataclass
class EarlyStoppingConfig:
    patience: int = 0  # validations without improvement of trainer.checkpoint.monitor; 0: off
    min_delta: float = 0.0  # an improvement must exceed this to count


@dataclass
class TrainerConfig:
    strategy: Strategy = Strategy.auto
    accelerator: Accelerator = Accelerator.auto
    precision: Precision = Precision.fp32
    accumulate_grad_batches: int = 1
    grad_clip: Optional[float] = None  # max global L2 norm of gradients; null: no clipping
    max_epochs: int = 20
    max_steps: int = -1  # optimizer steps; -1: no limit
    val_every_n_epochs: int = 1
    log_every_n_steps: int = 50
    # an int: that many batches an epoch; a float in (0, 1]: that share of them; null: all
    limit_train_batches: Any = None
    limit_val_batches: Any = None
    overfit_batches: int = 0  # >0: train on the same first N batches (validation as set)
    fast_dev_run: bool = False
    sanity_check: bool = True  # the first validation batch, before the first step
    deterministic: bool = False
    detect_anomaly: bool = False
    profile: bool = False
    progress_bar: bool = True
    print_config: bool = True  # the resolved config at start (config.yaml holds it either way)
    tensorboard: bool = True
    save_checkpoint: bool = True
    resume: Optional[str] = None  # null | auto | path to a checkpoint
    init_from: Optional[str] = None  # a fresh start's model weights from this file (fine-tuning)
    init_strict: bool = True  # every tensor of init_from must fit; false: load those that fit
    validate_only: bool = False  # validate init_from's weights once, train nothing
    max_bad_steps: int = 20  # stop after this many optimizer steps in a row with a non-finite loss; 0: never
    tf32: bool = True  # CUDA: fp32 matmuls and convolutions on TF32 tensor cores (Ampere+)
    cudnn_benchmark: bool = True  # CUDA: time cuDNN's algorithms per shape, keep the fastest
    compile: CompileConfig = field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    # callbacks of one's own by name, each a _target_ node building a trainer.loop.Callback
    callbacks: Dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    seed: int = 42
    run_dir: str = MISSING
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    model: Any = MISSING
    task: Any = MISSING
    optim: Any = MISSING
    sched: Any = MISSING


ASYNC_MIN_CPU_BYTES = 64 * 2**20  # auto: on CPU, asynchronous saves above this state size


def async_checkpoints(c: CheckpointConfig, device: torch.device, state_bytes: int) -> bool:
    """`trainer.checkpoint.async_save` with auto resolved for a state of `state_bytes`:
    asynchronous on CUDA, where the training thread mostly waits for the GPU and a background
    write costs it nothing, and on CPU for large states, whose write takes far longer than
    the copy; synchronous for small states on CPU, where a writing thread competing with
    training for the cores costs more than the write (measured: README "Asynchronous saves")."""
    flag = tri_state(c.async_save)
    if flag != "auto":
        return flag
    return device.type == "cuda" or state_bytes > ASYNC_MIN_CPU_BYTES


def plain(value: Any, resolve: bool = False) -> Any:
    """A config node's value as plain Python (dicts, lists); any other value as it is."""
    return OmegaConf.to_container(value, resolve=resolve) if OmegaConf.is_config(value) else value


def tri_state(value: Any) -> Any:
    """auto, True or False for a tri-state key (a bool, or a string from an interpolation);
    None when it is none of them."""
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return None


def cpu_workers(d: DataConfig, local_world_size: int) -> int:
    """`data.num_workers` for work that always runs on CPU workers (materialising a cache,
    preparing shards): `auto` is the node's CPUs shared among its ranks."""
    w = d.num_workers
    return distributed.auto_num_workers(local_world_size) if w == "auto" else int(str(w))


def _log_file(run_dir: str) -> str:
    return f"{run_dir}/train.log" if distributed.detect().is_main else os.devnull


def _image_classes(root: str) -> int:
    from data.images import image_classes  # lazy: only image folder configs need it

    return image_classes(root)


def _shards_meta(root: str, key: str, size: int) -> Any:
    from data.shards import shards_meta  # lazy: only shard configs need it

    return shards_meta(root, key, int(size))


def _dataset_meta(root: str, key: str) -> Any:
    from data.datasets import read_meta  # lazy: only memmap configs need it

    meta = read_meta(root)
    if key in ("normalize_mean", "normalize_std"):  # written for image data only
        return meta.get(key)
    if key not in meta:
        shards = os.path.isfile(os.path.join(root, "train", "index.json"))
        raise ConfigError(f"data.dataset.root={root}: " + (
            "a shard set (train/index.json), which data=shards reads" if shards else
            f"its meta.json has no '{key}' (not written by scripts/prepare_data.py "
            "--format npy?)"))
    return meta[key]


def register() -> None:
    """Registers the schema as `train_schema` (conf/train.yaml names it first in its defaults)
    and the resolvers the Hydra settings use to keep one run dir, written by rank 0 alone."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    # ${stoker_stamp:} the launch's stamp; ${stoker_stamp:outputs} a run dir claimed under it
    OmegaConf.register_new_resolver(
        "stoker_stamp", lambda parent=None: (stamp.claim_run_dir(str(parent)) if parent
                                             else stamp.run_stamp()),
        use_cache=True, replace=True)
    OmegaConf.register_new_resolver("stoker_log_file", _log_file, replace=True)
    # Hydra's own lines (a sweep's "Launching 2 jobs") from rank 0 alone
    OmegaConf.register_new_resolver(
        "stoker_main_level", lambda level: level if distributed.detect().is_main else "WARNING",
        replace=True)
    OmegaConf.register_new_resolver("stoker_meta", _dataset_meta, replace=True)
    # the folder scan and the shard index are read once per composition
    OmegaConf.register_new_resolver("stoker_image_classes", _image_classes, replace=True,
                                    use_cache=True)
    OmegaConf.register_new_resolver("stoker_shards", _shards_meta, replace=True,
                                    use_cache=True)
    OmegaConf.register_new_resolver(
        "auto_workers", lambda: distributed.auto_num_workers(distributed.detect().local_world_size),
        replace=True)


register()


@dataclass(frozen=True)
class RunSpec:
    """Values derived from the config and the environment, computed once in `resolve`."""

    device: torch.device
    strategy: Strategy
    precision: Precision
    world_size: int
    global_batch: int  # per-rank batch x accumulation x world size

    @property
    def gpus(self) -> List[torch.device]:
        """The GPUs this process computes on: its device, or every visible one under dp
        (nn.DataParallel's default device_ids, as `strategy.wrap` uses); none on CPU. Whose
        random states a checkpoint keeps and whose peak memory the run reports."""
        if self.device.type != "cuda":
            return []
        if self.strategy == Strategy.dp:
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [self.device]

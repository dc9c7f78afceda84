"""Typed configuration schema, its registration with Hydra, and every semantic check.

The dataclasses below back `conf/train.yaml` through Hydra's ConfigStore (`train_schema`), so a
misspelt key (`data.num_worker=8`) or a wrong type (`data.num_workers=abc`) fails while Hydra
composes the config, before any process group, dataset or model exists. Checks that need the
environment (is CUDA here? how many ranks?) live in `resolve`, the one place where derived
values such as the global batch are computed.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from trainer import distributed, stamp


class ConfigError(ValueError):
    """A configuration value that cannot work; the message is one line naming the key."""


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
    limit_train_batches: Optional[int] = None
    limit_val_batches: Optional[int] = None
    overfit_batches: int = 0  # >0: train on the same first N batches (validation as set)
    fast_dev_run: bool = False
    deterministic: bool = False
    detect_anomaly: bool = False
    profile: bool = False
    progress_bar: bool = True
    tensorboard: bool = True
    save_checkpoint: bool = True
    resume: Optional[str] = None  # null | auto | path to a checkpoint
    max_bad_steps: int = 20  # stop after this many optimizer steps in a row with a non-finite loss; 0: never
    tf32: bool = True  # CUDA: fp32 matmuls and convolutions on TF32 tensor cores (Ampere+)
    cudnn_benchmark: bool = True  # CUDA: time cuDNN's algorithms per shape, keep the fastest
    compile: CompileConfig = field(default_factory=CompileConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)


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
    flag = _flag(c.async_save)
    if flag != "auto":
        return flag
    return device.type == "cuda" or state_bytes > ASYNC_MIN_CPU_BYTES


def _flag(value: Any) -> Any:
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
        raise ConfigError(f"data.dataset.root={root}: its meta.json has no '{key}' (not "
                          "written by scripts/prepare_data.py --format npy?)")
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


WEEK_S = 604800  # the longest timeout taken: longer ones overflow the C types they reach


def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    if not ok:  # the value as an override writes it: null, true, false
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) \
            else value
        raise ConfigError(f"{key}={shown}: {valid}")


def _check_ranges(cfg: DictConfig) -> None:
    d, t = cfg.data, cfg.trainer
    _check(d.batch_size >= 1, "data.batch_size", d.batch_size, "must be >= 1")
    ebs = d.eval_batch_size
    _check(ebs is None or ebs >= 1, "data.eval_batch_size", ebs, "must be >= 1 or null")
    w = d.num_workers  # an int, or a string from an interpolation (${oc.env:...}) or `auto`
    _check(w == "auto" or (isinstance(w, int) and not isinstance(w, bool) and w >= 0)
           or (isinstance(w, str) and w.strip().isdigit()),
           "data.num_workers", w, "must be auto or an integer >= 0")
    _check(d.placement in PLACEMENTS, "data.placement", d.placement,
           "must be auto, host or device")
    _check(d.device_budget_mb >= 0, "data.device_budget_mb", d.device_budget_mb, "must be >= 0")
    _check(d.augment.crop_padding >= 0, "data.augment.crop_padding", d.augment.crop_padding,
           "must be >= 0 pixels (0: off)")
    _check(d.prefetch_factor >= 1, "data.prefetch_factor", d.prefetch_factor, "must be >= 1")
    _check(0 <= d.timeout <= WEEK_S, "data.timeout", d.timeout,
           f"must be from 0 to {WEEK_S} seconds (a week; 0: wait forever)")
    _check(d.multiprocessing_context in MP_CONTEXTS, "data.multiprocessing_context",
           d.multiprocessing_context, "must be null, fork, spawn or forkserver")
    _check(d.cache in CACHE_MODES, "data.cache", d.cache, "must be none, memory, shm, disk or lru")
    _check(d.cache_mb > 0, "data.cache_mb", d.cache_mb, "must be > 0 MB")
    mean, std = d.normalize_mean, d.normalize_std
    for key, v in (("normalize_mean", mean), ("normalize_std", std)):
        _check(v is None or ((OmegaConf.is_list(v) or isinstance(v, (list, tuple))) and len(v)
                             and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                     for x in v)),
               f"data.{key}", v, "must be null or a list of numbers, one per channel")
    _check((mean is None) == (std is None), "data.normalize_mean", mean,
           "set data.normalize_mean and data.normalize_std together")
    _check(std is None or (len(std) == len(mean) and all(v > 0 for v in std)),
           "data.normalize_std", std, "needs one value > 0 per data.normalize_mean entry")
    shape = d.input_shape
    _check(shape is None or ((OmegaConf.is_list(shape) or isinstance(shape, (list, tuple)))
                             and len(shape) >= 1
                             and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1
                                     for s in shape)),
           "data.input_shape", shape if shape is None or not OmegaConf.is_list(shape)
           else list(shape), "must be null or a non-empty list of sizes >= 1")
    shape = list(shape) if shape is not None else None
    if shape is not None and len(shape) == 3:  # (channels, height, width) images
        _check(mean is None or len(mean) in (1, shape[0]), "data.normalize_mean", mean,
               f"needs one value per channel (or one for all): data.input_shape={shape} has "
               f"{shape[0]}")
        _check(d.augment.crop_padding < min(shape[1:]), "data.augment.crop_padding",
               d.augment.crop_padding, f"must be under the image's side ({min(shape[1:])} "
               f"px, data.input_shape={shape}): crops of more padding than image teach nothing")
    acc = t.accumulate_grad_batches
    _check(acc >= 1, "trainer.accumulate_grad_batches", acc, "must be >= 1")
    clip = t.grad_clip
    _check(clip is None or clip > 0, "trainer.grad_clip", clip, "must be > 0 or null")
    _check(t.max_epochs >= 1, "trainer.max_epochs", t.max_epochs, "must be >= 1")
    _check(t.max_steps == -1 or t.max_steps >= 1, "trainer.max_steps", t.max_steps,
           "must be -1 (no limit) or >= 1")
    _check(t.val_every_n_epochs >= 1, "trainer.val_every_n_epochs", t.val_every_n_epochs,
           "must be >= 1")
    _check(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", t.log_every_n_steps,
           "must be >= 1")
    for key in ("limit_train_batches", "limit_val_batches"):
        v = t[key]
        _check(v is None or v >= 1, f"trainer.{key}", v, "must be >= 1 or null")
    c = t.checkpoint
    for key in ("every_n_steps", "every_n_epochs"):
        _check(c[key] >= 0, f"trainer.checkpoint.{key}", c[key], "must be >= 0 (0: off)")
    _check(c.keep_last >= 1, "trainer.checkpoint.keep_last", c.keep_last, "must be >= 1")
    _check(0 < c.timeout_s <= WEEK_S, "trainer.checkpoint.timeout_s", c.timeout_s,
           f"must be > 0 and at most {WEEK_S} seconds (a week)")
    _check(_flag(c.async_save) is not None, "trainer.checkpoint.async_save", c.async_save,
           "must be auto, true or false")
    _check(c.mode in (None, "max", "min"), "trainer.checkpoint.mode", c.mode,
           "must be max, min or null (the metric's own direction)")
    _check(c.mode is None or c.monitor is not None, "trainer.checkpoint.mode", c.mode,
           "is the direction of trainer.checkpoint.monitor, which is not set; set the key to "
           "monitor (trainer.checkpoint.monitor=val_acc) or leave mode null")
    _check(-2**63 <= cfg.seed < 2**63, "seed", cfg.seed,
           "must be an integer that fits 64 bits (-2**63 to 2**63 - 1)")
    lr = cfg.optim.get("lr") if isinstance(cfg.get("optim"), DictConfig) else None
    _check(not isinstance(lr, float) or math.isfinite(lr), "optim.lr", lr,
           "must be a finite number")
    _check(t.max_bad_steps >= 0, "trainer.max_bad_steps", t.max_bad_steps, "must be >= 0")
    _check(t.overfit_batches >= 0, "trainer.overfit_batches", t.overfit_batches, "must be >= 0")
    _check(d.num_classes is None or d.num_classes >= 2, "data.num_classes", d.num_classes,
           "must be null or >= 2")
    _check_datasets(d)


def _check_datasets(d: DictConfig) -> None:
    has_pair = d.train_dataset is not None or d.val_dataset is not None
    _check(not (d.dataset is not None and has_pair), "data.dataset", "...",
           "set either data.dataset (called with split=train|val) or data.train_dataset and "
           "data.val_dataset, not both")
    _check(d.dataset is not None or d.train_dataset is not None, "data.train_dataset", None,
           "no dataset: set data.dataset, or data.train_dataset (and data.val_dataset)")


def _check_schema_keys(node: DictConfig, schema: type, prefix: str) -> None:
    """Keys added with `+key=value` bypass the typed schema: a misspelt one would be ignored."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        _check(key in fields, f"{prefix}{key}", node[key] if not OmegaConf.is_missing(node, key)
               else "???", f"not a key of {prefix.rstrip('.') or 'the root config'} (valid keys: "
               + ", ".join(fields) + ")")
        sub = fields[key].default_factory
        if sub is not dataclasses.MISSING and dataclasses.is_dataclass(sub):
            _check_schema_keys(node[key], sub, f"{prefix}{key}.")


def _pick_device(cfg: DictConfig, local_rank: int) -> torch.device:
    acc = cfg.trainer.accelerator
    cuda = torch.cuda.is_available()
    _check(acc != Accelerator.cuda or cuda, "trainer.accelerator", "cuda",
           "CUDA is not available on this machine; use auto or cpu")
    if acc == Accelerator.cpu or not cuda:
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _pick_strategy(cfg: DictConfig, world_size: int, launched: bool) -> Strategy:
    s = cfg.trainer.strategy
    if s == Strategy.auto:
        return Strategy.ddp if launched and world_size > 1 else Strategy.single
    _check(not (s == Strategy.single and world_size > 1), "trainer.strategy", "single",
           f"cannot run in a job of {world_size} ranks; use auto or ddp")
    _check(not (s == Strategy.dp and world_size > 1), "trainer.strategy", "dp",
           f"DataParallel is one process over all GPUs, but this job has {world_size} ranks; "
           "launch with plain `python train.py` or use trainer.strategy=ddp")
    _check(not (s == Strategy.ddp and not launched), "trainer.strategy", "ddp",
           "needs a torchrun or SLURM launch (e.g. torchrun --nproc_per_node=2 train.py); "
           "use auto or single for one process")
    return s


# torch.compile backends that torch lists but that live in packages of their own
_BACKEND_PACKAGES = {"tvm": "tvm", "openxla": "torch_xla", "onnxrt": "onnxruntime",
                     "tensorrt": "torch_tensorrt", "ipex": "intel_extension_for_pytorch"}


def _check_speed(cfg: DictConfig, strategy: Strategy) -> None:
    c = cfg.trainer.compile
    _check(c.mode in COMPILE_MODES, "trainer.compile.mode", c.mode,
           "must be one of " + ", ".join(COMPILE_MODES))
    if c.enabled:
        # debug backends (eager, aot_eager) are accepted; the message names the usual ones
        _check(c.backend in torch.compiler.list_backends(exclude_tags=()),
               "trainer.compile.backend", c.backend,
               "must be one of " + ", ".join(torch.compiler.list_backends() + ["aot_eager"]))
        package = _BACKEND_PACKAGES.get(c.backend.split("_")[0])
        _check(package is None or importlib.util.find_spec(package) is not None,
               "trainer.compile.backend", c.backend,
               f"needs the {package} package, which is not installed here; use inductor (the "
               "default)")
        _check(strategy != Strategy.dp, "trainer.compile.enabled", True,
               "is not supported with DataParallel (a comparison mode); use ddp or single")
        # eager runs the captured checkpoint regions as they are: the recomputation repeats
        # BatchNorm's in-place statistics update, which autograd then refuses
        _check(not (c.backend == "eager" and cfg.model.get("activation_checkpointing")),
               "trainer.compile.backend", c.backend,
               "cannot run model.activation_checkpointing=true; use aot_eager or inductor, or "
               "model.activation_checkpointing=false")
    optim = cfg.optim
    fused, foreach = optim.get("fused"), optim.get("foreach")
    _check(not (fused and foreach), "optim.fused", fused,
           "cannot be combined with optim.foreach=true; set one of them to null")


def _check_graphs_and_accumulation(cfg: DictConfig, device: torch.device) -> None:
    """A model compiled to replay CUDA graphs hands its backward's outputs over as the
    parameters' gradients: the next micro-batch's replay writes over the ones accumulated so
    far (PyTorch raises "accessing tensor output of CUDAGraphs that has been overwritten", or
    the gradient silently holds one micro-batch's share; pytorch/pytorch#169545)."""
    from trainer.speed import cuda_graphs  # (speed imports this module)

    c = cfg.trainer.compile
    if device.type != "cuda" or not cuda_graphs(c) or cfg.trainer.accumulate_grad_batches == 1:
        return
    key, value, instead = (
        ("trainer.compile.backend", c.backend, "trainer.compile.backend=inductor")
        if c.backend == "cudagraphs" else
        ("trainer.compile.mode", c.mode,
         "trainer.compile.mode=max-autotune-no-cudagraphs (or default)"))
    raise ConfigError(f"{key}={value}: replays CUDA graphs, whose next replay overwrites the "
                      "gradients accumulated so far, so it cannot be combined with "
                      f"trainer.accumulate_grad_batches={cfg.trainer.accumulate_grad_batches}; "
                      f"use {instead}, or trainer.accumulate_grad_batches=1")


def resolve(cfg: DictConfig, world_size: int = 1, local_rank: int = 0,
            launched: bool = False) -> RunSpec:
    """Checks every value that could not work and returns the derived values of the run.

    Raises ConfigError (one line naming the key and what would be valid) on the first problem.
    """
    _check_schema_keys(cfg, TrainConfig, "")
    _check_ranges(cfg)
    device = _pick_device(cfg, local_rank)
    strategy = _pick_strategy(cfg, world_size, launched)
    prec = cfg.trainer.precision
    # torch's fused SGD step writes nothing on a step the GradScaler skips, yet keeps the
    # momentum buffers it made for it (uninitialised memory) when that was the first step
    optim = cfg.optim
    _check(not (prec == Precision.fp16 and optim.get("_target_") == "torch.optim.SGD"
                and optim.get("fused") and optim.get("momentum")), "optim.fused", True,
           "with SGD's momentum under fp16 keeps the momentum of a first step the GradScaler "
           "skipped (uninitialised memory); set optim.fused=null (or bf16)")
    _check(prec != Precision.fp16 or device.type == "cuda", "trainer.precision", "fp16",
           "needs CUDA (GradScaler); on CPU use bf16 or fp32")
    _check(prec != Precision.bf16 or device.type != "cuda" or torch.cuda.is_bf16_supported(),
           "trainer.precision", "bf16", "this GPU does not support bfloat16; use fp16")
    _check(strategy != Strategy.dp or device.type == "cuda", "trainer.strategy", "dp",
           "DataParallel needs CUDA devices; use single on CPU")
    _check(not (cfg.trainer.ddp.sync_batchnorm and strategy == Strategy.ddp
                and device.type != "cuda"), "trainer.ddp.sync_batchnorm", True,
           "SyncBatchNorm needs CUDA devices; set it to false on CPU")
    # PyTorch's DDP asserts (and, patched, silently stops all-reducing) when static_graph
    # meets no_sync(), which accumulation uses (pytorch/pytorch#143580)
    _check(not (cfg.trainer.ddp.static_graph and strategy == Strategy.ddp
                and cfg.trainer.accumulate_grad_batches > 1), "trainer.ddp.static_graph", True,
           "cannot be combined with trainer.accumulate_grad_batches > 1 (DDP's no_sync); "
           "set one of them back")
    _check_speed(cfg, strategy)
    _check_graphs_and_accumulation(cfg, device)
    _check(0 < cfg.trainer.ddp.timeout_s <= WEEK_S, "trainer.ddp.timeout_s",
           cfg.trainer.ddp.timeout_s, f"must be > 0 and at most {WEEK_S} seconds (a week)")
    # Under dp the one process's batch is split across GPUs, so it still counts once.
    global_batch = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * world_size
    return RunSpec(device=device, strategy=strategy, precision=prec, world_size=world_size,
                   global_batch=global_batch)


def monitor_mode(cfg: DictConfig, directions: Dict[str, Optional[bool]]) -> Optional[str]:
    """The checked `trainer.checkpoint.mode` for the monitored key: `directions` maps every
    validation key the task logs to whether higher is better (None: unknown). Returns max or
    min (null if nothing is monitored); ConfigError for an unknown key or a contradicting mode.
    """
    c = cfg.trainer.checkpoint
    if c.monitor is None:
        return None
    _check(c.monitor in directions, "trainer.checkpoint.monitor", c.monitor,
           "must be null or a logged validation key: " + ", ".join(directions))
    higher = directions[c.monitor]
    if c.mode is None:
        _check(higher is not None, "trainer.checkpoint.mode", None,
               f"{c.monitor} does not say which direction is better; set max or min")
        return "max" if higher else "min"
    _check(higher is None or (c.mode == "max") == higher, "trainer.checkpoint.mode", c.mode,
           f"{c.monitor} is better when {'higher' if higher else 'lower'}; use "
           f"{'max' if higher else 'min'} or null")
    return c.mode

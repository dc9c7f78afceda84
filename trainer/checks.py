"""Every semantic check of a composed config, and the values derived from it.

The schema (trainer/config.py) refuses a misspelt key or a wrong type while Hydra composes the
config. What the schema cannot say is checked here: ranges, keys that only work together, and
what needs the environment (is CUDA here? how many ranks?). `resolve` is the one place where
derived values such as the global batch are computed; every problem is a ConfigError of one
line that names the key and what would be valid.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import Any, Callable, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from trainer import spelling
from trainer.config import (CACHE_MODES, COMPILE_MODES, MP_CONTEXTS, PLACEMENTS, Accelerator,
                            ConfigError, Precision, RunSpec, Strategy, TrainConfig, tri_state)
from trainer.overrides import override_key

WEEK_S = 604800  # the longest timeout taken: longer ones overflow the C types they reach


def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    if not ok:  # the value as an override writes it: null, true, false
        shown = "null" if value is None else str(value).lower() if isinstance(value, bool) \
            else value
        raise ConfigError(f"{key}={shown}: {valid}")


def _a_limit(value: Any, least: int) -> bool:
    """Whether `value` is a batch limit: null, an int >= `least`, or a float share in (0, 1]
    (0.0 too where `least` is 0: none)."""
    if value is None:
        return True
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return value >= least
    return 0.0 < value <= 1.0 or (least == 0 and value == 0.0)


def _check_data(d: DictConfig) -> None:
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
    _check(0 < d.cache_mb < math.inf, "data.cache_mb", d.cache_mb, "must be > 0 MB")  # (inf:
    # int()'s OverflowError in the lru cache)
    # empty: its folders went into the working directory
    _check(d.cache != "disk" or bool(str(d.cache_dir).strip()), "data.cache_dir", "''",
           "must name a folder for data.cache=disk (the default: data_cache/auto)")
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
    if "data.dataset.size" in str(OmegaConf.to_container(d, resolve=False).get("input_shape")):
        size = OmegaConf.select(d, "dataset.size")  # (the image configs' input_shape reads it:
        _check(isinstance(size, int) and not isinstance(size, bool) and size >= 1,  # say it)
               "data.dataset.size", size, "must be a whole number of pixels >= 1 (the side of "
               "the images' square centre crop)")
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
    _check(d.num_classes is None or d.num_classes >= 2, "data.num_classes", d.num_classes,
           "must be null or >= 2 (the classes of a classification; a "
           "regression's outputs are the model's: +model.num_classes=1)")
    _check_datasets(d)


def _check_trainer(cfg: DictConfig) -> None:
    t = cfg.trainer
    acc = t.accumulate_grad_batches
    _check(acc >= 1, "trainer.accumulate_grad_batches", acc, "must be >= 1")
    clip = t.grad_clip
    _check(clip is None or clip > 0, "trainer.grad_clip", clip, "must be > 0 or null")
    _check(t.max_epochs >= 1 or t.max_epochs == -1, "trainer.max_epochs", t.max_epochs,
           "must be -1 (no limit: trainer.max_steps ends the run) or >= 1")
    _check(t.max_steps == -1 or t.max_steps >= 1, "trainer.max_steps", t.max_steps,
           "must be -1 (no limit) or >= 1")
    _check(t.max_epochs != -1 or t.max_steps >= 1, "trainer.max_epochs", t.max_epochs,
           "needs trainer.max_steps >= 1: with neither limit the run would not end")
    _check(t.val_every_n_epochs >= 1, "trainer.val_every_n_epochs", t.val_every_n_epochs,
           "must be >= 1")
    _check(t.log_every_n_steps >= 1, "trainer.log_every_n_steps", t.log_every_n_steps,
           "must be >= 1")
    _check(_a_limit(t.limit_train_batches, 1), "trainer.limit_train_batches",
           t.limit_train_batches, "must be a number of batches >= 1, a share of the epoch's "
           "batches in (0, 1] (0.25: a quarter), or null (all)")
    _check(_a_limit(t.limit_val_batches, 0), "trainer.limit_val_batches", t.limit_val_batches,
           "must be a number of batches >= 1, 0 (no validation), a share of the split's "
           "batches in (0, 1] (0.1: a tenth), or null (all)")
    c = t.checkpoint
    for key in ("every_n_steps", "every_n_epochs"):
        _check(c[key] >= 0, f"trainer.checkpoint.{key}", c[key], "must be >= 0 (0: off)")
    _check(c.keep_last >= 1, "trainer.checkpoint.keep_last", c.keep_last, "must be >= 1")
    _check(0 < c.timeout_s <= WEEK_S, "trainer.checkpoint.timeout_s", c.timeout_s,
           f"must be > 0 and at most {WEEK_S} seconds (a week)")
    _check(tri_state(c.async_save) is not None, "trainer.checkpoint.async_save", c.async_save,
           "must be auto, true or false")
    _check(c.mode in (None, "max", "min"), "trainer.checkpoint.mode", c.mode,
           "must be max, min or null (the metric's own direction)")
    _check(c.mode is None or c.monitor is not None, "trainer.checkpoint.mode", c.mode,
           "is the direction of trainer.checkpoint.monitor, which is not set; set the key to "
           "monitor (trainer.checkpoint.monitor=val_acc) or leave mode null")
    e = t.early_stopping
    _check(e.patience >= 0, "trainer.early_stopping.patience", e.patience,
           "must be >= 0 (validations without improvement; 0: off)")
    _check(math.isfinite(e.min_delta) and e.min_delta >= 0, "trainer.early_stopping.min_delta",
           e.min_delta, "must be a finite number >= 0")
    _check(not e.patience or c.monitor is not None, "trainer.early_stopping.patience",
           e.patience, "watches trainer.checkpoint.monitor, which is not set; name the metric "
           "(trainer.checkpoint.monitor=val_loss)")
    _check(not e.min_delta or e.patience, "trainer.early_stopping.min_delta", e.min_delta,
           "is early stopping's, which is off (trainer.early_stopping.patience=0); set the "
           "patience too (trainer.early_stopping.patience=5), or leave min_delta 0")
    _check(-2**63 <= cfg.seed < 2**63, "seed", cfg.seed,
           "must be an integer that fits 64 bits (-2**63 to 2**63 - 1)")
    lr = cfg.optim.get("lr") if isinstance(cfg.get("optim"), DictConfig) else None
    _check(not isinstance(lr, float) or math.isfinite(lr), "optim.lr", lr,
           "must be a finite number")
    _check(t.max_bad_steps >= 0, "trainer.max_bad_steps", t.max_bad_steps, "must be >= 0")
    _check(t.overfit_batches >= 0, "trainer.overfit_batches", t.overfit_batches, "must be >= 0")
    _check(t.init_from is None or bool(str(t.init_from).strip()), "trainer.init_from",
           t.init_from, "is empty: give a path to a weights file, or null")
    _check(t.init_from is None or t.resume in (None, "auto"), "trainer.init_from", t.init_from,
           f"cannot be combined with trainer.resume={t.resume}, which continues that "
           "checkpoint's whole training state, weights included; give one of them "
           "(trainer.resume=auto goes with it: a requeued job continues its own run)")
    _check(not (t.overfit_batches and t.limit_train_batches is not None),
           "trainer.limit_train_batches", t.limit_train_batches,
           f"cannot be combined with trainer.overfit_batches={t.overfit_batches}, which sets the "
           "batches of every epoch itself; set one of them")


def _check_validate_only(t: DictConfig) -> None:
    """trainer.validate_only validates trainer.init_from's weights: without them it would
    report the initial weights' numbers, which nobody asks for by that key."""
    if not t.validate_only:
        return
    _check(t.init_from is not None, "trainer.validate_only", True,
           "validates the weights of trainer.init_from=PATH (a run's checkpoint such as "
           "outputs/my-run/checkpoints/best.pt, a state dict or a .safetensors file), which is "
           "not set" + (f"; trainer.resume={t.resume} continues a training: give that file as "
                        "trainer.init_from" if t.resume not in (None, "auto") else ""))
    _check(t.init_strict, "trainer.validate_only", True,
           "validates the file's model as it is, and trainer.init_strict=false would leave the "
           "tensors that do not fit as initialised; give the model settings its run had")
    # (trainer.resume=PATH with init_from is refused above; auto, as the SLURM script passes
    # it, is taken: a validation goes into a new dir, where it finds nothing to continue)
    _check(not t.profile, "trainer.validate_only", True,
           "cannot be combined with trainer.profile, which traces training steps; set one")
    _check(t.limit_val_batches != 0, "trainer.validate_only", True,
           "has nothing to validate with trainer.limit_val_batches=0")
    _check(not t.fast_dev_run, "trainer.validate_only", True,
           "cannot be combined with trainer.fast_dev_run (a training's dry run); set one")


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


def _set_by_debug() -> str:
    """Where a debug mode (conf/debug/, one process) chose the strategy: which one, so that a
    torchrun job of debug=default is not told of a key it never set."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ""
    h = HydraConfig.get()
    mode = h.runtime.choices.get("debug")
    stated = any(override_key(a) == "trainer.strategy" and "=" in a for a in h.overrides.task)
    return "" if mode in (None, "null") or stated else (
        f" (debug={mode} sets it, for one process: add trainer.strategy=auto to debug this "
        "job's ranks with its other settings)")


def _pick_strategy(cfg: DictConfig, world_size: int, launched: bool) -> Strategy:
    s = cfg.trainer.strategy
    if s == Strategy.auto:
        return Strategy.ddp if launched and world_size > 1 else Strategy.single
    _check(not (s == Strategy.single and world_size > 1), "trainer.strategy", "single",
           f"cannot run in a job of {world_size} ranks; use auto or ddp{_set_by_debug()}")
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
    _check_data(cfg.data)
    _check_trainer(cfg)
    _check_validate_only(cfg.trainer)
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
    bucket = cfg.trainer.ddp.bucket_cap_mb  # (nan reached DDP's int(); a negative one passed)
    _check(0 < bucket < math.inf, "trainer.ddp.bucket_cap_mb", bucket,
           "must be a size > 0 MB (DDP's default: 25)")
    # Under dp the one process's batch is split across GPUs, so it still counts once.
    global_batch = cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * world_size
    return RunSpec(device=device, strategy=strategy, precision=prec, world_size=world_size,
                   global_batch=global_batch)


def monitor_mode(cfg: DictConfig, directions: Dict[str, Optional[bool]],
                 entry_metrics: Callable[[str], List[str]] = lambda key: []
                 ) -> Optional[str]:
    """The checked `trainer.checkpoint.mode` for the monitored key: `directions` maps every
    validation key the task logs to whether higher is better (None: unknown). Returns max or
    min (null if nothing is monitored); ConfigError for an unknown key or a contradicting mode.
    `entry_metrics(key)`: the metrics whose dict entry the key could be (val_<name>_<entry>),
    whose direction it takes where they agree (their computes show whether one has it).
    """
    c = cfg.trainer.checkpoint
    if c.monitor is None:
        return None
    why = ("trainer.limit_val_batches=0" if cfg.trainer.limit_val_batches == 0
           else "no validation set: data.val_dataset is null")
    _check(bool(directions), "trainer.checkpoint.monitor", c.monitor,
           f"nothing is validated in this run ({why}), so there is no value to monitor; set "
           "it to null, or validate")
    if c.monitor in directions:
        higher = directions[c.monitor]
    else:
        could = {directions[f"val_{n}"] for n in entry_metrics(str(c.monitor))}
        if not could:
            # (another case, `val_R2`; without its val_, `r2`; misspelt, `val_ac`)
            meant = spelling.meant(str(c.monitor), directions, f"val_{c.monitor}")
            _check(False, "trainer.checkpoint.monitor", c.monitor,
                   "must be null or a logged validation key: " + ", ".join(directions)
                   + (f" (did you mean {meant}?)" if meant else "")
                   + " (or val_<metric>_<entry>: an entry of a metric that computes a dict)")
        higher = could.pop() if len(could) == 1 else None
    if c.mode is None:
        _check(higher is not None, "trainer.checkpoint.mode", None,
               f"{c.monitor} does not say which direction is better; set max or min")
        return "max" if higher else "min"
    _check(higher is None or (c.mode == "max") == higher, "trainer.checkpoint.mode", c.mode,
           f"{c.monitor} is better when {'higher' if higher else 'lower'}; use "
           f"{'max' if higher else 'min'} or null")
    return c.mode

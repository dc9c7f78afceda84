"""Speed switches that change how fast a step runs, not what it computes (beyond rounding).

Each is one config key, applied once before training:

- `trainer.tf32`: fp32 matmuls and convolutions run on TF32 tensor cores (Ampere and later;
  10-bit mantissa inputs, fp32 accumulation). No effect on CPU or in bf16/fp16 autocast regions.
- `trainer.cudnn_benchmark`: cuDNN times its convolution algorithms for each new input shape
  and keeps the fastest. Off under `trainer.deterministic` (the choice can differ run to run).
- `data.channels_last`: 4-D inputs (by the prefetcher) *and* the model's 4-D weights in
  channels_last memory format, which tensor-core convolutions prefer; both or neither, since a
  mismatch makes every convolution convert its input.
- `trainer.compile.*`: `torch.compile`, in place (`nn.Module.compile`), so state_dict keys and
  checkpoints are unchanged. Under DDP the DDP module is compiled, which lets Dynamo split the
  graph at gradient-bucket boundaries and keep all-reduce overlapped with the backward.
- fused/foreach optimizers are the optimizer's own keys (`optim.fused`, `optim.foreach`), and
  activation checkpointing is the reference models' `model.activation_checkpointing`.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, Dict, Optional

import torch
from torch import nn

from trainer.config import CompileConfig

log = logging.getLogger("stoker")


def _set_tf32(enabled: bool) -> None:
    """TF32 for matmuls and cuDNN convolutions, through the API every reader accepts.

    torch >= 2.9 also has per-backend `fp32_precision` setters, but once one of them is used
    the process-wide getters (`torch.get_float32_matmul_precision()`, `matmul.allow_tf32`)
    raise, and Inductor's autotuning (`compile.mode=max-autotune`) and other libraries read
    them. These setters keep the old and the new getters answering alike.
    """
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    mkldnn = getattr(torch.backends.mkldnn, "matmul", None)
    if hasattr(mkldnn, "fp32_precision"):  # that call also turns TF32 on for CPUs with AMX-FP16: CUDA only
        mkldnn.fp32_precision = "ieee"


def backend_flags(tf32: bool, cudnn_benchmark: bool, deterministic: bool) -> None:
    """Sets the process-wide TF32 and cuDNN autotuning flags (deterministic wins over
    autotuning, whose algorithm choice can vary between runs)."""
    _set_tf32(tf32)
    if deterministic and cudnn_benchmark and torch.cuda.is_available():
        log.info("trainer.deterministic=true turns trainer.cudnn_benchmark off")
    torch.backends.cudnn.benchmark = cudnn_benchmark and not deterministic


def memory_format(model: nn.Module, channels_last: bool) -> nn.Module:
    """The model with its 4-D parameters and buffers in channels_last when asked."""
    return model.to(memory_format=torch.channels_last) if channels_last else model


def cuda_graphs(cfg: CompileConfig) -> bool:
    """Whether the compiled model replays CUDA graphs, whose outputs the next replay
    overwrites (a tensor kept across steps must be copied)."""
    return cfg.enabled and (cfg.mode in ("reduce-overhead", "max-autotune")
                            or cfg.backend == "cudagraphs")


def compile_model(model: nn.Module, cfg: CompileConfig) -> nn.Module:
    """Compiles `model` (already wrapped for its strategy) in place when enabled.

    Compilation itself happens lazily at the first forward; its time shows in the first
    logging window's samples/s.
    """
    if cfg.enabled:
        model.compile(mode=None if cfg.mode == "default" else cfg.mode, backend=cfg.backend,
                      fullgraph=cfg.fullgraph, dynamic=cfg.dynamic)
        log.info("torch.compile: backend %s, mode %s (the first steps include compilation)",
                 cfg.backend, cfg.mode)
    return model


def process_flags(t: Any) -> Callable[[], None]:
    """The process's backend flags from the trainer config `t`: anomaly detection,
    deterministic algorithms, TF32 and cuDNN autotuning. Returns what puts them back as they
    were (a program that trains from Python ran its own code after the run with anomaly
    detection, deterministic algorithms and TF32 left on, three times slower)."""
    before = _flags_now()
    torch.autograd.set_detect_anomaly(bool(t.detect_anomaly))
    if t.deterministic:
        # cuBLAS needs a fixed workspace to be deterministic; harmless on CPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    _deterministic(bool(t.deterministic), compiling=bool(t.compile.enabled))
    backend_flags(t.tf32, t.cudnn_benchmark, t.deterministic)

    def put_back() -> None:  # (a run that ended, well or not, is not failed by this)
        try:
            _put_back(before)
        except Exception as e:  # noqa: BLE001 (a torch that refuses a setting back)
            log.warning("could not put torch's backend flags back as they were before the "
                        "run: %s", " ".join(str(e).split())[:300])
    return put_back


def _fp32_backends() -> Dict[str, Any]:
    """torch >= 2.9's per-backend fp32 precision settings, by name (none on an older torch).
    These read in any state; the process-wide getters raise once a program mixed them with
    the per-backend setters."""
    b = torch.backends
    found = {"": b, "cuda.matmul": b.cuda.matmul, "cudnn": b.cudnn, "cudnn.conv":
             getattr(b.cudnn, "conv", None), "cudnn.rnn": getattr(b.cudnn, "rnn", None),
             "mkldnn": b.mkldnn, "mkldnn.matmul": getattr(b.mkldnn, "matmul", None),
             "mkldnn.conv": getattr(b.mkldnn, "conv", None),
             "mkldnn.rnn": getattr(b.mkldnn, "rnn", None)}
    return {k: v for k, v in found.items() if hasattr(v, "fp32_precision")}


def _readable(getter: Callable[[], Any]) -> Any:
    """A process-wide precision getter's answer; None where torch refuses it (the program
    set a per-backend precision before)."""
    try:
        return getter()
    except RuntimeError:
        return None


def _flags_now() -> Dict[str, Any]:
    return {"anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "matmul": _readable(torch.get_float32_matmul_precision),
            "cudnn": _readable(lambda: torch.backends.cudnn.allow_tf32),
            "benchmark": torch.backends.cudnn.benchmark,
            "fp32": {k: v.fp32_precision for k, v in _fp32_backends().items()},
            "cublas": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def _put_back(before: Dict[str, Any]) -> None:
    """The flags `_flags_now` read, set again where a run changed them: through the
    process-wide setters where the program's state read through them, then each per-backend
    precision that still differs (a program that set those gets them back as it set them)."""
    now = _flags_now()
    if now["anomaly"] != before["anomaly"]:
        torch.autograd.set_detect_anomaly(*before["anomaly"])
    if now["deterministic"] != before["deterministic"]:
        _deterministic(*before["deterministic"])
    if before["matmul"] is not None and now["matmul"] != before["matmul"]:
        torch.set_float32_matmul_precision(before["matmul"])
    if before["cudnn"] is not None:
        torch.backends.cudnn.allow_tf32 = before["cudnn"]
    torch.backends.cudnn.benchmark = before["benchmark"]
    for name, backend in _fp32_backends().items():  # (the process-wide first, then each one)
        if backend.fp32_precision != before["fp32"].get(name, backend.fp32_precision):
            backend.fp32_precision = before["fp32"][name]
    if before["cublas"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before["cublas"]


def _deterministic(mode: bool, warn_only: Optional[bool] = None,
                   compiling: bool = False) -> None:
    """torch.use_deterministic_algorithms(mode, warn_only=...), without its start-up cost
    where it has none to set: the public call also sets torch.compile's own flag, importing
    torch._inductor (about 1.5 s), which only a compiled model reads. `warn_only` None: off
    where the mode changes, left as it is where it does not."""
    now = torch.are_deterministic_algorithms_enabled()
    if warn_only is not None:
        changed = (now, torch.is_deterministic_algorithms_warn_only_enabled()) != (mode,
                                                                                  warn_only)
    else:
        changed = now != mode
    if compiling or "torch._inductor" in sys.modules:  # inductor's flag too, every time
        torch.use_deterministic_algorithms(mode, warn_only=bool(warn_only))
    elif changed:
        torch._C._set_deterministic_algorithms(mode, warn_only=bool(warn_only))

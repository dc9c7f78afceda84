"""Mixed precision: the autocast context and the GradScaler, built once per run.

fp32 runs without autocast. bf16 autocasts (CPU and CUDA) and needs no scaler: its exponent
range is fp32's. fp16 autocasts on CUDA and uses a GradScaler so small gradients survive;
gradients are unscaled before clipping so the clip threshold means the same in every precision.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterable, List, Optional

import torch

from trainer.config import Precision

_DTYPES = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}
# torch's optimizers whose fused CUDA step takes the GradScaler's scale and inf flag itself.
# Not SGD: its fused step leaves a skipped (overflowed) first step's momentum buffers
# uninitialised and keeps them, and fails on a parameter whose first gradient comes late.
_FUSED_SCALED = (torch.optim.Adam, torch.optim.AdamW)


def optimizer_choice(factory: Any, precision: Precision, device: torch.device,
                     params: Iterable[torch.Tensor] = ()) -> Dict[str, Any]:
    """What the run adds to the optimizer's arguments: `fused=True` under fp16 on CUDA for
    torch's Adam and AdamW when optim.fused and optim.foreach are both null (PyTorch's
    choice) and nothing rules the fused step out (differentiable, non-float parameters);
    else nothing. GradScaler.step reads the gradients' inf flag to the host (`.item()`)
    every step for any other optimizer: a sync that keeps the host from queueing the next
    steps while the GPU runs this one. The fused step reads the flag on the device."""
    if precision != Precision.fp16 or device.type != "cuda":
        return {}
    given = getattr(factory, "keywords", None) or {}
    if getattr(factory, "func", factory) not in _FUSED_SCALED or \
            given.get("fused") is not None or given.get("foreach") is not None or \
            given.get("differentiable") or not all(p.is_floating_point() for p in params):
        return {}
    return {"fused": True}


def total_norm(grads: List[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of `grads`. Gradients of one device and dtype (the usual case) take
    three operations; torch.nn.utils.get_total_norm, which groups them first, cost about twice
    as much host time, a logging boundary's largest item on a tiny step."""
    if not grads:
        return torch.zeros(())
    first = grads[0]
    if all(g.dtype == first.dtype and g.device == first.device for g in grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


class MixedPrecision:
    """Owns autocast and the optional GradScaler; `step` does unscale, clip and step."""

    def __init__(self, precision: Precision, device: torch.device):
        self.precision = precision
        self.device = device
        self.scaler: Optional[torch.amp.GradScaler] = (
            torch.amp.GradScaler(device.type) if precision == Precision.fp16 else None)
        # optimizer steps the scaler skipped for inf/NaN gradients, counted on the device
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)

    def autocast(self):
        """Context for the forward pass and loss; a no-op in fp32."""
        if self.precision == Precision.fp32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=_DTYPES[self.precision])

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor],
             grad_clip: Optional[float], want_norm: bool) -> Optional[torch.Tensor]:
        """Unscales (fp16), clips to `grad_clip`, steps the optimizer.

        Returns the pre-clip global gradient norm as a device tensor when clipping or when
        `want_norm` (no host sync here: the caller reads it at a logging boundary).
        """
        if self.scaler:
            self.scaler.unscale_(optimizer)
        norm = None
        if grad_clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
        elif want_norm:  # the norm alone: no clipping pass over the gradients
            norm = total_norm([p.grad for p in params if p.grad is not None])
        if self.scaler:
            before = self._scale_tensor()
            self.scaler.step(optimizer)  # skips the step when the gradients are not finite
            self.scaler.update()
            self._count_skip(before)
        else:
            optimizer.step()
        return norm

    def _scale_tensor(self) -> Optional[torch.Tensor]:
        # GradScaler's public get_scale() syncs; its async accessor returns the device tensor
        scale = self.scaler._get_scale_async()
        return None if scale is None else scale.clone()

    def _count_skip(self, before) -> None:
        """The scaler lowers its scale exactly when it skipped the step: count that on the
        device (the scale is a device tensor; comparing it costs no host sync)."""
        after = self._scale_tensor()
        if before is not None and after is not None:
            self.skipped_steps += (after < before).to(torch.int64)

    def state_dict(self) -> dict:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)

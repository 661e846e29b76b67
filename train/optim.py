"""AdamW over the trainable parameters only, gradient clipping folded into its fused step, and linear warm-up then
cosine decay to zero.

The frozen embedding (``requires_grad=False``) and the teacher's lm_head rows (a plain tensor, not a
module parameter) never reach the optimizer, so they cost no optimizer state and cannot drift.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """fp32 master weights (autocast runs the matmuls in bf16) with fp32 AdamW state; fused on CUDA."""
    return torch.optim.AdamW(trainable(model), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                             fused=fused or None)


# Where accelerate's clip_grad_norm_ is torch's (its unscale a no-op without a GradScaler), so the fold changes nothing.
# FSDP's norm is over shards and DeepSpeed clips inside its engine's step; XLA all-reduces the gradients in the clip.
_FOLDS = (DistributedType.NO, DistributedType.MULTI_GPU)


def fused_adam(optimizer: torch.optim.Optimizer) -> torch.optim.Adam | None:
    """The torch Adam/AdamW that will apply a clip in its step: ``optimizer``, or the one accelerate wraps (without
    an fp16 GradScaler: it unscales the gradients before the clip, then sets ``grad_scale`` itself), when every
    group is fused (the fused kernels take ``grad_scale``; torch's for-each and per-tensor ones refuse it). None:
    clip the gradients in place first."""
    if isinstance(optimizer, AcceleratedOptimizer):
        if optimizer.scaler is not None or optimizer.accelerator_state.distributed_type not in _FOLDS:
            return None
        optimizer = optimizer.optimizer
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(g["fused"] for g in optimizer.param_groups):
        return optimizer
    return None


def _drop_grad_scale(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    optimizer.__dict__.pop("grad_scale", None)


def clip_into_step(optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], max_norm: float,
                   clip: Callable[..., torch.Tensor | None] = torch.nn.utils.clip_grad_norm_) -> torch.Tensor | None:
    """Clip the gradients of ``params`` (the optimizer's own) to total 2-norm ``max_norm`` and return their norm
    before clipping, as ``clip(params, max_norm)`` does (torch's clip_grad_norm_, or accelerate's: the loop's).

    For a ``fused_adam`` the gradients are not touched here: the next ``optimizer.step()`` divides each one by
    max(1, (norm + 1e-6) / max_norm) inside its kernel (torch's ``grad_scale``, the divisor GradScaler uses), the
    inverse of clip_grad_norm_'s factor min(1, max_norm / (norm + 1e-6)); the same update to an ulp, one pass over
    the gradients fewer, and no wait for the device. A non-finite norm gives a non-finite divisor as it gives
    clip_grad_norm_ a non-finite factor: a step taken anyway writes NaN as it would have (the loop skips it).
    ``found_inf`` is left unset. The step drops the divisor (a post hook); a skipped step leaves it for the next
    call to replace, before any step of the loop or the bench."""
    inner = fused_adam(optimizer)
    if inner is None:
        return clip(params, max_norm)
    params = list(params)
    if {id(p) for p in params} != {id(p) for g in inner.param_groups for p in g["params"]}:
        raise ValueError("clip_into_step: params must be the optimizer's own (its step divides every gradient)")
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    # float32 on the norm's device: the fused kernels read it as a float (and copy it to each parameter's device)
    inner.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0).float()
    if _drop_grad_scale not in inner._optimizer_step_post_hooks.values():
        inner.register_step_post_hook(_drop_grad_scale)
    return norm


class WarmupCosine:
    """lr factor: linear 0→1 over ``warmup`` steps, then cosine 1→0 at ``total``. A class (not a
    lambda) so the schedule is plain data in the scheduler state."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, max(total, 1)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, warmup_ratio: float, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, WarmupCosine(round(warmup_ratio * total_steps), total_steps))

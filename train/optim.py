"""AdamW over the trainable parameters only, and linear warm-up then cosine decay to zero.

The frozen embedding (``requires_grad=False``) and the teacher's lm_head rows (a plain tensor, not a
module parameter) never reach the optimizer, so they cost no optimizer state and cannot drift.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, fused: bool) -> torch.optim.AdamW:
    """fp32 master weights (autocast runs the matmuls in bf16) with fp32 AdamW state; fused on CUDA."""
    return torch.optim.AdamW(trainable(model), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95),
                             fused=fused or None)


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

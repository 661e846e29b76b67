"""SpecForge 0.2.0 importable on a CPU: its loss module imports Triton, whose kernels run only on GPUs, so a module
with SpecForge's own reference formula of that loss (``specforge.core.loss._compute_loss``) stands in for it. Every
other piece (draft model, TTT wrapper, target head, strategy, optimizer) is SpecForge's."""

from __future__ import annotations

import sys
import types

import torch


class ReferenceLogSoftmaxLoss:
    """-(mask * p * log_softmax(logits)).sum(-1).mean(): SpecForge's loss over every position, differentiable."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits.float(), dim=2)
        return -torch.sum(position_mask * target_p * logp, 2).mean()


def install() -> None:
    """Put the stand-in loss module in place, before the first import of SpecForge's EAGLE-3 model."""
    if "specforge.core.loss" not in sys.modules:
        module = types.ModuleType("specforge.core.loss")
        module.LogSoftmaxLoss = ReferenceLogSoftmaxLoss
        sys.modules["specforge.core.loss"] = module

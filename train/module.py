"""The drafter wrapped as one module whose ``forward`` is a whole TTT step.

accelerate / DDP / DeepSpeed hook ``forward`` (autocast, gradient sync), so the unrolled loss must run
inside it, with the matmul weights cast once for all its draft steps (``train.weight_cast``), and the weights that
outweigh their rows routed, one gradient matmul over all the steps' rows (``train.shared_weight_grad``). The teacher
rows are a plain attribute, not a buffer: DDP would broadcast a buffer every step, and the optimizer must
never see them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from drafter.model import Eagle3Drafter, attention
from train.shared_weight_grad import routed_weight_grads, worth_routing
from train.ttt import (
    KL,
    Objective,
    TTTResult,
    draft_mass,
    sharpen,
    supervision,
    teacher_from_hidden,
    teacher_from_topk,
    ttt_forward,
)
from train.weight_cast import matmul_weights_cast_once


class TTTModel(nn.Module):
    def __init__(self, drafter: Eagle3Drafter, head_rows: Tensor | None, ttt_length: int, decay: float,
                 teacher_temperature: float = 1.0, objective: Objective = KL, lm_head: Tensor | None = None):
        """``lm_head``: the target's whole head, which an LK ``objective`` needs (the mass on the draft vocab)."""
        super().__init__()
        if objective.needs_mass and (head_rows is None or lm_head is None):
            raise ValueError(f"train.loss {objective.kind}: needs the target's last hidden state and lm_head (a "
                             "store captured with capture.teacher topk has neither); use train.loss kl")
        self.drafter = drafter
        self.head_rows, self.lm_head = head_rows, lm_head
        self.ttt_length, self.decay, self.teacher_temperature = ttt_length, decay, teacher_temperature
        self.objective = objective

    def to_device(self, device: torch.device, dtype: torch.dtype) -> TTTModel:
        """Teacher rows in the compute dtype; the frozen embedding likewise (lookups only)."""
        if self.head_rows is not None:
            self.head_rows = self.head_rows.to(device=device, dtype=dtype)
        if self.lm_head is not None:
            self.lm_head = self.lm_head.to(device=device, dtype=dtype)
        self.drafter.embed_tokens.to(dtype)
        return self.to(device)

    def attn_fn(self, device: torch.device):
        if device.type == "cuda":
            from train.attention import ttt_flex_attention

            return ttt_flex_attention
        return attention

    def forward(self, input_ids: Tensor, loss_mask: Tensor, aux: Tensor, target_argmax: Tensor,
                last_hidden: Tensor | None = None, topk_ids: Tensor | None = None,
                topk_logprobs: Tensor | None = None) -> TTTResult:
        d = self.drafter
        dtype = d.fc.weight.dtype  # DeepSpeed bf16 casts the weights: inputs must follow
        with torch.no_grad():
            if last_hidden is not None:
                teacher = teacher_from_hidden(last_hidden, self.head_rows)
            else:
                teacher = teacher_from_topk(topk_ids, topk_logprobs, d.t2d)
            sup = supervision(sharpen(teacher, self.teacher_temperature), target_argmax, loss_mask, d.t2d)
            mass = (draft_mass(last_hidden, self.head_rows, self.lm_head) if self.objective.needs_mass else None)
        device_type = input_ids.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else dtype
        routed = [m for m in d.step_layers() if worth_routing(m, input_ids.numel())]
        with routed_weight_grads(routed, compute), matmul_weights_cast_once(d, device_type, skip=routed):
            return ttt_forward(d, input_ids, aux.to(dtype), sup, self.ttt_length, self.decay,
                               attn_fn=self.attn_fn(input_ids.device), objective=self.objective, mass=mass)

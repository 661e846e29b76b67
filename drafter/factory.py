"""Build a drafter for a target: warm start from a checkpoint, or a fresh one shaped like the target.

The shape is derived from the target's HF config (hidden size, heads, RoPE) with a few overrides, so
no per-target JSON is needed. Every mismatch that would make serving wrong is a one-line error.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from drafter.model import DrafterShape, Eagle3Drafter
from drafter.sglang_checkpoint import load_checkpoint, read_config, rope_scaling_from, shape_from_config
from target_model.aux_layers import resolve_aux_layer_ids


class DrafterMismatchError(ValueError):
    pass


def shape_for_target(hf_cfg: Any, draft_vocab_size: int, aux_layer_ids: tuple[int, int, int],
                     intermediate_size: int | None = None, num_attention_heads: int | None = None,
                     num_key_value_heads: int | None = None, head_dim: int | None = None) -> DrafterShape:
    rope = getattr(hf_cfg, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf_cfg, "rope_theta", 10000.0))
    heads = num_attention_heads or hf_cfg.num_attention_heads
    return DrafterShape(
        hidden_size=hf_cfg.hidden_size,
        intermediate_size=intermediate_size or hf_cfg.intermediate_size,
        num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or getattr(hf_cfg, "num_key_value_heads", heads),
        head_dim=head_dim or getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads,
        vocab_size=hf_cfg.vocab_size, draft_vocab_size=draft_vocab_size,
        aux_layer_ids=aux_layer_ids, rms_norm_eps=getattr(hf_cfg, "rms_norm_eps", 1e-6),
        rope_theta=float(theta), rope_scaling=rope_scaling_from({"rope_parameters": rope}),
        max_position_embeddings=getattr(hf_cfg, "max_position_embeddings", 8192),
    )


def check_fits_target(shape: DrafterShape, hidden_size: int, vocab_size: int, where: str) -> None:
    if shape.hidden_size != hidden_size:
        raise DrafterMismatchError(f"{where}: drafter hidden_size {shape.hidden_size} differs from the "
                                   f"target's {hidden_size}; the drafter cannot read this target's states")
    if shape.vocab_size != vocab_size:
        raise DrafterMismatchError(f"{where}: drafter vocab_size {shape.vocab_size} differs from the target's "
                                   f"{vocab_size}; a drafter keeps its own vocab map (its lm_head rows are tied to "
                                   "it), so it cannot serve another vocabulary: train one from scratch for this "
                                   "target (no drafter.init_from)")


def drafter_aux_ids(init_from: str | None, num_layers: int) -> tuple[int, int, int] | None:
    if init_from is None:
        return None
    cfg = read_config(init_from)
    return shape_from_config(cfg, f"{init_from}/config.json", num_layers).aux_layer_ids


def load_for_target(path: str | Path, embed: Tensor, num_layers: int, config_aux_ids: Sequence[int] | None = None,
                    device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[Eagle3Drafter, tuple[int, int, int]]:
    """A saved drafter fitted to a target, the one way train (warm start), eval and the benchmarks load
    one. Its own d2t/t2d stay (its lm_head rows are tied to them); its aux ids must agree with
    ``config_aux_ids`` (target.aux_layer_ids, or the store's ids); the target's embedding is copied in.

    embed: the target's input embedding (vocab_size, hidden_size), whose sizes the drafter must match.
    Returns the drafter and the resolved aux layer ids.
    """
    model = load_checkpoint(path, num_target_layers=num_layers, device=device)
    if dtype is not None:
        model = model.to(dtype)
    aux_ids = resolve_aux_layer_ids(config_aux_ids, model.shape.aux_layer_ids, num_layers)
    vocab_size, hidden_size = embed.shape
    check_fits_target(model.shape, hidden_size, vocab_size, str(path))
    model.set_embeddings(embed)
    return model, aux_ids


def fresh_drafter(shape: DrafterShape, embed: Tensor, d2t: Tensor, t2d: Tensor, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(shape)
    model.set_embeddings(embed)
    model.set_vocab_map(d2t, t2d)
    return model

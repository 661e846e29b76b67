"""Build a drafter for a target: warm start from a checkpoint, or a fresh one shaped like the target.

The shape is derived from the target's HF config (hidden size, heads, RoPE) with a few overrides, so
no per-target JSON is needed. Every mismatch that would make serving wrong is a one-line error.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from drafter.checkpoint import load_checkpoint, read_config, rope_scaling_from, shape_from_config
from drafter.model import DrafterShape, Eagle3Drafter
from drafter.target import resolve_aux_layer_ids


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


def check_fits_target(shape: DrafterShape, hidden_size: int, vocab_size: int, where: str,
                      remap_vocab: bool = False) -> None:
    if shape.hidden_size != hidden_size:
        raise DrafterMismatchError(f"{where}: drafter hidden_size {shape.hidden_size} differs from the "
                                   f"target's {hidden_size}; the drafter cannot read this target's states")
    if shape.vocab_size != vocab_size and not remap_vocab:
        raise DrafterMismatchError(f"{where}: drafter vocab_size {shape.vocab_size} differs from the target's "
                                   f"{vocab_size}; set drafter.remap_vocab: true to rebuild the map")


def drafter_aux_ids(init_from: str | None, num_layers: int) -> tuple[int, int, int] | None:
    if init_from is None:
        return None
    cfg = read_config(init_from)
    return shape_from_config(cfg, f"{init_from}/config.json", num_layers).aux_layer_ids


def warm_start(init_from: str, hf_cfg: Any, embed: Tensor, config_aux_ids: tuple[int, ...] | None,
               remap_vocab: bool = False) -> Eagle3Drafter:
    """Load a drafter and fit it to the target. Its own d2t/t2d stay: lm_head rows are tied to them."""
    model = load_checkpoint(init_from, num_target_layers=hf_cfg.num_hidden_layers)
    resolve_aux_layer_ids(config_aux_ids, model.shape.aux_layer_ids, hf_cfg.num_hidden_layers)
    check_fits_target(model.shape, hf_cfg.hidden_size, hf_cfg.vocab_size, init_from, remap_vocab)
    if model.shape.vocab_size != hf_cfg.vocab_size:
        raise DrafterMismatchError(f"{init_from}: vocab remap to {hf_cfg.vocab_size} ids is requested but "
                                   "not supported for warm starts yet; train from scratch instead")
    model.set_embeddings(embed)
    return model


def fresh_drafter(shape: DrafterShape, embed: Tensor, d2t: Tensor, t2d: Tensor, seed: int = 0) -> Eagle3Drafter:
    import torch

    torch.manual_seed(seed)
    model = Eagle3Drafter(shape)
    model.set_embeddings(embed)
    model.set_vocab_map(d2t, t2d)
    return model

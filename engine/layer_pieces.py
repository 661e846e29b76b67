"""The pieces of a decoder layer that ``BatchedTarget`` compiles on CUDA: everything of a layer but the attention
over the cache and the cache writes, run with the model's own modules (norms, projections, rotary table, MLP)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.attention import flex_suffix


def attention_inputs(layer: torch.nn.Module, h: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int,
                     head_dim: int, apply_rope: Callable[..., tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """A decoder layer's queries, keys and values (B, heads|kv, T, d) for hidden states h (B, T, H): its input norm,
    projections (qwen3's per-head norms) and rotation. With ``after_attention``, everything of a layer but the
    attention and the cache writes: the pieces ``BatchedTarget`` compiles on CUDA (a prefill's in one call a layer,
    ``fresh_layer`` and ``suffix_layer``)."""
    b, t, _ = h.shape
    x = layer.input_layernorm(h)
    att = layer.self_attn
    q = att.q_proj(x).view(b, t, heads, head_dim)
    k = att.k_proj(x).view(b, t, kv_heads, head_dim)
    v = att.v_proj(x).view(b, t, kv_heads, head_dim)
    if getattr(att, "q_norm", None) is not None:  # qwen3: per-head RMSNorm before the rotation
        q, k = att.q_norm(q), att.k_norm(k)
    q, k = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


def after_attention(layer: torch.nn.Module, h: Tensor, o: Tensor) -> Tensor:
    """The layer's output for input h (B, T, H) and attention output o (B, heads, T, d): the output projection and
    the MLP, each added to the residual stream."""
    b, heads, t, d = o.shape
    h = h + layer.self_attn.o_proj(o.transpose(1, 2).reshape(b, t, heads * d))
    return h + layer.mlp(layer.post_attention_layernorm(h))


def fresh_layer(layer: torch.nn.Module, nxt: torch.nn.Module, h: Tensor, q: Tensor, k: Tensor, v: Tensor, cos: Tensor,
                sin: Tensor, heads: int, kv_heads: int, head_dim: int, apply_rope: Callable[..., tuple[Tensor, Tensor]],
                scale: float) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """A fresh prefill's layer from its queries, keys and values on (causal attention over its own tokens, then
    ``after_attention``), and layer ``nxt``'s queries, keys and values: on CUDA one compiled call a layer, where the
    two pieces and the attention are three calls, each costing the host a compiled call's fixed overhead (most of a
    forward's time; ``"prefill_step"`` measures it). The keys and values are written to the cache between calls."""
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=kv_heads != heads)
    h = after_attention(layer, h, o)
    return h, attention_inputs(nxt, h, cos, sin, heads, kv_heads, head_dim, apply_rope)


def suffix_layer(layer: torch.nn.Module, nxt: torch.nn.Module, h: Tensor, q: Tensor, k_pool: Tensor, v_pool: Tensor,
                 block_mask: Any, cos: Tensor, sin: Tensor, heads: int, kv_heads: int, head_dim: int,
                 apply_rope: Callable[..., tuple[Tensor, Tensor]], scale: float
                 ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``fresh_layer`` for a suffix prefilled after its row's cached prefix: flex attention over the pooled keys and
    values of this layer (the suffix's own written there first), the rest of the layer, the next one's inputs."""
    o = flex_suffix(q, k_pool, v_pool, block_mask, scale)
    h = after_attention(layer, h, o)
    return h, attention_inputs(nxt, h, cos, sin, heads, kv_heads, head_dim, apply_rope)


class LayerPieces(torch.nn.Module):
    """The layer pieces ``BatchedTarget`` compiles, with a model's constants: "inputs" (``attention_inputs``),
    "after" (``after_attention``), "fresh" (``fresh_layer``) and "suffix" (``suffix_layer``). A module holds them
    because dynamo takes a module's ints as constants: passed as arguments, or read from a closure or a plain
    object, they were traced as symbols under dynamic shapes, so every size in a layer was an expression to reason
    about and guard on (``576 // heads``), and ``kv_heads != heads`` a symbolic bool that broke the fresh layer's
    graph in two. (Its float, the scale, is a constant by ``compile_guard.no_float_symbols``.) No weights: the
    layers come with each call, so one graph serves every layer."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int,
                 apply_rope: Callable[..., tuple[Tensor, Tensor]], scale: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.apply_rope, self.scale = (heads, kv_heads, head_dim,
                                                                                  apply_rope, scale)

    def inputs(self, layer: torch.nn.Module, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return attention_inputs(layer, h, cos, sin, self.heads, self.kv_heads, self.head_dim, self.apply_rope)

    def after(self, layer: torch.nn.Module, h: Tensor, o: Tensor) -> Tensor:
        return after_attention(layer, h, o)

    def fresh(self, layer: torch.nn.Module, nxt: torch.nn.Module, h: Tensor, q: Tensor, k: Tensor, v: Tensor,
              cos: Tensor, sin: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        return fresh_layer(layer, nxt, h, q, k, v, cos, sin, self.heads, self.kv_heads, self.head_dim,
                           self.apply_rope, self.scale)

    def suffix(self, layer: torch.nn.Module, nxt: torch.nn.Module, h: Tensor, q: Tensor, k_pool: Tensor,
               v_pool: Tensor, block_mask: Any, cos: Tensor, sin: Tensor
               ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        return suffix_layer(layer, nxt, h, q, k_pool, v_pool, block_mask, cos, sin, self.heads, self.kv_heads,
                            self.head_dim, self.apply_rope, self.scale)

"""The target run over a per-row static KV cache: many sequences at once, each at its own position.

HF's ``generate`` pads a batch to one length and keeps every row until the longest one ends; with
answers from 5 to 1,024 tokens most of the GPU then decodes padding. Here each row ("slot") of one
preallocated cache holds one sequence, indexed by absolute position, so rows advance by different
amounts (one decode token, a k+1-token verify) and a finished row takes a new prompt while the others
keep going. Writes go to explicit positions and reads are masked by position, so whatever a row left
beyond its current length (a rejected draft, a finished answer) is never read: it is overwritten first.

Only the attention over the cache is ours. Norms, projections, rotary table and MLP are the model's own
modules, so the numbers are the model's, up to the summation order of the attention kernel.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# Decoder layers shaped residual -> input_layernorm -> attention -> residual -> post_attention_layernorm
# -> mlp, with q/k/v/o projections and a rotary table on the model (optionally per-head q/k norms).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedTargetError(ValueError):
    pass


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this model cannot run batched here (None when it can)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {kind!r} is not one of {list(SUPPORTED_MODEL_TYPES)} (the architectures the batched "
                "engine runs); serve the target with SGLang and regenerate with regenerate.backend: openai")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) and kind != "llama":
        return f"{kind} with a sliding attention window ({cfg.sliding_window}) is not supported by the batched engine"
    return None


def position_mask(positions: Tensor, span: int, groups: int) -> Tensor:
    """Bool (B, 1, groups*T, span): key s visible to a query at position p iff s <= p, for each of the
    ``groups`` query heads that share a kv head (folded into the query axis, see below)."""
    b, t = positions.shape
    mask = torch.arange(span, device=positions.device)[None, None, :] <= positions[:, :, None]  # (B, T, S)
    return mask[:, None, None].expand(b, 1, groups, t, span).reshape(b, 1, groups * t, span)


def position_masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q (B, h, T, d) over position-indexed k, v (B, kv, S, d) under ``position_mask``. The query heads
    sharing a kv head are folded into the query axis, so keys are never repeated (grouped-query
    attention at no extra memory)."""
    b, heads, t, d = q.shape
    kv = k.shape[1]
    o = F.scaled_dot_product_attention(q.reshape(b, kv, heads // kv * t, d), k, v, attn_mask=mask, scale=scale)
    return o.reshape(b, heads, t, d)


@dataclass
class KVCache:
    """Keys and values of every layer: (layers, slots, kv_heads, max_len, head_dim), position-indexed."""

    k: Tensor
    v: Tensor

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def move_rows(self, src: Tensor, dst: Tensor) -> None:
        """Copy rows ``src`` to rows ``dst`` (compaction: live rows to the front)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


@dataclass
class BatchedOutput:
    logits: Tensor | None  # (B, V) at ``logits_at`` or (B, T, V) for every position
    aux: Tensor | None  # (B, T, 3H): outputs of the aux layers, in id order


class BatchedTarget:
    """A loaded HF causal LM (one of ``SUPPORTED_MODEL_TYPES``) driven slot by slot."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: Sequence[int] = ()):
        reason = unsupported_reason(model)
        if reason:
            raise UnsupportedTargetError(reason)
        self.model = model.eval()
        base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = base.layers
        self.embed = base.embed_tokens
        self.final_norm = base.norm
        self.rotary = base.rotary_emb
        self.lm_head = model.get_output_embeddings()
        cfg = model.config
        attn = self.layers[0].self_attn
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // self.heads
        self.scaling = getattr(attn, "scaling", self.head_dim ** -0.5)
        self.apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.aux_layer_ids = list(aux_layer_ids)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * self.dtype.itemsize

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        shape = (len(self.layers), slots, self.kv_heads, max_len, self.head_dim)
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device))

    @torch.no_grad()
    def forward(self, cache: KVCache, rows: Tensor | slice, ids: Tensor, positions: Tensor, *, fresh: bool,
                logits_at: Tensor | None = None, all_logits: bool = False, aux: bool = False) -> BatchedOutput:
        """Run ``ids`` (B, T) at ``positions`` (B, T) for cache ``rows`` and write their keys and values.

        fresh: every row starts at position 0 (a prompt's prefill, right-padded): attention is causal over
        these tokens alone. Otherwise ``rows`` must be a slice and each query sees the cached keys at
        positions <= its own. logits_at (B,): the one position per row whose logits are wanted;
        all_logits: every position's. aux: also return the aux layers' outputs.
        """
        b, t = ids.shape
        if not fresh and not isinstance(rows, slice):
            raise TypeError("a cached (non-fresh) step takes a slice of rows, so the cache is read in place")
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        batch_index = torch.arange(b, device=ids.device)[:, None]
        # Keys read per row: up to the furthest position in the batch, rounded up (aligned key blocks).
        span = None if fresh else min(cache.max_len, -(-(int(positions.max()) + 1) // 64) * 64)
        mask = None if fresh else position_mask(positions, span, self.heads // self.kv_heads)  # one for all layers
        keep: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            residual = h
            x = layer.input_layernorm(h)
            att = layer.self_attn
            q = att.q_proj(x).view(b, t, self.heads, self.head_dim)
            k = att.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
            v = att.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
            if getattr(att, "q_norm", None) is not None:  # qwen3: per-head RMSNorm before the rotation
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = self.apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # (B, heads, T, d)
            v = v.transpose(1, 2)
            if fresh:
                cache.k[i, rows, :, :t] = k
                cache.v[i, rows, :, :t] = v
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                                   enable_gqa=self.kv_heads != self.heads)
            else:
                layer_k, layer_v = cache.k[i, rows], cache.v[i, rows]  # views (rows is a slice)
                layer_k[batch_index, :, positions] = k.transpose(1, 2)
                layer_v[batch_index, :, positions] = v.transpose(1, 2)
                o = position_masked_attention(q, layer_k[:, :, :span], layer_v[:, :, :span], mask, self.scaling)
            h = residual + att.o_proj(o.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if aux and i in self.aux_layer_ids:
                keep[i] = h
        logits = None
        if logits_at is not None:
            logits = self.lm_head(self.final_norm(h[torch.arange(b, device=h.device), logits_at]))
        elif all_logits:
            logits = self.lm_head(self.final_norm(h))
        return BatchedOutput(logits, torch.cat([keep[i] for i in self.aux_layer_ids], -1) if aux else None)


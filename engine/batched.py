"""The target run over a per-row static KV cache: many sequences at once, each at its own position.

HF's ``generate`` pads a batch to one length and keeps every row until the longest one ends; with
answers from 5 to 1,024 tokens most of the GPU then decodes padding. Here each row ("slot") of one
preallocated cache holds one sequence, indexed by absolute position, so rows advance by different
amounts (one decode token, a k+1-token verify) and a finished row takes a new prompt while the others
keep going. Writes go to explicit positions and reads are masked by position, so whatever a row left
beyond its current length (a rejected draft, a finished answer) is never read: it is overwritten first.

The cache layouts are ``engine.kv_cache``'s, the attention over them ``engine.attention``'s, and the layer pieces
compiled around it ``engine.layer_pieces``'s.

Only the attention over the cache is ours. Norms, projections, rotary table and MLP are the model's own
modules, so the numbers are the model's, up to the summation order of the attention kernel.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from common.compile_guard import CompileSwitch, is_recompile_limit
from engine.attention import (
    ATTENTIONS,
    default_attention,
    flex_decode,
    flex_kind,
    position_mask,
    position_masked_attention,
)
from engine.kv_cache import KVCache, PagedKVCache
from engine.layer_pieces import LayerPieces
from target_model.hf_model import RIGHT_PADDED_SDPA

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


@dataclass
class BatchedOutput:
    logits: Tensor | None  # (B, V) at ``logits_at`` or (B, T, V) for every position
    aux: Tensor | None  # (B, T, 3H): outputs of the aux layers, in id order


class BatchedTarget:
    """A loaded HF causal LM (one of ``SUPPORTED_MODEL_TYPES``) driven slot by slot.

    On CUDA a layer's work around its attention runs compiled (dynamic shapes, shared by every layer and every batch
    shape after a graph or two): a decode step's as two pieces (``attention_inputs``, ``after_attention``) around its
    flex kernel, inside the step's CUDA graph; a prefill's as one call a layer, its attention included, that also
    makes the next layer's queries, keys and values (``fresh_layer``, ``suffix_layer``), with the cache writes between
    calls. Why: HF's eager layer is some 35 small kernels, and a small model's prefill forward spends longer on the
    host launching them than the GPU spends running them; three compiled calls a layer still pay each call's fixed
    host overhead, so one call does the work of three (``"prefill_step"`` measures it). A compile that fails turns
    them off for the process (``compile_guard.CompileSwitch``)."""

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
        self.pieces = CompileSwitch("the batched target's compiled layer pieces")
        self.layer_pieces = LayerPieces(self.heads, self.kv_heads, self.head_dim, self.apply_rope, self.scaling)
        self._compiled: dict[str, Callable[..., Any]] = {}

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def _piece(self, name: str, *args: Any) -> Any:
        """``LayerPieces`` method ``name`` on ``args``, compiled on CUDA while ``pieces`` is on."""
        fn = getattr(self.layer_pieces, name)
        if self.device.type != "cuda":
            return fn(*args)
        compiled = self._compiled.get(name)
        if compiled is None:
            compiled = self._compiled[name] = torch.compile(fn, dynamic=True)
        return self.pieces.run(lambda: compiled(*args), lambda: fn(*args))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def kv_bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * self.dtype.itemsize

    def new_cache(self, slots: int, max_len: int) -> KVCache:
        shape = (len(self.layers), slots, self.kv_heads, max_len, self.head_dim)
        return KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                       torch.zeros(shape, dtype=self.dtype, device=self.device))

    def new_paged_cache(self, rows: int, pages: int, max_len: int, attention: str | None = None) -> PagedKVCache:
        """A paged cache attended by ``attention`` (one of ``ATTENTIONS``; default ``default_attention``)."""
        if attention is not None and attention not in ATTENTIONS:
            raise ValueError(f"paged attention {attention!r}: use one of {list(ATTENTIONS)}")
        return PagedKVCache(len(self.layers), self.kv_heads, self.head_dim, rows, pages, max_len, self.dtype,
                            self.device, attention or default_attention(self.device))

    @torch.no_grad()
    def forward(self, cache: KVCache | PagedKVCache, rows: Tensor | slice, ids: Tensor, positions: Tensor, *,
                fresh: bool, logits_at: Tensor | None = None, all_logits: bool = False,
                aux: bool = False, lengths: Tensor | None = None) -> BatchedOutput:
        """Run ``ids`` (B, T) at ``positions`` (B, T) for cache ``rows`` and write their keys and values.

        fresh: every row starts at position 0 (a prompt's prefill, right-padded): attention is causal over
        these tokens alone. Otherwise each query sees the cached keys at positions <= its own; ``rows`` must
        be a slice, except over a paged cache (tables are read by row index, so any rows: a prompt's suffix
        prefilled after the prefix its row already holds). logits_at (B,): the one position per row whose
        logits are wanted; all_logits: every position's. aux: also return the aux layers' outputs. lengths
        (B,): each row's real tokens (the rest right padding, whose keys, values and outputs nobody reads): a suffix
        prefill over flex skips the query blocks of padding only.
        """
        kind = flex_kind(cache, rows, ids, fresh)
        if kind is not None and isinstance(cache, PagedKVCache):
            try:
                out = self._forward(cache, rows, ids, positions, fresh=fresh, logits_at=logits_at,
                                    all_logits=all_logits, aux=aux, lengths=lengths)
                cache.flex_ran.add(kind)
                return out
            except Exception as e:  # noqa: BLE001 (a kernel that does not build must not stop a regeneration)
                # A kernel that ran may still meet dynamo's recompile limit on a new suffix shape; the decode
                # step's few padded shapes cannot, and its CUDA graphs hold the kernel already.
                if kind in cache.flex_ran and not (kind == "suffix" and is_recompile_limit(e)):
                    raise
                cache.fall_back(kind, e)  # rewriting this forward's keys is harmless
        return self._forward(cache, rows, ids, positions, fresh=fresh, logits_at=logits_at, all_logits=all_logits,
                             aux=aux, lengths=lengths)

    def _forward(self, cache: KVCache | PagedKVCache, rows: Tensor | slice, ids: Tensor, positions: Tensor, *,
                 fresh: bool, logits_at: Tensor | None, all_logits: bool, aux: bool,
                 lengths: Tensor | None) -> BatchedOutput:
        b, t = ids.shape
        paged = isinstance(cache, PagedKVCache)
        if not fresh and not paged and not isinstance(rows, slice):
            raise TypeError("a cached (non-fresh) step takes a slice of rows, so the cache is read in place")
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        groups = self.heads // self.kv_heads
        batch_index = torch.arange(b, device=ids.device)[:, None]
        kind = flex_kind(cache, rows, ids, fresh)
        span = mask = gather = block_mask = None
        if paged:
            cache.flush()
            where = cache.addresses(rows, positions).reshape(-1)  # (B*T,) along the pooled axis
        if kind == "decode":
            assert isinstance(cache, PagedKVCache) and isinstance(rows, slice)
            if rows.start not in (None, 0):
                raise ValueError("flex attention over pages decodes rows [0, B) (the block mask's batch index)")
            cache.query_pos[:b] = positions[:, 0]
            block_mask = cache.block_mask(b, groups)
        elif kind == "suffix":
            assert isinstance(cache, PagedKVCache)
            index = rows if isinstance(rows, Tensor) else torch.arange(cache.rows, device=ids.device)[rows]
            block_mask = cache.suffix_block_mask(index.to(torch.int32), positions, lengths)
        elif not fresh:
            # Keys read per row: up to the furthest position in the batch, rounded up (aligned key blocks).
            span = min(cache.max_len, -(-(int(positions.max()) + 1) // 64) * 64)
            mask = position_mask(positions, span, groups)  # one for all layers
            if paged:  # each row's first pages, in order: whole pages are copied (memcpy-sized pieces)
                gather = cache.page_table[rows][:, : -(-span // cache.page)].reshape(-1).long()
        keep: dict[int, Tensor] = {}
        layers = len(self.layers)
        qkv: tuple[Tensor, Tensor, Tensor] | None = None  # this layer's, when the previous layer's call made them
        # A fresh prefill's SDPA without cuDNN: it builds a plan per new shape, 50-100 ms each (``"prefill_step"``).
        with sdpa_kernel(list(RIGHT_PADDED_SDPA)) if fresh and kind is None else nullcontext():
            for i, layer in enumerate(self.layers):
                q, k, v = qkv if qkv is not None else self._piece("inputs", layer, h, cos, sin)
                if paged:  # (kv, B*T, d) into the pool
                    cache.k[i].index_copy_(1, where, k.transpose(0, 1).reshape(self.kv_heads, b * t, self.head_dim))
                    cache.v[i].index_copy_(1, where, v.transpose(0, 1).reshape(self.kv_heads, b * t, self.head_dim))
                elif fresh:
                    cache.k[i, rows, :, :t] = k
                    cache.v[i, rows, :, :t] = v
                if fresh or kind == "suffix":
                    # One call for the rest of this layer and the next one's inputs. The last layer's makes layer
                    # 0's and drops them (~1 % of a forward): one graph serves every layer, where a last layer of
                    # its own would be a second compile.
                    nxt = self.layers[(i + 1) % layers]
                    if kind != "suffix":
                        h, qkv = self._piece("fresh", layer, nxt, h, q, k, v, cos, sin)
                    else:
                        h, qkv = self._piece("suffix", layer, nxt, h, q, cache.k[i], cache.v[i], block_mask, cos, sin)
                else:
                    if kind == "decode":  # the query heads sharing a kv head folded into the query axis, as below
                        o = flex_decode(q.reshape(b, self.kv_heads, groups, self.head_dim), cache.k[i], cache.v[i],
                                        block_mask, self.scaling).reshape(b, self.heads, 1, self.head_dim)
                    elif paged:
                        layer_k = cache.rows_rectangle(cache.k[i], gather, b)
                        layer_v = cache.rows_rectangle(cache.v[i], gather, b)
                        o = position_masked_attention(q, layer_k[:, :, :span], layer_v[:, :, :span], mask,
                                                      self.scaling)
                    else:
                        layer_k, layer_v = cache.k[i, rows], cache.v[i, rows]  # views (rows is a slice)
                        layer_k[batch_index, :, positions] = k.transpose(1, 2)
                        layer_v[batch_index, :, positions] = v.transpose(1, 2)
                        o = position_masked_attention(q, layer_k[:, :, :span], layer_v[:, :, :span], mask,
                                                      self.scaling)
                    h = self._piece("after", layer, h, o)
                if aux and i in self.aux_layer_ids:
                    keep[i] = h
        logits = None
        if logits_at is not None:
            logits = self.lm_head(self.final_norm(h[torch.arange(b, device=h.device), logits_at]))
        elif all_logits:
            logits = self.lm_head(self.final_norm(h))
        return BatchedOutput(logits, torch.cat([keep[i] for i in self.aux_layer_ids], -1) if aux else None)

"""The attention of a forward over the cache.

A ``KVCache`` is read in place by position-masked attention. Over pages a forward attends in one of two ways:
"flex" (CUDA's default) runs flex attention over a block mask built from each row's length and page table, so a row
reads its own pages and no more; "gather" (elsewhere) copies each row's pages into a rectangle and runs the same
position-masked attention as ``KVCache`` (the reference math). Flex has two kernels: the decode step (one token for
rows [0, B), its query heads folded onto their kv head), and a prompt's suffix prefilled after the prefix its row
already holds (a conversation's next turn continuing in its row: several tokens per row, any rows): under gather its
rectangles are copied and its scores materialised for every suffix, and in a multi-turn regeneration those copies,
not the model, are most of the prefill time.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from common.compile_guard import no_float_symbols, no_uncompiled_fallback
from engine.kv_cache import FLEX_Q_BLOCK, KVCache, PagedKVCache

# Compiles of the decode step's flex kernel a process may make: one per padded batch size and pool, so a process
# that builds several streams (an eval's references, a module of CUDA tests) adds up to four each, and dynamo's
# default limit of 8 sent the third stream's decode to gather. Called only eagerly and at CUDA graph captures.
DECODE_COMPILES = 64


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


_compiled_flex: Callable[..., Tensor] | None = None
_compiled_suffix: Callable[..., Tensor] | None = None


def _decode_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float) -> Tensor:
    """The decode step's flex call, a function of its own: dynamo keeps compiled graphs (and counts them against
    its recompile limit) per code object, so compiling ``flex_attention`` itself for both kernels made the
    decode step's batch sizes and the suffixes' shapes share one limit of 8, past which dynamo ran flex
    uncompiled: a dense (B, heads, T, pool) score matrix, out of memory on a GPU's pool."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=scale)


def _suffix_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float, enable_gqa: bool) -> Tensor:
    """The suffix prefill's flex call, its own code object (see ``_decode_attention``). Dynamic shapes keep it
    to one graph for every suffix the engine pads (``prefill_shape``)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)


def prefill_shape(rows: int, width: int) -> tuple[int, int]:
    """The (rows, width) a prefill is padded to on CUDA: at least 2 rows and more than one query block. Dynamo
    specialises sizes 0 and 1, so unpadded suffixes fall into 6 shape classes, 6 compiles of several seconds
    each (a B=1 or T=1 or one-block suffix each its own); padded they share one graph, and so do a fresh prefill's
    compiled layers."""
    return max(rows, 2), max(width, FLEX_Q_BLOCK + 1)


def compile_flex_decode(mode: str | None = None) -> None:
    """(Re)build the decode step's compiled flex kernel, in torch.compile's ``mode`` (default: its defaults; a
    benchmark tries ``max-autotune-no-cudagraphs``)."""
    global _compiled_flex
    _compiled_flex = torch.compile(_decode_attention, dynamic=False, mode=mode)


def flex_decode(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float) -> Tensor:
    """Compiled flex attention of q (B, kv, G, d) over the pooled k, v (kv, S, d). Static shapes: the engine
    pads its batch to a few sizes (``sizing.decode_rows``), one compile each."""
    if _compiled_flex is None:
        compile_flex_decode()
    assert _compiled_flex is not None
    with no_uncompiled_fallback(), torch._dynamo.config.patch(recompile_limit=DECODE_COMPILES):
        return _compiled_flex(q, k[None], v[None], block_mask=block_mask, scale=scale)


def flex_suffix(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float) -> Tensor:
    """Flex attention of suffix queries q (B, heads, T, d) over the pooled k, v (kv, S, d), grouped query heads
    by flex itself. Called eagerly on CUDA it runs its own kernel, compiled with dynamic shapes
    (``_suffix_attention``); traced inside a compiled layer (``suffix_layer``) it is part of that graph. On a CPU
    uncompiled: inductor's CPU template fails to build this kernel with dynamic shapes (torch 2.13: a C++ compile
    error), and the mask is exact for every key, so the eager kernel gives the same answer (CPU tests check the
    mask and tables)."""
    global _compiled_suffix
    gqa = q.shape[1] != k.shape[0]
    if not q.is_cuda or torch.compiler.is_compiling():
        return _suffix_attention(q, k[None], v[None], block_mask, scale, gqa)
    if _compiled_suffix is None:
        _compiled_suffix = torch.compile(_suffix_attention, dynamic=True)
    with no_uncompiled_fallback(), no_float_symbols():
        return _compiled_suffix(q, k[None], v[None], block_mask, scale, gqa)


def flex_kind(cache: KVCache | PagedKVCache, rows: Tensor | slice, ids: Tensor, fresh: bool) -> str | None:
    """Which flex kernel a forward runs over a paged cache under flex: "decode" (one token for rows [0, B)),
    "suffix" (tokens after each row's cached prefix, any rows; unless that kernel failed to build), or None
    (anything under gather, or once the suffix kernel fell back: then a fresh prefill is causal over its own
    tokens by SDPA).

    A fresh prefill is a suffix after an empty prefix: its keys go to the pool first as a continuation's do, and
    the suffix mask keeps it causal. Why not SDPA over its own tokens: that is a second compiled graph a layer
    (``fresh_layer``), and on a fresh machine the prefill graphs' compiles are much of the engine's first minute;
    the suffix graph alone serves both."""
    if not isinstance(cache, PagedKVCache) or cache.attention != "flex":
        return None
    if ids.shape[1] == 1 and isinstance(rows, slice) and not fresh:
        return "decode"
    return "suffix" if cache.suffix_kernel == "flex" else None


ATTENTIONS = ("flex", "gather")


def default_attention(device: torch.device) -> str:
    """The paged cache's attention unless the caller picks one: flex on CUDA, gather (the reference math)
    elsewhere, where flex's kernels are slow to compile."""
    return "flex" if device.type == "cuda" else "gather"

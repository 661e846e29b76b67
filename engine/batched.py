"""The target run over a per-row static KV cache: many sequences at once, each at its own position.

HF's ``generate`` pads a batch to one length and keeps every row until the longest one ends; with
answers from 5 to 1,024 tokens most of the GPU then decodes padding. Here each row ("slot") of one
preallocated cache holds one sequence, indexed by absolute position, so rows advance by different
amounts (one decode token, a k+1-token verify) and a finished row takes a new prompt while the others
keep going. Writes go to explicit positions and reads are masked by position, so whatever a row left
beyond its current length (a rejected draft, a finished answer) is never read: it is overwritten first.

Two cache layouts. ``KVCache`` gives every row ``max_len`` positions (the speculative eval: a few hundred rows
of known length). ``PagedKVCache`` (regeneration's stream) holds pages of ``PAGE`` positions shared by all
rows, a row owning the pages of the positions it has used, so the rows in flight are bounded by the tokens
in flight, not by rows x the longest possible row. Over pages a forward attends in one of two ways:
"flex" (CUDA's default) runs flex attention over a block mask built from each row's length and page table,
so a row reads its own pages and no more; "gather" (elsewhere) copies each row's pages into a rectangle and
runs the same position-masked attention as ``KVCache`` (the reference math). Flex has two kernels: the decode
step (one token for rows [0, B), its query heads folded onto their kv head), and a prompt's suffix prefilled
after the prefix its row already holds (a conversation's next turn continuing in its row: several tokens per
row, any rows): under gather its rectangles are copied and its scores materialised for every suffix, and in a
multi-turn regeneration those copies, not the model, are most of the prefill time.

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
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel

from common.cli import exception_line
from common.compile_guard import CompileSwitch, is_recompile_limit, no_float_symbols, no_uncompiled_fallback
from common.queued_copy import queued_to_device
from target_model.hf_model import RIGHT_PADDED_SDPA

# Decoder layers shaped residual -> input_layernorm -> attention -> residual -> post_attention_layernorm
# -> mlp, with q/k/v/o projections and a rotary table on the model (optionally per-head q/k norms).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
FLEX_Q_BLOCK = 128  # flex attention's query block (a suffix's queries, in blocks of this many)
PAGE = 128  # positions per page of a PagedKVCache: flex attention's key block, so a row reads whole pages of its own
# Compiles of the decode step's flex kernel a process may make: one per padded batch size and pool, so a process
# that builds several streams (an eval's references, a module of CUDA tests) adds up to four each, and dynamo's
# default limit of 8 sent the third stream's decode to gather. Called only eagerly and at CUDA graph captures.
DECODE_COMPILES = 64


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


class PagedKVCache:
    """Keys and values in pages of ``page`` positions shared by ``rows`` rows.

    k, v: (layers, kv_heads, pages * page, head_dim). Row r's position p lives at
    ``page_table[r, p // page] * page + p % page``. Page 0 is scratch: every table entry a row has not been
    given points there, so a free row, or a prefill's padding past a row's pages, writes there, and no live
    row reads it (``owner`` says whose a page is; the attention masks by it). The table has a column past the
    ``max_pages`` a row may hold, always scratch's: a row that used all ``max_len`` positions moves to position
    ``max_len`` in the step launched before its end was read, and steps that run it while it waits for its
    follow-up write there (``Stream.step``). Which pages a row holds is kept
    on the host, so the engine allocates without waiting on the device; ``flush`` copies the rows that
    changed to the device tables (``forward`` calls it)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, rows: int, pages: int, max_len: int,
                 dtype: torch.dtype, device: torch.device, attention: str, page: int = PAGE):
        if pages < 2:
            raise ValueError("a paged cache needs the scratch page and at least one more")
        self.page, self.max_pages, self.attention = page, -(-max_len // page), attention
        shape = (layers, kv_heads, pages * page, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_table = torch.zeros(rows, self.max_pages + 1, dtype=torch.int32, device=device)
        self.owner = torch.full((pages,), -1, dtype=torch.int32, device=device)  # the row holding each page
        self.logical = torch.zeros(pages, dtype=torch.int32, device=device)  # its index in that row's table
        self.query_pos = torch.zeros(rows, dtype=torch.long, device=device)  # a decode step's positions (flex)
        self.row_pages: list[list[int]] = [[] for _ in range(rows)]
        self.free: list[int] = list(range(pages - 1, 0, -1))  # a stack; page 0 is scratch
        self._dirty: set[int] = set()
        self._freed: list[int] = []
        self.suffix_rows = torch.zeros(rows, dtype=torch.int32, device=device)  # a suffix prefill's rows, in order
        self.suffix_start = torch.zeros(rows, dtype=torch.long, device=device)  # and the position each suffix starts at
        self.mask_mod, self.suffix_mask_mod = self._mask_mod(), self._suffix_mask_mod()
        # The flex kernels ("decode", "suffix") that have run once: until then a failure falls back to gather
        # (``fall_back``). Suffix prefills under flex: "flex", or "gather (flex failed: ...)" once that kernel
        # failed to build (the decode step keeps flex).
        self.flex_ran: set[str] = set()
        self.suffix_attention = "flex"
        self.full_blocks = True  # a decode step's pages before the query's skip the mask (``block_mask``)

    @property
    def rows(self) -> int:
        return self.page_table.shape[0]

    @property
    def pages(self) -> int:
        return self.owner.shape[0]

    @property
    def max_len(self) -> int:
        return self.max_pages * self.page

    @property
    def suffix_kernel(self) -> str:
        """What a suffix prefill attends with: "flex", or the decode step's gather (chosen, or its fallback),
        or the suffix kernel's own fallback."""
        return self.suffix_attention if self.attention == "flex" else self.attention

    def fall_back(self, kind: str, e: BaseException) -> None:
        """Flex kernel ``kind`` failed on its first forward (this torch has no such kernel, or it did not
        compile), or the suffix kernel met dynamo's recompile limit: gather instead, for the rest of this
        cache's life, said once on stderr."""
        line = f"gather (flex failed: {exception_line(e)})"
        if kind == "decode":
            self.attention = line
        else:
            self.suffix_attention = line
        print(f"warning: paged attention{'' if kind == 'decode' else ' of suffixes'} falls back to {line}",
              file=sys.stderr)

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.page)

    def ensure(self, row: int, positions: int) -> bool:
        """Give ``row`` the pages for positions [0, positions); False (nothing taken) when too few are free."""
        held = self.row_pages[row]
        need = self.pages_for(positions) - len(held)
        if need <= 0:
            return True
        if need > len(self.free) or len(held) + need > self.max_pages:
            return False
        held += [self.free.pop() for _ in range(need)]
        self._dirty.add(row)
        return True

    def release(self, row: int) -> None:
        """Return ``row``'s pages; its table points at scratch again."""
        self.truncate(row, 0)

    def truncate(self, row: int, positions: int) -> None:
        """Keep the pages of ``row``'s positions [0, positions) and return the rest (a row continuing with a
        shorter common prefix than it holds: what it held past the prefix is of no use to it)."""
        keep = self.pages_for(positions)
        dropped = self.row_pages[row][keep:]
        if not dropped:
            return
        self._freed += dropped
        self.free += reversed(dropped)
        del self.row_pages[row][keep:]
        self._dirty.add(row)

    def move_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Row ``src[i]``'s pages become row ``dst[i]``'s (no key moves: only the tables change)."""
        moved = [self.row_pages[s] for s in src]
        for s in src:
            self.row_pages[s] = []
        for d, held in zip(dst, moved, strict=True):
            self.row_pages[d] = held
        self._dirty.update(src)
        self._dirty.update(dst)

    def grow(self, pages: int) -> None:
        """``pages`` more pages (a CPU pool grows as it fills; a GPU's is sized once from free memory)."""
        layers, kv, _, d = self.k.shape
        extra = torch.zeros((layers, kv, pages * self.page, d), dtype=self.k.dtype, device=self.k.device)
        self.k, self.v = torch.cat([self.k, extra], 2), torch.cat([self.v, extra], 2)
        start = self.pages
        self.owner = torch.cat([self.owner, self.owner.new_full((pages,), -1)])
        self.logical = torch.cat([self.logical, self.logical.new_zeros(pages)])
        self.free[:0] = range(start + pages - 1, start - 1, -1)  # under the stack: the old pages go first
        self.mask_mod, self.suffix_mask_mod = self._mask_mod(), self._suffix_mask_mod()

    def flush(self) -> None:
        """Copy the page lists that changed to the device tables, queued behind the device's work
        (``common.queued_copy``)."""
        if not (self._dirty or self._freed):
            return
        if self.page_table.is_cuda and torch.cuda.is_current_stream_capturing():
            # Pageable host-to-device copies cannot be captured: a CUDA graph's owner flushes before capturing
            # (engine.decode_graphs), so a capture that gets here is a bug, named rather than a corrupt graph.
            raise RuntimeError("PagedKVCache.flush inside a CUDA graph capture: flush before capturing")
        dev = self.page_table.device
        if self._freed:
            # a scalar fill: an indexed assignment of -1 copied that value from the host, with a wait
            self.owner.index_fill_(0, queued_to_device(torch.tensor(self._freed), dev), -1)
            self._freed = []
        rows = sorted(self._dirty)
        self._dirty = set()
        table = torch.zeros(len(rows), self.page_table.shape[1], dtype=torch.int32)
        held, owners, logical = [], [], []
        for i, r in enumerate(rows):
            table[i, : len(self.row_pages[r])] = torch.tensor(self.row_pages[r], dtype=torch.int32)
            held += self.row_pages[r]
            owners += [r] * len(self.row_pages[r])
            logical += range(len(self.row_pages[r]))
        self.page_table[queued_to_device(torch.tensor(rows), dev)] = queued_to_device(table, dev)
        if held:
            index = queued_to_device(torch.tensor(held), dev)
            self.owner[index] = queued_to_device(torch.tensor(owners, dtype=torch.int32), dev)
            self.logical[index] = queued_to_device(torch.tensor(logical, dtype=torch.int32), dev)

    def addresses(self, rows: Tensor | slice, positions: Tensor) -> Tensor:
        """Where (B, T) ``positions`` (at most ``max_len``: scratch's) of ``rows`` live along the pooled position
        axis."""
        pages = self.page_table[rows].gather(1, torch.div(positions, self.page, rounding_mode="floor"))
        return pages.long() * self.page + positions % self.page

    def rows_rectangle(self, pool: Tensor, pages: Tensor, b: int) -> Tensor:
        """One layer's pooled (kv, positions, d) keys or values of ``b`` rows, the (b * n) pages ``pages`` lists
        (each row's first n, in order), as a (b, kv, n * page, d) rectangle."""
        kv, _, d = pool.shape
        picked = pool.view(kv, -1, self.page, d).index_select(1, pages)  # (kv, b * n, page, d)
        return picked.view(kv, b, -1, d).transpose(0, 1)

    def _mask_mod(self) -> Callable[..., Tensor]:
        """Key ``kv_idx`` (pooled) is visible to row b's query iff b owns its page and its position in the
        row is at most the query's. Exact for any key, so a kernel that ignores the block mask's sparsity
        (eager flex attention) gives the same answer; the block mask only saves the reads."""
        owner, logical, query_pos, page = self.owner, self.logical, self.query_pos, self.page

        def visible(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            p = kv_idx // page
            return (owner[p] == b) & (logical[p] * page + kv_idx % page <= query_pos[b])

        return visible

    def _suffix_mask_mod(self) -> Callable[..., Tensor]:
        """A suffix prefill's: query ``q_idx`` of batch row b sits at ``suffix_start[b] + q_idx`` of cache row
        ``suffix_rows[b]`` and sees that row's keys at positions up to its own (exact for any key, as above;
        a padding query past its row's prompt sees more, and its output is never read)."""
        owner, logical, rows, start, page = self.owner, self.logical, self.suffix_rows, self.suffix_start, self.page

        def visible(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            p = kv_idx // page
            return (owner[p] == rows[b]) & (logical[p] * page + kv_idx % page <= start[b] + q_idx)

        return visible

    def suffix_block_mask(self, rows: Tensor, positions: Tensor, lengths: Tensor | None = None) -> Any:
        """Flex attention's block mask for suffixes of ``rows`` at ``positions`` (B, T): each query block reads its
        row's pages (the table's nonzero entries, in position order: page 0 is scratch) up to the one holding its
        last query's position. The pages wholly at or before its first query's position are full blocks (every key
        visible to every query: the kernel skips the mask there, as a decode step's pages before its own); the rest,
        masked, keep it causal. A block's later pages hold only keys after all its queries: a fresh prefill (an empty
        prefix) would read twice the keys it can see. ``lengths`` (B,): each row's real tokens, the rest padding
        whose keys, values and outputs nobody reads: a query block of padding only reads nothing (a suffix padded to
        ``prefill_shape``'s width of one block and one more is two blocks, the second all padding for a suffix of
        one block; ``"prefill_step"``: the attention was three quarters of a continuation's kernels)."""
        from torch.nn.attention.flex_attention import BlockMask

        b, t = positions.shape
        self.suffix_rows[:b] = rows
        self.suffix_start[:b] = positions[:, 0]
        table = self.page_table[rows]
        held = (table != 0).sum(1, dtype=torch.int32)
        table = self._kv_columns(table)
        q_blocks = -(-t // FLEX_Q_BLOCK)
        first = positions[:, :1] + torch.arange(q_blocks, device=positions.device) * FLEX_Q_BLOCK  # (B, q_blocks)
        reach = torch.div(first + FLEX_Q_BLOCK - 1, self.page, rounding_mode="floor") + 1  # pages up to its last query
        seen = torch.minimum(held[:, None], reach)
        full = torch.minimum(torch.div(first + 1, self.page, rounding_mode="floor"), seen)  # pages ending <= first
        if lengths is not None:
            real = torch.arange(q_blocks, device=positions.device) * FLEX_Q_BLOCK < lengths[:, None]
            seen, full = seen * real, full * real
        cols = table.shape[1]
        after_full = (full[..., None] + torch.arange(cols, device=table.device)).clamp_(max=cols - 1)
        partial = table[:, None, :].expand(b, q_blocks, cols).gather(2, after_full.long())
        return BlockMask.from_kv_blocks((seen - full).to(torch.int32).view(b, 1, q_blocks),
                                        partial.view(b, 1, q_blocks, cols),
                                        full.to(torch.int32).view(b, 1, q_blocks),
                                        table.view(b, 1, 1, -1).expand(b, 1, q_blocks, -1).contiguous(),
                                        BLOCK_SIZE=(FLEX_Q_BLOCK, self.page), mask_mod=self.suffix_mask_mod,
                                        seq_lengths=(t, self.k.shape[2]), compute_q_blocks=False)

    def _kv_columns(self, table: Tensor) -> Tensor:
        """Page-table rows as a block mask's key block indices: as they are on CUDA; on a CPU one column per page of
        the pool, which inductor's CPU kernel wants (zeros added, or only zeros cut: no row holds more pages than the
        pool has besides scratch)."""
        if self.k.device.type == "cuda":
            return table
        if table.shape[1] >= self.pages:
            return table[:, : self.pages]
        return torch.cat([table, table.new_zeros(table.shape[0], self.pages - table.shape[1])], 1)

    def block_mask(self, b: int, q_len: int) -> Any:
        """Flex attention's block mask for a decode step of rows [0, b) at ``query_pos``: each row's pages up to
        its query's, in its table's order. The pages before the query's are full blocks (every key visible: the
        kernel skips the mask there), the query's own page the one partial block; with ``full_blocks`` off every
        page is partial (bench/decode_step.py A/Bs the two)."""
        from torch.nn.attention.flex_attention import BlockMask

        query_page = torch.div(self.query_pos[:b], self.page, rounding_mode="floor").to(torch.int32)
        table = self.page_table[:b]
        indices = self._kv_columns(table).reshape(b, 1, 1, -1)
        shape = {"BLOCK_SIZE": (FLEX_Q_BLOCK, self.page), "mask_mod": self.mask_mod,
                 "seq_lengths": (q_len, self.k.shape[2]), "compute_q_blocks": False}
        if not self.full_blocks:
            return BlockMask.from_kv_blocks((query_page + 1).view(b, 1, 1), indices, **shape)
        own = F.pad(table.gather(1, query_page[:, None].long()), (0, indices.shape[-1] - 1)).reshape(b, 1, 1, -1)
        return BlockMask.from_kv_blocks(torch.ones_like(query_page).view(b, 1, 1), own, query_page.view(b, 1, 1),
                                        indices, **shape)


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
    pads its batch to a few sizes (``continuous_batching.decode_rows``), one compile each."""
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


@dataclass
class BatchedOutput:
    logits: Tensor | None  # (B, V) at ``logits_at`` or (B, T, V) for every position
    aux: Tensor | None  # (B, T, 3H): outputs of the aux layers, in id order


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

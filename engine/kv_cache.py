"""Keys and values of the target's layers, indexed by position, in one of two layouts.

``KVCache`` gives every row ``max_len`` positions (the speculative eval: a few hundred rows of known length).
``PagedKVCache`` (regeneration's stream) holds pages of ``PAGE`` positions shared by all rows, a row owning the
pages of the positions it has used, so the rows in flight are bounded by the tokens in flight, not by rows x the
longest possible row. It also builds the block masks flex attention reads a row's pages with (``engine.attention``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from common.cli import exception_line
from common.queued_copy import queued_to_device

FLEX_Q_BLOCK = 128  # flex attention's query block (a suffix's queries, in blocks of this many)
PAGE = 128  # positions per page of a PagedKVCache: flex attention's key block, so a row reads whole pages of its own


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

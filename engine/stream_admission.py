"""``Stream``'s admission side (``engine.continuous_batching``): queued requests into free rows, continuations into
the rows they continue, prefills, pages and preemption.

Memory is pages of ``PAGE`` positions (``engine.kv_cache.PagedKVCache``): a row holds the pages of the
positions it has used, so how many rows run is bounded by the tokens in flight, not by rows x (longest prompt
+ budget). A GPU's pages come from its free memory once; a CPU's pool starts small and grows up to every
row at ``max_len``. A request is admitted only while pages stay free for the live rows to grow
(``GROWTH_RESERVE``); when a row needs a page and none is free, the request admitted last is preempted: its
pages are freed and it goes back to the head of the queue to start again, so its answer is still the greedy
one (``Stream.preempted`` counts them).

A mixin of ``Stream``: the state it reads and writes is the stream's, set up by ``Stream.__init__``.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any

import torch

from common.batching import length_batches
from common.queued_copy import queued_to_device, queued_to_host
from engine.attention import prefill_shape
from engine.host_tokens import Firsts
from engine.requests import Request
from engine.sampling import request_seed

# Padded prompt tokens per prefill call on a GPU (a CPU takes CPU_PREFILL_TOKENS); activations scale with it. Larger
# than the speculative eval's (eval.batched_speculative.SPECULATIVE_PREFILL_TOKENS): this prefill keeps the logits of
# each prompt's last position only, where that one keeps the aux states of every position and runs the drafter on them.
GENERATE_PREFILL_TOKENS = 65536
CPU_PREFILL_TOKENS = 4096
GROWTH_RESERVE = 0.25  # pages per live row kept free when admitting (rows grow a page every PAGE tokens)
# Continuations (a suffix prefilled after a row's cached prefix) wait to be prefilled together, one forward for
# many, until they are a 1/CONTINUE_SHARE share of the live rows or have waited CONTINUE_WAIT polls (at once
# when few rows are live: in a run's tail a turn's wait is the run's). A forward costs about a decode step
# however few its tokens (kernel launches), and in a full batch several answers end every step.
CONTINUE_SHARE = 64
CONTINUE_WAIT = 8
# Under gather, the gathered keys and values of a group of continuations (rows x span, per layer), and their
# attention scores (rows x suffix x span x heads, fp32 where the kernel materialises them), each kept under this
# many bytes; flex reads the pages in place, and a group is bounded by its padded tokens as a fresh prefill is.
CONTINUE_BYTES = 1 << 30
CPU_CONTINUE_BYTES = 1 << 26


class StreamAdmission:
    """Requests into rows: admission under the pages' reserve, continuations and prefills, pages for the next
    step, and the preemption that frees them."""

    def _owed(self, row: int, r: Request) -> int:
        """Pages ``row`` may still take: its prompt and whole budget, less what it holds."""
        return self.cache.pages_for(len(r.prompt) + r.max_new_tokens) - len(self.cache.row_pages[row])

    def _room(self, pages: int) -> bool:
        """``pages`` free, growing a CPU pool when it must."""
        c = self.cache
        if len(c.free) >= pages:
            return True
        if c.pages >= self.most_pages:
            return False
        c.grow(min(self.most_pages - c.pages, max(pages - len(c.free), c.pages // 2)))
        return len(c.free) >= pages

    def _admissible(self, r: Request) -> bool:
        return self.cache.pages_for(len(r.prompt) + 1) <= self.most_pages - 1

    def _fits(self, row: int, r: Request, taken: int) -> bool:
        """Whether ``row`` may take the pages ``r``'s prompt and first answer token need beyond those it holds,
        while pages stay for the live rows (and ``taken`` rows admitted with it) to grow: a share per row, never
        more than they, and ``r`` after its first token, may still take."""
        held, first = len(self.cache.row_pages[row]), self.cache.pages_for(len(r.prompt) + 1)
        need = max(0, first - held)
        later = self.cache.pages_for(len(r.prompt) + r.max_new_tokens) - max(held, first)
        reserve = min(math.ceil(GROWTH_RESERVE * (self.live + taken + 1)), self.owed + later)
        if not self._room(need + reserve) and (self.live or taken):
            return False
        return self._room(need)

    def _admit(self) -> None:
        """Take queued requests into free rows while pages stay for the live rows to grow, then prefill them
        length-batched under the prefill token budget."""
        taken: list[tuple[int, Request, int]] = []
        while self.queue and self.free:
            r = self.queue[0]
            if not self._fits(self.free[0], r, len(taken)):  # the lowest free row holds no pages
                break
            row = heapq.heappop(self.free)
            self.cache.ensure(row, len(r.prompt) + 1)  # the prompt and the first answer token's position
            self.owed += self._owed(row, r)
            taken.append((row, self.queue.popleft(), 0))
        for group in length_batches([len(r.prompt) for _, r, _ in taken], self._prefill_tokens()):
            self._prefill([taken[i] for i in group])

    def _prefill_tokens(self) -> int:
        """Padded tokens per prefill forward (its activations scale with them)."""
        return GENERATE_PREFILL_TOKENS if self.t.device.type == "cuda" else CPU_PREFILL_TOKENS

    def _continue(self) -> None:
        """Prefill the continuations when due (``CONTINUE_SHARE``, ``CONTINUE_WAIT``): each row keeps the pages
        of its reused prefix and takes those its prompt needs; one that cannot have them while the live rows
        keep room to grow starts again from scratch at the head of the queue, its row freed (so a held row
        never waits on pages). Grouped by padded tokens under flex, and under gather so that the gathered keys and
        scores stay under ``CONTINUE_BYTES``."""
        for c in self.continuing:
            c.polls += 1
        due = self.continuing and (self.live == 0 or len(self.continuing) * CONTINUE_SHARE >= self.live
                                   or self.continuing[0].polls >= CONTINUE_WAIT)
        if not due:
            return
        taken: list[tuple[int, Request, int]] = []
        restart: list[Request] = []
        for c in self.continuing:
            self.cache.truncate(c.row, c.reuse)
            if self._fits(c.row, c.request, len(taken)):
                self.cache.ensure(c.row, len(c.request.prompt) + 1)
                self.owed += self._owed(c.row, c.request)
                taken.append((c.row, c.request, c.reuse))
            else:
                self._release_row(c.row)
                restart.append(c.request)
        self.continuing = []
        self.queue.extendleft(reversed(restart))
        widths = [len(r.prompt) - reuse for _, r, reuse in taken]
        if self.cache.suffix_kernel == "flex":
            groups = length_batches(widths, self._prefill_tokens())
        else:
            groups = self._continuation_groups(widths, [len(r.prompt) for _, r, _ in taken])
        for group in groups:
            self._prefill([taken[i] for i in group])

    def _continuation_groups(self, widths: list[int], spans: list[int]) -> list[list[int]]:
        """Under gather: continuations (suffix ``widths``, attending over ``spans`` positions each) cut into
        forwards, by span, so that rows x span keys and values per layer and rows x suffix x span scores stay
        under the byte budget (one over it is a forward of its own)."""
        t = self.t
        budget = CONTINUE_BYTES if t.device.type == "cuda" else CPU_CONTINUE_BYTES
        key_bytes = 2 * t.kv_heads * t.head_dim * t.dtype.itemsize  # one position's keys and values, one layer
        score_bytes = t.heads * 4
        groups: list[list[int]] = []
        widest = 0
        for i in sorted(range(len(spans)), key=spans.__getitem__):  # ascending: i has the longest span
            w = max(widest, widths[i])
            n = len(groups[-1]) + 1 if groups else 1
            if groups and n * spans[i] * key_bytes <= budget and n * w * spans[i] * score_bytes <= budget:
                groups[-1].append(i)
                widest = w
            else:
                groups.append([i])
                widest = widths[i]
        return groups

    def _prefill(self, group: list[tuple[int, Request, int]]) -> None:
        """Prefill (row, request, reused positions) entries: each prompt's tokens after the positions its row
        already holds, right-padded to the longest; all from position 0 is a fresh (causal) prefill, otherwise
        each suffix attends over its row's cached prefix. Padding writes only past every row's prompt (its
        positions stop at the furthest prompt end), where nothing is read before it is written again."""
        dev = self.t.device
        n = len(group)
        continued = any(reuse for _, _, reuse in group)
        padded, width = group, max(len(r.prompt) - reuse for _, r, reuse in group)
        if self.t.device.type == "cuda":  # one compiled shape class (``prefill_shape``)
            b, width = prefill_shape(n, width)
            padded = group + group[:1] * (b - n)  # a repeated row writes the same keys twice
        starts = [reuse for _, _, reuse in padded]
        lens = [len(r.prompt) - reuse for _, r, reuse in padded]
        ids = torch.zeros(len(padded), width, dtype=torch.long)
        for j, (_, r, reuse) in enumerate(padded):
            ids[j, : lens[j]] = torch.tensor(r.prompt[reuse:])
        end = max(len(r.prompt) for _, r, _ in group)
        # Inputs queued behind the decode step still on the device (a pageable copy would wait for it first).
        positions = queued_to_device((torch.tensor(starts)[:, None] + torch.arange(width)[None]).clamp_(max=end), dev)
        index = queued_to_device(torch.tensor([row for row, _, _ in padded]), dev)
        at = queued_to_device(torch.tensor(lens) - 1, dev)
        self._apply_row_flags()  # before this group's rows get theirs below
        t0 = time.perf_counter()
        out = self.t.forward(self.cache, index, queued_to_device(ids, dev), positions, fresh=not continued,
                             logits_at=at, lengths=at + 1)
        logits = out.logits[:n]
        index = index[:n]
        prompt_lens = queued_to_device(torch.tensor([len(r.prompt) for _, r, _ in group]), dev)
        if self.pick.greedy:
            first = self.pick(logits)
        else:  # the first answer token sits at the prompt's length
            self.seed[index] = queued_to_device(torch.tensor([request_seed(self.pick.s.seed, r.key)
                                                              for _, r, _ in group]), dev)
            first = self.pick(logits, self.seed[index], prompt_lens)
        self.pos[index] = prompt_lens
        self.last[index] = first
        self.alive.index_fill_(0, index, 1)
        margins = self._margin_tensor(logits)
        done: Any = None
        tokens, margins = queued_to_host(first), None if margins is None else queued_to_host(margins.reshape(n))
        if dev.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.firsts.append(Firsts([(row, r) for row, r, _ in group], tokens, margins, done, continued))
        if self.profile is not None:
            self.profile.times.prefill(time.perf_counter() - t0, continued=continued)
        starts, lens = starts[:n], lens[:n]
        self.prefill_forwards += 1
        self.continue_forwards += continued
        self.prefilled += sum(lens)
        self.reused += sum(starts)
        self.continued += sum(s > 0 for s in starts)
        for row, r, _ in group:
            self.request[row], self.tokens[row], self.margins[row] = r, [], []
            self.length[row] = len(r.prompt)
            self._order += 1
            self.admitted[row] = self._order
            self.live += 1
            self.top = max(self.top, row)

    def _take_firsts(self) -> None:
        """Take the pending prefills' first answer tokens into the rows that still serve the request they were
        prefilled for, waiting for each prefill's device work (its time is the prefill's); before any decode step's
        tokens of these rows, which all come later."""
        firsts, self.firsts = self.firsts, []
        for f in firsts:
            t0 = time.perf_counter()
            if f.done is not None:
                f.done.synchronize()
            if self.profile is not None:
                self.profile.times.prefill_wait(time.perf_counter() - t0, continued=f.continued)
            margins = f.margins.tolist() if f.margins is not None else [None] * len(f.rows)
            for (row, r), tok, m in zip(f.rows, f.tokens.tolist(), margins, strict=True):
                if self.request[row] is r:  # else preempted meanwhile: it starts again from scratch
                    self._take(row, tok, m)

    def _pages_for_step(self) -> None:
        """Give every row whose position after next starts a page that page (the step launched next writes at a
        live row's ``length`` or, when the step before it is still on its way, one further: ``step``), freeing
        held rows and then preempting the requests admitted last while none is free."""
        for row in self.needs_page:
            while self.request[row] is not None and not self.cache.ensure(row, self.length[row] + 2):
                if self._room(1) or self._drop_held():
                    continue
                live = [s for s, r in enumerate(self.request) if r is not None]
                self._preempt(max(live, key=self.admitted.__getitem__))
            if self.request[row] is not None:
                self.owed -= 1
        self.needs_page = []

    def _drop_held(self) -> bool:
        """Free one held row for its pages: a finished one nobody continued yet, else the continuation claimed
        last (which starts again from scratch at the head of the queue). False when none is held."""
        if self.parked:
            key = next(reversed(self.parked))
            self._release_row(self.parked.pop(key)[0])
            return True
        if self.continuing:
            c = self.continuing.pop()
            self._release_row(c.row)
            self.queue.appendleft(c.request)
            return True
        return False

    def _preempt(self, row: int) -> None:
        """Put ``row``'s request back at the head of the queue, to start again; free its row and pages."""
        r = self.request[row]
        assert r is not None
        self.queue.appendleft(r)
        self.preempted += 1
        self.discarded += len(self.tokens[row])
        self._unserve(row)
        self._release_row(row)

"""Continuous batching over ``BatchedTarget``: a stream of requests through one paged KV cache.

A request is a prompt (token ids, already chat-templated) and an answer budget. Every step decodes one token
for every live row; a row whose answer ends (a stop token, its budget, or with ``loops`` a degenerate loop at
its end) is freed at once and its answer handed back, and waiting requests are admitted into free rows,
prefilled in groups so a prefill is a real batch. Requests may be submitted while the stream runs:
regeneration submits a conversation's next turn as soon as its previous answer ends (``Stream.run``). At
T=0 each answer is what greedy ``model.generate`` gives for that prompt alone (up to its loop's first copy,
for an answer stopped at a loop): rows never see each other, and the only difference is the attention
kernel's summation order (tests compare them token for token).

Memory is pages of ``PAGE`` positions (``engine.kv_cache.PagedKVCache``): a row holds the pages of the
positions it has used, so how many rows run is bounded by the tokens in flight, not by rows x (longest prompt
+ budget). A GPU's pages come from its free memory once; a CPU's pool starts small and grows up to every
row at ``max_len``. A request is admitted only while pages stay free for the live rows to grow
(``GROWTH_RESERVE``); when a row needs a page and none is free, the request admitted last is preempted: its
pages are freed and it goes back to the head of the queue to start again, so its answer is still the greedy
one (``Stream.preempted`` counts them).

A conversation's next turn usually starts with exactly the tokens its previous turn's row holds (that prompt and
the answer generated), so it may continue in that row (``submit(..., continue_from=key)``): only the tokens after
the longest common prefix of the held ids and the new prompt are prefilled, at the positions that follow it.
The ids are compared, never assumed: the chat template re-renders the history, the answer's text tokenized
again need not give the generated ids, a loop-cut answer keeps fewer tokens than were generated, and the
end-of-turn marker that ended an answer was never written to the cache. A finished row is held for that only
until the next ``poll`` (the caller submits a follow-up between polls, as it reads the answers): one nobody
continued is freed then, so holding is bounded and nothing leaks. Keys and values depend only on the tokens
and positions before them, so a reused prefix is what a prefill would write, up to the kernels' summation order.

Decode steps run one ahead of the host: a step is launched (its tokens picked on the device into the next step's
input and copied to pinned host memory without a wait), and only then are the previous step's tokens read and
booked (``Stream.step``). The host's bookkeeping, and the caller's work between polls, overlap the device's next
step (on a GPU the host's work around a small step takes about as long as the step itself). A row that ends at
step k has run in step k + 1 too: that token is dropped, and its write lands past the positions the row holds
(pages are given one position ahead, so it always has one). A prefill's first tokens come the same way
(``Firsts``): its rows go live when it is launched, and its picks are taken into them when the next decode step
has been launched, before any of that step's tokens. A CPU runs each step as it is launched: the same code, no overlap.

On CUDA a flex decode step replays a CUDA graph of its padded batch size (``engine.decode_graphs``); ``Stream.stats``
counts those steps and the captures. Given an ``engine.profile.EngineProfile`` a stream also measures where its
seconds go (a benchmark's question; unprofiled, it keeps no timings and records no timing events).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from common.batching import length_batches
from common.compile_guard import compile_seconds
from common.queued_copy import queued_to_device, queued_to_host
from engine.attention import prefill_shape
from engine.batched import BatchedTarget
from engine.decode_graphs import DecodeGraphs
from engine.host_tokens import Firsts, HostTokens, Launched
from engine.kv_cache import PAGE
from engine.loops import LoopStop, loop_start, may_loop
from engine.profile import EngineProfile
from engine.requests import Continuation, Generated, Request
from engine.sampling import Picker, Sampling, request_seed
from engine.sizing import MAX_ROWS, decode_rows, plan_pages, plan_rows

# Padded prompt tokens per prefill call on a GPU (a CPU takes CPU_PREFILL_TOKENS); activations scale with it. Larger
# than the speculative eval's (eval.batched_speculative.SPECULATIVE_PREFILL_TOKENS): this prefill keeps the logits of
# each prompt's last position only, where that one keeps the aux states of every position and runs the drafter on them.
GENERATE_PREFILL_TOKENS = 65536
CPU_PREFILL_TOKENS = 4096
GROWTH_RESERVE = 0.25  # pages per live row kept free when admitting (rows grow a page every PAGE tokens)
DECODE_ROW_BUCKETS = 4  # flex decodes a batch padded to rows, rows/2, rows/4 or rows/8: one compile each
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
_UNMEASURED = nullcontext()  # an unprofiled stream's host phases (reentrant, shared)


class Stream:
    """Requests in, answers out as they finish, through ``rows`` rows over one paged cache.

    ``max_len``: the most positions one request may take (prompt + budget); ``rows``/``cpu_rows``: see
    ``plan_rows``; ``pages``: the pool's size (default ``plan_pages``); ``attention``: "flex" or "gather"
    (default: the device's, ``engine.attention.default_attention``); ``decode_graphs``: on CUDA, flex decode steps
    replay CUDA graphs (``engine.decode_graphs``; off: they run eagerly); ``profile``: where the run's seconds go
    is measured into it (``engine.profile``; None: nothing is measured).

    A row is free, live (serving a request), or held: finished and keeping its cache for a follow-up until the
    next poll (``parked``), or claimed by one and waiting for its suffix's prefill (``continuing``). A held row
    is never live: a step that runs it (below the last live row) writes only at its ``pos``, the position after
    what it holds, so what it holds stays intact."""

    def __init__(self, target: BatchedTarget, stop_ids: Sequence[int], sampling: Sampling = Sampling(), *,
                 max_len: int, rows: int | None = None, cpu_rows: int = 16, wanted: int = MAX_ROWS,
                 pages: int | None = None, margins: bool = False, loops: LoopStop | None = None,
                 attention: str | None = None, decode_graphs: bool = True, profile: EngineProfile | None = None):
        self.t, self.max_len, self.loops, self.want_margins = target, max_len, loops, margins
        dev = target.device
        self.rows = plan_rows(target, wanted, cpu_rows, rows)
        pool = pages or plan_pages(target, self.rows, max_len, PAGE)
        self.cache = target.new_paged_cache(self.rows, pool, max_len, attention)
        self.most_pages = pool if dev.type == "cuda" or pages else 1 + self.rows * self.cache.max_pages
        self.buckets = DECODE_ROW_BUCKETS if self.cache.attention == "flex" else 0
        self.pick = Picker(sampling)
        self.stop_ids = set(stop_ids)
        self.queue: deque[Request] = deque()
        n = self.rows
        self.request: list[Request | None] = [None] * n  # what each row serves
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.margins: list[list[float]] = [[] for _ in range(n)]
        self.length = [0] * n  # host copy of pos: the position a row's next token is written at (held: it holds)
        # The length at which a live row's next token needs more than an append (``_take``: a page opens, a loop
        # check falls due, the budget ends); a stop token always does. Most tokens are an append (``step``).
        self.due = [0] * n
        self.admitted = [0] * n  # admission order (the last admitted is preempted first)
        self.free = list(range(n))  # a heap: refill the lowest rows so live ones stay at the front
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.seed = torch.zeros(n, dtype=torch.long, device=dev)  # each row's request_seed (sampling only)
        self.last = torch.zeros(n, dtype=torch.long, device=dev)
        self.alive = torch.zeros(n, dtype=torch.long, device=dev)  # 1 for a row serving a request
        self.stopped_rows: list[int] = []  # rows whose alive flag goes to 0 before the next forward, and
        self.freed_rows: list[int] = []  # rows whose pos does (``_apply_row_flags``)
        # last and pos are updated in place, never rebound: a decode graph reads them where it was captured
        self.decode = DecodeGraphs(target, self.cache, self.last, self.pos, enabled=decode_graphs)
        self.host = HostTokens(n, dev, margins)
        self.launched: Launched | None = None  # the decode step whose tokens the next step reads
        self.firsts: list[Firsts] = []  # prefills whose first tokens the next step reads (``_take_firsts``)
        self.live = 0
        self.top = 0  # no live row above it (last_live walks down from it: rows go live only in _prefill)
        self.refill_at = max(1, n // 8)
        self.needs_page: list[int] = []  # rows whose position after next starts a page they do not hold
        self.owed = 0  # pages the live rows may still take (their whole budgets), for admission's reserve
        self.done: deque[tuple[Hashable, Generated]] = deque()
        self.parked: dict[Hashable, tuple[int, list[int]]] = {}  # key -> (row, the ids its cache holds)
        self.continuing: list[Continuation] = []
        self.produced = self.steps = self.preempted = self.discarded = self.prefilled = self._order = 0
        self.reused = self.continued = 0
        self.prefill_forwards = self.continue_forwards = 0  # of them, suffixes after a row's cached prefix
        self.profile = profile
        self.shapes: set[int] = set()  # padded batch sizes decoded so far (flex compiles one kernel each)
        self.started = time.perf_counter()

    @property
    def waiting(self) -> int:
        return len(self.queue)

    @property
    def free_rows(self) -> int:
        """Rows free for new requests at the next poll: the free ones and the finished ones nobody continued."""
        return len(self.free) + len(self.parked)

    def submit(self, key: Hashable, prompt: Sequence[int], max_new_tokens: int, continue_from: Hashable | None = None
               ) -> None:
        """Queue a request; its answer comes out of ``run`` under ``key``. ``continue_from``: the key of an
        answer handed out by the last poll whose row this request may continue in, prefilling only what follows
        the longest common prefix of that row's ids and ``prompt``; when that row is no longer held (its answer
        came out earlier, or it was never a request here) the request starts from scratch."""
        if not prompt or max_new_tokens < 1 or len(prompt) + max_new_tokens > self.max_len:
            raise ValueError(f"request {key!r}: prompt of {len(prompt)} tokens + {max_new_tokens} new does not fit a "
                             f"row of {self.max_len} positions (or is empty)")
        r = Request(key, prompt, max_new_tokens)
        if continue_from is not None and continue_from in self.parked:
            row, held = self.parked.pop(continue_from)
            # At least the prompt's last token is prefilled: its logits give the answer's first token.
            reuse = min(common_prefix(held, prompt), len(prompt) - 1)
            if reuse > 0:
                self.continuing.append(Continuation(row, r, reuse))
                return
            self._release_row(row)
        self.queue.append(r)

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.live or self.continuing or self.parked or self.launched or self.firsts)

    def run(self) -> Iterator[tuple[Hashable, Generated]]:
        """Step until nothing is queued, live or held, yielding (key, answer) as answers finish; requests
        submitted meanwhile join the run."""
        while self.busy:
            yield from self.poll()

    def poll(self) -> list[tuple[Hashable, Generated]]:
        """One round of work (free the finished rows nobody continued, prefill continuations when due, admit
        into free rows, one decode step); the answers that finished in it."""
        if self.profile is not None:
            self.profile.poll_start(self.started, self.produced)
        with self._host_phase("release"):
            for row, _ in self.parked.values():
                self._release_row(row)
            self.parked.clear()
        with self._host_phase("continue"):
            self._continue()
        if self.queue and (len(self.free) >= self.refill_at or self.live == 0):
            with self._host_phase("admit"):
                self._admit()
        if self.live == 0:
            self._read_launched()  # a step launched before its rows ended: nothing of it is kept
            if self.queue and not self._admissible(self.queue[0]):
                raise RuntimeError(f"the cache's {self.cache.pages} pages cannot hold one request of "
                                   f"{len(self.queue[0].prompt)} prompt tokens")
        else:
            if not self.queue and not self.continuing and 0 < self.live * 2 < self.last_live():
                self._read_launched()  # rows move: the launched step's tokens are read by the rows it ran
                with self._host_phase("compact"):
                    self.compact()
            self.step()
        done = list(self.done)
        self.done.clear()
        if self.profile is not None:
            self.profile.poll_end(self.started, self.produced, self.live)
        return done

    def _host_phase(self, phase: str) -> AbstractContextManager[None]:
        """The block's host seconds, measured as the engine's host phase ``phase`` when profiled."""
        return self.profile.phase(phase) if self.profile is not None else _UNMEASURED

    def stats(self) -> dict[str, Any]:
        """What the run did, for summaries and benchmarks: tokens (``prefill_tokens`` prefilled,
        ``reused_prefix_tokens`` taken from a row's cache instead, in ``continued`` requests), prefill forwards
        (``continue_forwards`` of them suffixes after a row's cached prefix), the decode steps
        replayed from CUDA graphs (``DecodeGraphs.stats``), whether the target's compiled layer pieces stayed
        compiled (a compile failure turns them off, said once), dynamo's compile seconds in this process by phase
        (``compile_s``: on a fresh machine the compiles are much of an engine's first minute) and, when profiled,
        where the seconds went (``EngineProfile.stats``)."""
        seconds = time.perf_counter() - self.started
        return {"rows": self.rows, "pages": self.cache.pages, "page_positions": self.cache.page,
                "attention": self.cache.attention, "suffix_attention": self.cache.suffix_kernel,
                "steps": self.steps, "decoded_tokens": self.produced,
                "prefill_tokens": self.prefilled, "reused_prefix_tokens": self.reused, "continued": self.continued,
                "prefill_forwards": self.prefill_forwards, "continue_forwards": self.continue_forwards,
                "preempted": self.preempted, "discarded_tokens": self.discarded, "seconds": round(seconds, 2),
                "compiled_pieces": self.t.pieces.state, "compile_s": compile_seconds(top=8),
                **self.decode.stats(), **(self.profile.stats(seconds) if self.profile is not None else {})}

    def tokens_per_s(self) -> float:
        return self.produced / max(time.perf_counter() - self.started, 1e-9)

    # admission and pages

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

    # decoding

    def _margin_tensor(self, logits: Tensor) -> Tensor | None:
        if not self.want_margins:
            return None
        top = logits.float().topk(2, dim=-1).values
        return top[..., 0] - top[..., 1]

    def _take(self, row: int, tok: int, margin: float | None = None) -> None:
        """Append one token to a row's answer; finish the row when the answer ends."""
        r = self.request[row]
        assert r is not None
        if margin is not None:
            self.margins[row].append(margin)
        if tok in self.stop_ids:
            self._finish(row, "stop", tok)
            return
        answer = self.tokens[row]
        answer.append(tok)
        n, lp = len(answer), self.loops
        if lp is not None and n >= lp.min_repeat_tokens and n % lp.every == 0:
            # Only the answer's last tokens can decide (LoopStop.window); a cut keeps the loop's first copy and
            # lp.keep tokens of its copies (a detected loop has at least min_repeat_tokens >= keep of them).
            # may_loop rules most answers out first, at about a seventh of the cost (host time on every live row).
            off = max(0, n - lp.window)
            start = (loop_start(answer[off:], lp.min_repeat_tokens, lp.max_period)
                     if may_loop(answer, lp.min_repeat_tokens, lp.max_period) else None)
            if start is not None:
                self._finish(row, "loop", generated=n, cut=off + start + lp.keep)
                return
        if n >= r.max_new_tokens:
            self._finish(row, "length")
            return
        if (self.length[row] + 1) % self.cache.page == 0:  # the token after next opens a page
            self.needs_page.append(row)
        self.due[row] = self._next_due(row, n, r.max_new_tokens)

    def _next_due(self, row: int, n: int, max_new_tokens: int) -> int:
        """The next length at which ``row``'s token needs ``_take`` (its answer has ``n`` tokens now): answer
        tokens and lengths grow together, one a step, so each event's length is known ahead."""
        length, page, lp = self.length[row], self.cache.page, self.loops
        ahead = n - length
        due = min(((length + 1) // page + 1) * page - 1, max_new_tokens - ahead)
        if lp is not None:
            check = -(-max(n + 1, lp.min_repeat_tokens) // lp.every) * lp.every
            due = min(due, check - ahead)
        return due

    def _finish(self, row: int, reason: str, stop_token: int | None = None, generated: int = 0,
                cut: int | None = None) -> None:
        """Hand the answer out (cut to ``cut`` tokens: a loop's) and hold the row until the next poll for a
        follow-up, with the ids of the positions it has written: the prompt and the answer as generated, up to
        its last token, which was never fed back (nor was a stop token)."""
        r = self.request[row]
        assert r is not None
        answer, margins = self.tokens[row], self.margins[row]
        if cut is not None:
            answer, margins = answer[:cut], margins[:cut]
        self.done.append((r.key, Generated(answer, reason, stop_token, margins, generated)))
        held = list(r.prompt) + self.tokens[row][: self.length[row] - len(r.prompt)]
        self._unserve(row)
        if r.key in self.parked:  # a key finished twice in one poll: only the last may be continued
            self._release_row(self.parked.pop(r.key)[0])
        self.parked[r.key] = (row, held)

    def _unserve(self, row: int) -> None:
        """``row`` stops serving its request (finished or preempted); its pages and ``pos`` stay, so a step that
        still runs it writes past what it holds."""
        r = self.request[row]
        assert r is not None
        self.owed -= self._owed(row, r)
        self.request[row], self.tokens[row], self.margins[row] = None, [], []
        self.stopped_rows.append(row)  # its alive flag goes to 0 before the next forward (``_apply_row_flags``)
        self.live -= 1

    def _release_row(self, row: int) -> None:
        """Free a row that serves nothing: its pages back to the pool, the row back to the free heap."""
        self.cache.release(row)
        self.length[row] = 0
        self.freed_rows.append(row)  # pos 0: a free row below the last live one still runs, writing to the scratch page
        heapq.heappush(self.free, row)

    def _apply_row_flags(self) -> None:
        """Zero the alive flags of the rows that stopped and the positions of the rows freed since the last forward,
        in two fills queued behind the device's work: written one element at a time from the host, each would wait
        for the device (the step launched one ahead). Runs before anything reads or writes the flags: a forward, a
        prefill's own flags, a compaction."""
        dev = self.t.device
        if self.stopped_rows:
            self.alive.index_fill_(0, queued_to_device(torch.tensor(self.stopped_rows), dev), 0)
            self.stopped_rows = []
        if self.freed_rows:
            self.pos.index_fill_(0, queued_to_device(torch.tensor(self.freed_rows), dev), 0)
            self.freed_rows = []

    def step(self) -> int:
        """Launch one decode token for every row up to the last live one, then read the tokens of the step
        launched before it (the host's bookkeeping of step k runs while the device computes step k + 1; at T = 0
        the answers are the same). A row that ends at step k has run in step k + 1 too: its token there is
        dropped, and it wrote past what it holds (only the positions it holds are ever reused; a row that held
        all ``max_len`` positions writes at ``max_len``, which the page table maps to scratch). Returns the
        tokens read."""
        with self._host_phase("pages"):
            self._pages_for_step()
        launched = self._launch() if self.live else None
        produced = self._read_launched()
        self.launched = launched
        return produced

    def _launch(self) -> Launched:
        """Issue the step's forward, the pick of its tokens into ``last`` (the next step's input, on the
        device) and their copy to the host, without waiting for any of it."""
        profiled = self.profile is not None
        if profiled:
            self.profile.first_step(self.started)
        hi = self.last_live() + 1
        b = decode_rows(hi, self.rows, self.buckets)
        cuda = self.t.device.type == "cuda"
        self._apply_row_flags()
        t0 = time.perf_counter()
        start: Any = None
        if cuda and profiled:  # the step's device seconds, measured by events around it
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        logits = self.decode.logits(b)  # a graph's own buffer on CUDA: read here, before the next step overwrites it
        nxt = self.pick(logits) if self.pick.greedy else self.pick(logits, self.seed[:b], self.pos[:b] + 1)
        margins = self._margin_tensor(logits[:hi])
        self.last[:b] = nxt
        self.pos[:b] += self.alive[:b]
        buffer = self.host.send(nxt[:hi], margins)
        done: Any = None
        if cuda:
            done = torch.cuda.Event(enable_timing=profiled)
            done.record()
        first_shape = self.buckets > 0 and b not in self.shapes
        self.shapes.add(b)
        return Launched(hi, self.live, self.request[:hi], buffer, time.perf_counter() - t0, first_shape, start,
                        done)

    def _read_launched(self) -> int:
        """Take the launched step's tokens into the rows that still serve what they served at its launch; the
        tokens taken."""
        self._take_firsts()
        step, self.launched = self.launched, None
        if step is None:
            return 0
        t0 = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        toks, margins = self.host.read(step.buffer, step.hi)
        if self.profile is not None:
            wait = time.perf_counter() - t0
            self.profile.times.step(step.live, step.launch_s, step.launch_s + wait, step.device_s(), step.first_shape)
        with self._host_phase("tokens"):
            produced = 0
            request, length, tokens, due, stops = self.request, self.length, self.tokens, self.due, self.stop_ids
            for row, (tok, m, launched) in enumerate(zip(toks, margins, step.requests, strict=True)):
                if launched is None or request[row] is not launched:
                    continue
                produced += 1
                length[row] += 1
                if m is None and length[row] < due[row] and tok not in stops:  # no event: what _take would do
                    tokens[row].append(tok)
                else:
                    self._take(row, tok, m)
            self.produced += produced
            self.steps += 1
        return produced

    def last_live(self) -> int:
        """The highest row serving a request (a step decodes every row up to it); with none, 0. Walks down from
        ``top`` (amortised O(1) a step, where a scan of every row cost ~1 ms per call at 4,096 rows)."""
        while self.top > 0 and self.request[self.top] is None:
            self.top -= 1
        return self.top

    def compact(self) -> None:
        """Move live rows to the lowest rows (the tail of a run, when most rows are free); only page tables
        move, no keys. Not while rows are held (their keys and rows are named elsewhere): the next poll."""
        if self.parked or self.continuing:
            return
        live = [s for s, r in enumerate(self.request) if r is not None]
        moves = [(s, d) for d, s in enumerate(live) if s != d]
        if not moves:
            return
        dev = self.t.device
        self._apply_row_flags()
        srcs, dsts = [s for s, _ in moves], [d for _, d in moves]
        self.cache.move_rows(srcs, dsts)
        src, dst = queued_to_device(torch.tensor(srcs), dev), queued_to_device(torch.tensor(dsts), dev)
        self.pos[dst], self.last[dst], self.alive[dst] = self.pos[src], self.last[src], self.alive[src]
        self.seed[dst] = self.seed[src]
        for s, d in moves:
            self.request[d], self.tokens[d], self.margins[d] = self.request[s], self.tokens[s], self.margins[s]
            self.length[d], self.admitted[d], self.due[d] = self.length[s], self.admitted[s], self.due[s]
            self.request[s], self.tokens[s], self.margins[s], self.length[s] = None, [], [], 0
        self.needs_page = [dict(moves).get(r, r) for r in self.needs_page]
        self.top = len(live) - 1
        freed = torch.arange(len(live), self.rows, device=dev)
        self.pos.index_fill_(0, freed, 0)
        self.alive.index_fill_(0, freed, 0)
        self.free = [s for s in range(self.rows) if self.request[s] is None]
        heapq.heapify(self.free)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def generate(target: BatchedTarget, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
             stop_ids: Sequence[int], sampling: Sampling = Sampling(), slots: int | None = None,
             cpu_slots: int = 16, desc: str = "generate", margins: bool = False,
             loops: LoopStop | None = None, pages: int | None = None, attention: str | None = None,
             decode_graphs: bool = True, stats: dict[str, Any] | None = None) -> list[Generated]:
    """Answer every prompt (token ids, already chat-templated; ``max_new_tokens`` one budget for all or one
    per prompt); results in prompt order. ``margins``: also the top-1/top-2 logit margin behind each token.
    ``loops``: end an answer that falls into a loop there (finish reason "loop"); an answer that never loops
    is the same with or without it. ``slots``: rows decoded at once (default ``plan_rows``); ``pages``,
    ``attention``, ``decode_graphs``: ``Stream``'s. ``stats``: filled with the run's ``Stream.stats`` (what a
    benchmark checks ran)."""
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    out: list[Generated | None] = [None] * len(prompts)
    if not prompts:
        return []
    stream = Stream(target, stop_ids, sampling, max_len=max(len(p) + n for p, n in zip(prompts, budgets, strict=True)),
                    rows=slots, cpu_rows=cpu_slots, wanted=len(prompts), pages=pages, margins=margins, loops=loops,
                    attention=attention, decode_graphs=decode_graphs)
    for i in sorted(range(len(prompts)), key=lambda i: (len(prompts[i]) + budgets[i], i)):  # shortest first
        stream.submit(i, prompts[i], budgets[i])
    with tqdm(total=len(prompts), desc=desc, unit=" seq") as bar:
        for i, answer in stream.run():
            out[i] = answer  # type: ignore[index]
            bar.update(1)
            if stream.steps % 64 == 0:
                bar.set_postfix(tok_s=round(stream.tokens_per_s()), rows=stream.rows, refresh=False)
    if stats is not None:
        stats.update(stream.stats())
    return out  # type: ignore[return-value]

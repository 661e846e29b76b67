"""Continuous batching over ``BatchedTarget``: a stream of requests through one paged KV cache.

A request is a prompt (token ids, already chat-templated) and an answer budget. Every step decodes one token
for every live row; a row whose answer ends (a stop token, its budget, or with ``loops`` a degenerate loop at
its end) is freed at once and its answer handed back, and waiting requests are admitted into free rows,
prefilled in groups so a prefill is a real batch. Requests may be submitted while the stream runs:
regeneration submits a conversation's next turn as soon as its previous answer ends (``Stream.run``). At
T=0 each answer is what greedy ``model.generate`` gives for that prompt alone (up to its loop's first copy,
for an answer stopped at a loop): rows never see each other, and the only difference is the attention
kernel's summation order (tests compare them token for token).

A conversation's next turn usually starts with exactly the tokens its previous turn's row holds (that prompt and
the answer generated), so it may continue in that row (``submit(..., continue_from=key)``): only the tokens after
the longest common prefix of the held ids and the new prompt are prefilled, at the positions that follow it.
The ids are compared, never assumed: the chat template re-renders the history, the answer's text tokenized
again need not give the generated ids, a loop-cut answer keeps fewer tokens than were generated, and the
end-of-turn marker that ended an answer was never written to the cache. A finished row is held for that only
until the next ``poll`` (the caller submits a follow-up between polls, as it reads the answers): one nobody
continued is freed then, so holding is bounded and nothing leaks. Keys and values depend only on the tokens
and positions before them, so a reused prefix is what a prefill would write, up to the kernels' summation order.

On CUDA a flex decode step replays a CUDA graph of its padded batch size (``engine.decode_graphs``); ``Stream.stats``
counts those steps and the captures. Given an ``engine.profile.EngineProfile`` a stream also measures where its
seconds go (a benchmark's question; unprofiled, it keeps no timings and records no timing events).

Admission, prefills, pages and preemption are ``engine.stream_admission``'s, decode steps and the rows' bookkeeping
``engine.stream_decoding``'s: ``Stream`` is both.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from tqdm import tqdm

from common.compile_guard import compile_seconds
from engine.batched import BatchedTarget
from engine.decode_graphs import DecodeGraphs
from engine.host_tokens import Firsts, HostTokens, Launched
from engine.kv_cache import PAGE
from engine.loops import LoopStop
from engine.profile import EngineProfile
from engine.requests import Continuation, Generated, Request
from engine.sampling import Picker, Sampling
from engine.sizing import MAX_ROWS, plan_pages, plan_rows
from engine.stream_admission import StreamAdmission
from engine.stream_decoding import StreamDecoding

DECODE_ROW_BUCKETS = 4  # flex decodes a batch padded to rows, rows/2, rows/4 or rows/8: one compile each
_UNMEASURED = nullcontext()  # an unprofiled stream's host phases (reentrant, shared)


class Stream(StreamAdmission, StreamDecoding):
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

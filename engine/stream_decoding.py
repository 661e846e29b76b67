"""``Stream``'s decode side (``engine.continuous_batching``): decode steps, their tokens booked into the rows' answers,
answers finished, rows freed and compacted.

Decode steps run one ahead of the host: a step is launched (its tokens picked on the device into the next step's
input and copied to pinned host memory without a wait), and only then are the previous step's tokens read and
booked (``Stream.step``). The host's bookkeeping, and the caller's work between polls, overlap the device's next
step (on a GPU the host's work around a small step takes about as long as the step itself). A row that ends at
step k has run in step k + 1 too: that token is dropped, and its write lands past the positions the row holds
(pages are given one position ahead, so it always has one). A prefill's first tokens come the same way
(``Firsts``): its rows go live when it is launched, and its picks are taken into them when the next decode step
has been launched, before any of that step's tokens. A CPU runs each step as it is launched: the same code, no overlap.

A mixin of ``Stream``: the state it reads and writes is the stream's, set up by ``Stream.__init__``.
"""

from __future__ import annotations

import heapq
import time
from typing import Any

import torch
from torch import Tensor

from common.queued_copy import queued_to_device
from engine.host_tokens import Launched
from engine.loops import loop_start, may_loop
from engine.requests import Generated
from engine.sizing import decode_rows


class StreamDecoding:
    """Tokens out of rows: a decode step launched one ahead of the host, its tokens booked into the rows' answers,
    an answer finished at its stop token, budget or loop, and the rows' flags, release and compaction."""

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

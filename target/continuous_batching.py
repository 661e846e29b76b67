"""Continuous batching over ``BatchedTarget``: thousands of prompts through a fixed set of cache slots.

Every step decodes one token for every live slot; a slot whose answer ends (a stop token,
``max_new_tokens``, or with ``loops`` a degenerate loop at its end) is handed the next prompt, prefilled in
groups so a prefill is a real batch. At T=0 each answer is what greedy ``model.generate`` gives for that
prompt alone (up to its loop's first copy, for an answer stopped at a loop): rows never see each other,
and the only difference is the attention kernel's summation order (tests compare them token for token).

Slots are sized from the device's free memory (a CPU gets ``cpu_slots``): the cache is the only large
allocation, ``slots x (longest prompt + max_new_tokens)`` positions. Prompts are taken shortest first and
split into length buckets so one long prompt does not shrink the slot count for all the short ones.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm import tqdm

from common.batching import length_batches
from target.batched import BatchedTarget, KVCache
from target.loops import check_window, loop_start

MEMORY_SHARE = 0.80  # of the free device memory, for the cache (the rest: weights' activations, logits)
MAX_SLOTS = 4096
# Padded prompt tokens per prefill call on a GPU (a CPU takes 4096); activations scale with it. Larger than the
# speculative eval's (eval.batched_speculative.SPECULATIVE_PREFILL_TOKENS): this prefill keeps the logits of each
# prompt's last position only, where that one keeps the aux states of every position and runs the drafter on them.
GENERATE_PREFILL_TOKENS = 65536
BUCKET_BASE = 512  # length buckets: 512, 1024, 2048, ... positions per slot


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class LoopStop:
    """Stop an answer that has fallen into a loop (``target.loops``): every ``every`` tokens once it has
    ``min_repeat_tokens``, its last tokens are checked, and an answer ending in a loop is cut to the loop's
    first copy and finished as "loop". Looping answers would otherwise run to ``max_new_tokens``."""

    min_repeat_tokens: int = 64
    max_period: int = 256
    every: int = 16

    @property
    def window(self) -> int:
        return check_window(self.min_repeat_tokens, self.max_period, self.every)


@dataclass
class Generated:
    tokens: list[int]  # the answer, without its stop token (a "loop" answer: cut after the loop's first copy)
    finish_reason: str  # "stop" | "length" | "loop"
    stop_token: int | None = None  # the stop token that ended it
    # with ``margins=True``: the top-1 minus top-2 logit behind each token, the stop token's last (the T=0
    # lossless check tells a near-tie from a real mismatch by it: eval.lossless); a "loop" answer's are cut too
    margins: list[float] = field(default_factory=list)
    generated: int = 0  # "loop": the tokens it had when the loop was found (len(tokens) kept of them)


def plan_slots(target: BatchedTarget, max_len: int, wanted: int, cpu_slots: int, slots: int | None = None) -> int:
    """How many sequences of ``max_len`` positions run at once: ``slots`` if given, else from the free
    memory on a GPU and ``cpu_slots`` on a CPU."""
    if slots is not None:
        return max(1, min(wanted, slots))
    if target.device.type != "cuda":
        return max(1, min(wanted, cpu_slots))
    free, _ = torch.cuda.mem_get_info(target.device)
    free += torch.cuda.memory_reserved(target.device) - torch.cuda.memory_allocated(target.device)  # cached, unused
    logits_row = target.lm_head.weight.shape[0] * 4 * 3  # fp32 logits and sampling temporaries per row
    per_slot = max_len * target.kv_bytes_per_token() + logits_row
    return max(1, min(wanted, MAX_SLOTS, int(free * MEMORY_SHARE) // per_slot))


def length_buckets(needs: Sequence[int]) -> list[list[int]]:
    """Request indices, shortest first, grouped by the power-of-two bucket of their positions needed."""
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(needs)), key=lambda i: (needs[i], i)):
        size = BUCKET_BASE
        while size < needs[i]:
            size *= 2
        buckets.setdefault(size, []).append(i)
    return [buckets[k] for k in sorted(buckets)]


class _Picker:
    """Greedy argmax, or temperature / top-k / top-p sampling from one seeded generator."""

    def __init__(self, s: Sampling, device: torch.device):
        self.s = s
        self.gen = torch.Generator(device=device).manual_seed(s.seed) if s.temperature > 0 else None

    def __call__(self, logits: Tensor) -> Tensor:
        if self.gen is None:
            return logits.argmax(-1)
        z = logits.float() / self.s.temperature
        if self.s.top_k:
            kth = torch.topk(z, min(self.s.top_k, z.shape[-1]), dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.s.top_p < 1.0:
            sorted_z, order = z.sort(-1, descending=True)
            cum = sorted_z.softmax(-1).cumsum(-1)
            drop = cum - sorted_z.softmax(-1) >= self.s.top_p  # keep the smallest prefix reaching top_p
            z = z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))
        return torch.multinomial(z.softmax(-1), 1, generator=self.gen).squeeze(-1)


class _Run:
    """One bucket's loop state: which request each slot serves, its next position and last token."""

    def __init__(self, target: BatchedTarget, cache: KVCache, prompts: Sequence[Sequence[int]],
                 max_new: Sequence[int], stop_ids: set[int], pick: _Picker, out: list[Generated | None], bar: tqdm,
                 margins: bool = False, loops: LoopStop | None = None):
        self.t, self.cache, self.prompts, self.max_new = target, cache, prompts, max_new
        self.stop_ids, self.pick, self.out, self.bar, self.loops = stop_ids, pick, out, bar, loops
        n, dev = cache.slots, target.device
        self.request = [-1] * n  # request index served by each slot, -1 = free
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.want_margins = margins
        self.margins: list[list[float]] = [[] for _ in range(n)]
        self.free = list(range(n))  # a heap: refill the lowest slots so live ones stay at the front
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.last = torch.zeros(n, dtype=torch.long, device=dev)
        self.alive = torch.zeros(n, dtype=torch.long, device=dev)  # 1 for a slot serving a request
        self.live = 0

    def admit(self, reqs: list[int]) -> None:
        """Prefill ``reqs`` into free slots, length-batched under the prefill token budget."""
        budget = GENERATE_PREFILL_TOKENS if self.t.device.type == "cuda" else 4096
        for group in length_batches([len(self.prompts[r]) for r in reqs], budget):
            self._prefill([reqs[i] for i in group])

    def _prefill(self, reqs: list[int]) -> None:
        dev = self.t.device
        slots = [heapq.heappop(self.free) for _ in reqs]
        lens = [len(self.prompts[r]) for r in reqs]
        width = max(lens)
        ids = torch.zeros(len(reqs), width, dtype=torch.long)
        for j, r in enumerate(reqs):
            ids[j, : lens[j]] = torch.tensor(self.prompts[r])
        ids = ids.to(dev)
        positions = torch.arange(width, device=dev)[None].expand(len(reqs), width)
        rows = torch.tensor(slots, device=dev)
        out = self.t.forward(self.cache, rows, ids, positions, fresh=True,
                             logits_at=torch.tensor(lens, device=dev) - 1)
        first = self.pick(out.logits)
        margins = self._margins(out.logits, len(reqs))
        self.pos[rows] = torch.tensor(lens, device=dev)
        self.last[rows] = first
        self.alive[rows] = 1
        for slot, r, tok, m in zip(slots, reqs, first.tolist(), margins, strict=True):
            self.request[slot], self.tokens[slot], self.margins[slot] = r, [], []
            self.live += 1
            self._take(slot, tok, m)

    def _margins(self, logits: Tensor, rows: int) -> list[float | None]:
        """Top-1 minus top-2 logit per row (one topk over the batch's logits), when asked for."""
        if not self.want_margins:
            return [None] * rows
        top = logits.float().topk(2, dim=-1).values
        return (top[..., 0] - top[..., 1]).reshape(rows).tolist()

    def _take(self, slot: int, tok: int, margin: float | None = None) -> None:
        """Append one token to a slot's answer; free the slot when the answer ends."""
        r = self.request[slot]
        if margin is not None:
            self.margins[slot].append(margin)
        if tok in self.stop_ids:
            self._finish(slot, "stop", tok)
            return
        answer = self.tokens[slot]
        answer.append(tok)
        n, lp = len(answer), self.loops
        if lp is not None and n >= lp.min_repeat_tokens and n % lp.every == 0:
            # Only the answer's last tokens can decide (LoopStop.window); a cut keeps the loop's first copy.
            off = max(0, n - lp.window)
            start = loop_start(answer[off:], lp.min_repeat_tokens, lp.max_period)
            if start is not None:
                del answer[off + start:]
                del self.margins[slot][off + start:]
                self._finish(slot, "loop", generated=n)
                return
        if n >= self.max_new[r]:
            self._finish(slot, "length")

    def _finish(self, slot: int, reason: str, stop_token: int | None = None, generated: int = 0) -> None:
        self.out[self.request[slot]] = Generated(self.tokens[slot], reason, stop_token, self.margins[slot],
                                                 generated)
        self.margins[slot] = []
        self.request[slot] = -1
        self.pos[slot] = 0  # a free row below the last live one still runs: its writes stay at position 0
        self.alive[slot] = 0
        heapq.heappush(self.free, slot)
        self.live -= 1
        self.bar.update(1)

    def step(self) -> int:
        """One decode token for every slot up to the last live one; returns tokens produced."""
        hi = self.last_live() + 1
        rows = slice(0, hi)
        out = self.t.forward(self.cache, rows, self.last[:hi, None], self.pos[:hi, None], fresh=False,
                             logits_at=torch.zeros(hi, dtype=torch.long, device=self.t.device))
        nxt = self.pick(out.logits)
        margins = self._margins(out.logits, hi)
        self.last[:hi] = nxt
        self.pos[:hi] += self.alive[:hi]
        produced = 0
        for slot, (tok, m) in enumerate(zip(nxt.tolist(), margins, strict=True)):
            if self.request[slot] >= 0:
                produced += 1
                self._take(slot, tok, m)
        return produced

    def last_live(self) -> int:
        """The highest slot serving a request (a step decodes every slot up to it)."""
        return max(s for s, r in enumerate(self.request) if r >= 0)

    def compact(self) -> None:
        """Move live rows to the lowest slots (the tail of a run, when most slots are free)."""
        live = [s for s, r in enumerate(self.request) if r >= 0]
        targets = list(range(len(live)))
        moves = [(s, d) for s, d in zip(live, targets, strict=True) if s != d]
        if not moves:
            return
        dev = self.t.device
        src = torch.tensor([s for s, _ in moves], device=dev)
        dst = torch.tensor([d for _, d in moves], device=dev)
        self.cache.move_rows(src, dst)
        self.pos[dst], self.last[dst], self.alive[dst] = self.pos[src], self.last[src], self.alive[src]
        for s, d in moves:
            self.request[d], self.tokens[d], self.margins[d] = self.request[s], self.tokens[s], self.margins[s]
            self.request[s], self.tokens[s], self.margins[s] = -1, [], []
        freed = torch.tensor([s for s in range(len(live), self.cache.slots)], dtype=torch.long, device=dev)
        self.pos[freed], self.alive[freed] = 0, 0
        self.free = [s for s in range(self.cache.slots) if self.request[s] < 0]
        heapq.heapify(self.free)


def generate(target: BatchedTarget, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int],
             stop_ids: Sequence[int], sampling: Sampling = Sampling(), slots: int | None = None,
             cpu_slots: int = 16, desc: str = "generate", margins: bool = False,
             loops: LoopStop | None = None) -> list[Generated]:
    """Answer every prompt (token ids, already chat-templated; ``max_new_tokens`` one budget for all or one
    per prompt); results in prompt order. ``margins``: also the top-1/top-2 logit margin behind each token.
    ``loops``: end an answer that falls into a loop there (finish reason "loop"); an answer that never loops
    is the same with or without it."""
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    out: list[Generated | None] = [None] * len(prompts)
    pick = _Picker(sampling, target.device)
    stops = set(stop_ids)
    produced, steps, started = 0, 0, time.perf_counter()
    with tqdm(total=len(prompts), desc=desc, unit=" seq") as bar:
        for bucket in length_buckets([len(p) + n for p, n in zip(prompts, budgets, strict=True)]):
            max_len = max(len(prompts[i]) + budgets[i] for i in bucket)
            n_slots = plan_slots(target, max_len, len(bucket), cpu_slots, slots)
            run = _Run(target, target.new_cache(n_slots, max_len), prompts, budgets, stops, pick, out, bar, margins,
                       loops)
            pending = list(reversed(bucket))  # pop() takes the shortest first
            refill_at = max(1, n_slots // 8)
            while pending or run.live:
                if pending and (len(run.free) >= refill_at or run.live == 0):
                    run.admit([pending.pop() for _ in range(min(len(run.free), len(pending)))])
                if run.live == 0:
                    continue
                if not pending and 0 < run.live * 2 < run.last_live():
                    run.compact()
                produced += run.step()
                steps += 1
                if steps % 64 == 0:
                    rate = round(produced / (time.perf_counter() - started))
                    bar.set_postfix(tok_s=rate, slots=n_slots, refresh=False)
            del run
    return out  # type: ignore[return-value]

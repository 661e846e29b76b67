"""Degenerate loops at the end of an answer: find them, cut them, measure them (pure; numpy only).

A small target decoding greedily often ends in a loop: the same block of tokens again and again until
``max_new_tokens``. Those tails are easy tokens (the drafter predicts a copy) that inflate held-out accuracy
and teach nothing about real decoding, so regeneration stops an answer at its loop
(``engine.continuous_batching``, finish reason "loop") and the reports measure what is left.

A tail loop of period p: the trailing run of positions t with tokens[t] == tokens[t - p]. It counts when the
run covers at least one full extra copy of the block (p tokens) and at least ``min_repeat_tokens`` tokens;
the cut keeps the first copy of the block and drops the copies.

    >>> loop_start([5, 6] + [1, 2, 3] * 30, min_repeat_tokens=64)
    5
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def check_window(min_repeat_tokens: int, max_period: int, every: int) -> int:
    """Tokens at the end of an answer that decide ``loop_start`` when it is called every ``every`` tokens: no
    period qualified at the previous call, so every run is shorter than max(min_repeat_tokens, p) + every,
    and measuring a run of period p takes the run plus the p tokens before it."""
    return max(min_repeat_tokens, max_period) + max_period + every


@dataclass(frozen=True)
class LoopStop:
    """Stop an answer that has fallen into a loop: every ``every`` tokens once it has
    ``min_repeat_tokens``, its last tokens are checked, and an answer ending in a loop is cut to the loop's
    first copy and ``keep`` tokens of its copies (at most ``min_repeat_tokens``: what a detected loop has) and
    finished as "loop". Looping answers would otherwise run to ``max_new_tokens``."""

    min_repeat_tokens: int = 64
    max_period: int = 256
    every: int = 16
    keep: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.keep <= self.min_repeat_tokens:
            raise ValueError(f"LoopStop.keep {self.keep}: expected 0..min_repeat_tokens ({self.min_repeat_tokens})")

    @property
    def window(self) -> int:
        return check_window(self.min_repeat_tokens, self.max_period, self.every)


def trailing_runs(tokens: Sequence[int] | np.ndarray, max_period: int = 256, floor: int = 1) -> np.ndarray:
    """``runs[p - 1]``: how many of the last positions t have tokens[t] == tokens[t - p], for p = 1..max_period
    (at most len - 1); with ``floor`` > 1, a run shorter than ``floor`` may read 0 (``loop_start`` needs only
    the runs that can count). Only the periods where the last token repeats can have a run; those whose run
    reaches ``floor`` are found at once (their last ``floor`` tokens compared in one array operation: few pass
    in text that does not loop, however common its last token, e.g. code's indentation). Of those, the smallest
    whose run is not yet known is measured, and its run gives its multiples' at once: a run r of period p makes
    the last r + p tokens p-periodic, so a multiple q <= r + p of p runs r + p - q (its first mismatch is p's).
    A loop of period p has every multiple of p as a candidate, so a looping tail costs a measure or two."""
    n = len(tokens)
    periods = min(max_period, n - 1)
    runs = np.zeros(max(periods, 0), dtype=np.int64)
    if periods < 1:
        return runs
    # fromiter: a list's conversion is a large part of a check's cost, and this one takes about half asarray's time
    a = tokens if isinstance(tokens, np.ndarray) else np.fromiter(tokens, dtype=np.int64, count=n)
    rev = a[::-1]  # rev[j] = tokens[n - 1 - j]; a run of period p: rev[j] == rev[j + p] for j = 0, 1, ...
    cands = np.flatnonzero(rev[1:periods + 1] == rev[0]) + 1  # periods whose run is at least 1
    if floor > 1:
        cands = cands[cands <= n - floor]  # a run of p is at most n - p
        if len(cands):
            windows = sliding_window_view(rev, floor)[cands]  # (candidates, floor): rev[p : p + floor]
            cands = cands[(windows == rev[:floor]).all(axis=1)]
    known = np.zeros(periods + 1, dtype=bool)
    for p in cands.tolist():
        if known[p]:
            continue
        differ = rev[p:] != rev[:n - p]
        first = int(differ.argmax())
        r = first if differ[first] else n - p  # no mismatch: the run reaches the first token
        multiples = np.arange(p, min(periods, r + p) + 1, p)
        runs[multiples - 1] = r + p - multiples
        known[multiples] = True
    return runs


def may_loop(tokens: list[int], min_repeat_tokens: int = 64, max_period: int = 256, k: int = 8) -> bool:
    """Whether ``loop_start(tokens)`` finds a loop (exactly), in plain Python on the list (no copy, no array): the
    engine asks it every few tokens of every live row, and ``loop_start`` only when it says True. A loop of period
    p runs over the last R = max(min_repeat_tokens, p) positions, so the last k tokens occur p <= max_period
    positions earlier (k <= min_repeat_tokens): each such occurrence names a p, whose run is then compared whole.
    Text that does not loop rarely repeats a k-gram within max_period tokens (on English prose about 1 % of
    checks get to a comparison); a loop still forming (a run under R) has a few, each rejected by one list
    comparison, where ``loop_start``'s numpy calls would run on every such check (most checks of a small greedy
    target's answers pass the k-gram alone), a cost paid for every live row every few tokens."""
    k = max(1, min(k, min_repeat_tokens))
    n = len(tokens)
    if n <= min_repeat_tokens:
        return False
    tail = tokens[n - k:]
    j, end = max(0, n - k - max_period), n - k  # where an earlier copy of the tail may start
    while True:
        try:
            j = tokens.index(tail[0], j, end)
        except ValueError:
            return False
        p = end - j
        run = max(min_repeat_tokens, p)
        # the run's far end first (a loop still forming breaks there), then the k-gram, then the whole run
        if (run + p <= n and tokens[n - run] == tokens[n - run - p] and tokens[j:j + k] == tail
                and tokens[n - run:] == tokens[n - run - p:n - p]):
            return True
        j += 1


def loop_start(tokens: Sequence[int] | np.ndarray, min_repeat_tokens: int = 64, max_period: int = 256) -> int | None:
    """Where the copies of a tail loop begin (keep ``tokens[:start]``: everything before the loop and its first
    copy of the block), or None when the answer does not end in one. A period p counts when its trailing run
    covers at least max(min_repeat_tokens, p) tokens; of those, the p with the longest run wins (ties: the
    smallest p)."""
    runs = trailing_runs(tokens, max_period, floor=min_repeat_tokens)
    if len(runs) == 0:
        return None
    periods = np.arange(1, len(runs) + 1)
    ok = runs >= np.maximum(min_repeat_tokens, periods)
    if not ok.any():
        return None
    best = int(np.argmax(np.where(ok, runs, -1)))  # the first maximum: the smallest p among the longest runs
    return len(tokens) - int(runs[best])


def retokenized_loop_start(tokens: Sequence[int] | np.ndarray, min_repeat_tokens: int = 64, max_period: int = 256,
                           ragged: int = 1) -> int | None:
    """``loop_start`` of an answer's text tokenized again (a server's answer, a stored one): its last ``ragged``
    tokens may come out otherwise than they were generated (an answer cut at its token budget ends anywhere, e.g. in a
    lone space), so a loop that stops up to ``ragged`` tokens before the end counts too (they go with the
    copies)."""
    for k in range(min(ragged, max(len(tokens) - 1, 0)) + 1):
        start = loop_start(tokens[:len(tokens) - k], min_repeat_tokens, max_period)
        if start is not None:
            return start
    return None


def loop_tail_tokens(tokens: Sequence[int] | np.ndarray, min_repeat_tokens: int = 64, max_period: int = 256) -> int:
    """Tokens in the answer's loop tail (the copies ``loop_start`` would drop); 0 when it has none."""
    start = loop_start(tokens, min_repeat_tokens, max_period)
    return 0 if start is None else len(tokens) - start


def loop_token_share(tokens: Sequence[int] | np.ndarray, min_repeat_tokens: int = 64, max_period: int = 256) -> float:
    """Share of one answer's tokens inside its loop tail (0.0 for an empty answer)."""
    return loop_tail_tokens(tokens, min_repeat_tokens, max_period) / len(tokens) if len(tokens) else 0.0


def first_repeat(text: str, window: int = 64) -> int | None:
    """The first position i where ``text[i:i + window]`` already occurred earlier in ``text``, else None."""
    seen: set[str] = set()
    for i in range(len(text) - window + 1):
        chunk = text[i:i + window]
        if chunk in seen:
            return i
        seen.add(chunk)
    return None


def after_first_repeat_chars(text: str, window: int = 64) -> int:
    """Characters from the first repeated ``window``-character window to the end (0 when none repeats)."""
    i = first_repeat(text, window)
    return 0 if i is None else len(text) - i


def after_first_repeat_share(text: str, window: int = 64) -> float:
    """A tokenizer-free loop measure: the share of ``text`` that comes after (from the start of) the first
    ``window``-character window that already occurred earlier in the same text."""
    return after_first_repeat_chars(text, window) / len(text) if text else 0.0

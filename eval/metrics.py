"""Acceptance and speed statistics from per-cycle records (pure functions: no model, no I/O).

A *cycle* is one target verify pass over ``k`` chained drafts; ``accepted`` is how many of them the
target kept (0..k). Every cycle also yields one token of the target's own (the correction or bonus),
so a cycle produces ``accepted + 1`` tokens and tau = mean(accepted) + 1, the figure SGLang reports as
``completion_tokens / spec_verify_ct``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def histogram(accepted: Sequence[int], k: int) -> list[int]:
    """Counts of cycles that accepted exactly 0..k drafts."""
    hist = [0] * (k + 1)
    for a in accepted:
        if not 0 <= a <= k:
            raise ValueError(f"accepted count {a} outside 0..{k}")
        hist[a] += 1
    return hist


def tau_from_histogram(hist: Sequence[int]) -> float:
    """Mean tokens per verify cycle (accepted drafts + the target's own token); NaN without cycles."""
    n = sum(hist)
    return sum((a + 1) * c for a, c in enumerate(hist)) / n if n else float("nan")


def unconditional_rates(hist: Sequence[int]) -> list[float]:
    """P(draft i accepted) for i = 1..k: in a chain, draft i is kept iff at least i drafts were kept."""
    n = sum(hist)
    if not n:
        return [float("nan")] * (len(hist) - 1)
    return [sum(hist[i:]) / n for i in range(1, len(hist))]


def conditional_rates(hist: Sequence[int]) -> list[float]:
    """alpha_i = P(draft i accepted | draft i-1 accepted), i = 1..k (alpha_1 is unconditional);
    NaN where no cycle got as far as draft i-1."""
    reach = [sum(hist[i:]) for i in range(len(hist))]  # cycles with >= i accepted
    return [reach[i] / reach[i - 1] if reach[i - 1] else float("nan") for i in range(1, len(hist))]


@dataclass(frozen=True)
class PhaseTimes:
    """Seconds summed over all cycles of a run."""

    draft_s: float
    verify_s: float
    overhead_s: float
    cycles: int

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.overhead_s

    def ms_per_cycle(self) -> dict[str, float]:
        n = max(self.cycles, 1)
        return {"draft": 1000 * self.draft_s / n, "verify": 1000 * self.verify_s / n,
                "overhead": 1000 * self.overhead_s / n, "cycle": 1000 * self.total_s / n}


PHASE_LABELS = {"draft": "Draft", "verify": "Target verify", "overhead": "Overhead"}


def phase_lines(times: PhaseTimes) -> list[str]:
    """``Target verify: 19.98 ms/cyc (94.5%)`` for each phase."""
    ms = times.ms_per_cycle()
    total = ms["cycle"] or float("nan")
    return [f"{PHASE_LABELS[p]}: {ms[p]:.2f} ms/cyc ({100 * ms[p] / total:.1f}%)" for p in PHASE_LABELS]


def speed(tokens: int, cycle_s: float, decode_ms: float) -> dict[str, float]:
    """tok/s with speculation (cycle tokens over the cycles' seconds) and without (1000 / plain ms per token), both
    timed the same way (eval.stall_free's read, as tau* is)."""
    spec_tps = tokens / cycle_s if cycle_s > 0 else float("nan")
    plain_tps = 1000.0 / decode_ms if decode_ms > 0 else float("nan")
    return {"spec_tps": spec_tps, "plain_tps": plain_tps, "speedup": spec_tps / plain_tps}

"""Bootstrap intervals for tau, for the paired difference of two drafters and for tau* (pure: numbers in, numbers out).

tau over a dataset is a ratio of sums, sum(tokens) / sum(verify cycles) over its prompts (a long answer weighs
more than a short one, as it does in serving), so it is resampled as one: B resamples of the prompts (with
replacement), the ratio recomputed on each. A paired difference resamples the *same* prompt indices for both
drafters, so prompt difficulty, which both share, cancels out of its spread. tau* = t_cycle / t_decode is
resampled over the timing prompts (both times recomputed on each resample). Intervals are percentile intervals
at a two-sided ``level``. Every draw comes from a generator seeded by (seed, stream): the same seed gives the same
interval, run after run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PROMPTS, TIMINGS = 0, 1  # the streams: eval prompts, timing prompts


@dataclass(frozen=True)
class Bootstrap:
    """How intervals are drawn: two-sided ``level`` (0.95), ``samples`` resamples, generator ``seed``."""

    level: float
    samples: int
    seed: int

    def indices(self, n: int, stream: int) -> np.ndarray:
        """(samples, n) prompt indices drawn with replacement, the same for the same (seed, stream, n)."""
        return np.random.default_rng([self.seed, stream]).integers(0, n, size=(self.samples, n))


@dataclass(frozen=True)
class Interval:
    """An estimate, its interval at ``level`` and the prompts behind it (0: a given constant, no spread)."""

    point: float
    low: float
    high: float
    prompts: int
    level: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def to_dict(self) -> dict:
        return {"point": self.point, "ci": [self.low, self.high], "prompts": self.prompts, "level": self.level}


@dataclass(frozen=True)
class Estimate:
    """A statistic and its bootstrap distribution: ``draws`` (samples,), NaN where a resample held no cycle."""

    point: float
    draws: np.ndarray
    prompts: int

    def interval(self, level: float) -> Interval:
        finite = self.draws[np.isfinite(self.draws)]
        if not math.isfinite(self.point) or not finite.size:
            return Interval(self.point, float("nan"), float("nan"), self.prompts, level)
        low, high = np.percentile(finite, [50 * (1 - level), 50 * (1 + level)])
        return Interval(self.point, float(low), float(high), self.prompts, level)

    def __sub__(self, other: Estimate) -> Estimate:
        return Estimate(self.point - other.point, self.draws - other.draws, self.prompts)

    def scaled(self, factor: float) -> Estimate:
        return Estimate(self.point * factor, self.draws * factor, self.prompts)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray | float:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _arrays(*columns: Sequence[float]) -> list[np.ndarray]:
    arrays = [np.asarray(c, dtype=float) for c in columns]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
        raise ValueError(f"per-prompt columns of different lengths: {[a.shape for a in arrays]}")
    return arrays


def ratio_estimate(num: Sequence[float], den: Sequence[float], boot: Bootstrap, stream: int = PROMPTS) -> Estimate:
    """sum(num) / sum(den) over prompts (tau: tokens over verify cycles), resampling prompts. A prompt with no
    denominator (an answer that ended at its prefill token: no verify cycle) says nothing about the ratio: it is
    left out, so it neither counts as a prompt measured nor thins the resamples."""
    n_, d_ = _arrays(num, den)
    n_, d_ = n_[d_ > 0], d_[d_ > 0]
    if not n_.size:
        return constant(float("nan"), boot)
    idx = boot.indices(n_.size, stream)
    return Estimate(float(_ratio(n_.sum(), d_.sum())), _ratio(n_[idx].sum(1), d_[idx].sum(1)), n_.size)


def paired_difference(a: tuple[Sequence[float], Sequence[float]], b: tuple[Sequence[float], Sequence[float]],
                      boot: Bootstrap) -> Estimate:
    """ratio(a) - ratio(b) for two drafters measured on the same prompts, both recomputed on the same resampled
    prompt indices. ``a``, ``b``: (tokens, cycles) per prompt, in the same prompt order."""
    if len(a[0]) != len(b[0]):
        raise ValueError(f"a paired comparison needs the same prompts: {len(a[0])} vs {len(b[0])}")
    both = (np.asarray(a[1], dtype=float) > 0) & (np.asarray(b[1], dtype=float) > 0)  # prompts both measured
    a, b = ((np.asarray(t, dtype=float)[both], np.asarray(c, dtype=float)[both]) for t, c in (a, b))
    return ratio_estimate(*a, boot) - ratio_estimate(*b, boot)


def tau_star_estimate(decode_s: Sequence[float], steps: Sequence[float], cycle_s: Sequence[float],
                      cycles: Sequence[float], boot: Bootstrap) -> Estimate:
    """tau* = (sum cycle_s / sum cycles) / (sum decode_s / sum steps) over the timing prompts, each resample
    recomputing both times on the same prompts (prompt i's plain and speculative runs decode the same text)."""
    ds, st, cs, cy = _arrays(decode_s, steps, cycle_s, cycles)
    if not ds.size:
        return constant(float("nan"), boot)
    idx = boot.indices(ds.size, TIMINGS)
    point = _ratio(cs.sum(), cy.sum()) / _ratio(ds.sum(), st.sum())
    draws = _ratio(cs[idx].sum(1), cy[idx].sum(1)) / _ratio(ds[idx].sum(1), st[idx].sum(1))
    return Estimate(float(point), draws, ds.size)


def constant(value: float, boot: Bootstrap) -> Estimate:
    """A figure with no spread (tau* from configured timings): every draw is the value, no prompts behind it."""
    return Estimate(value, np.full(boot.samples, value), 0)


def prompts_to_resolve(iv: Interval, bar: float) -> int | None:
    """About how many prompts would make the interval clear ``bar`` or fall below it, if the observed difference
    stayed what it is; None when nothing can (the difference is zero, or not finite).

    Basis: a bootstrap interval's half-width shrinks as 1/sqrt(n) for the same per-prompt spread, so with n prompts
    and half-width w it takes n' = n (w / |point - bar|)^2 prompts to make the half-width the observed distance to
    the bar. An estimate only: the point moves too as prompts are added."""
    gap = iv.point - bar
    if not (math.isfinite(gap) and math.isfinite(iv.half_width)) or gap == 0 or not iv.prompts:
        return None
    return max(math.ceil(iv.prompts * (iv.half_width / abs(gap)) ** 2), iv.prompts + 1)

"""Bootstrap intervals for tau, for the paired difference of two drafters and for tau* (pure: numbers in, numbers out).

tau over a dataset is a ratio of sums, sum(tokens) / sum(verify cycles) over its prompts (a long answer weighs
more than a short one, as it does in serving), so it is resampled as one: B resamples of the prompts (with
replacement), the ratio recomputed on each. A paired difference resamples the *same* prompt indices for both
drafters, so prompt difficulty, which both share, cancels out of its spread. tau* = t_cycle / t_decode is
resampled over the timing prompts (both times recomputed on each resample).

Intervals are *expanded* percentile intervals at a two-sided ``level`` (Hesterberg, "What teachers should know
about the bootstrap", 2015): a plain percentile interval is too narrow on few prompts (about 84% coverage for a
nominal 95% at 5 prompts), so each resampled deviation from the point is stretched by
sqrt(n / (n - 1)) t_{n-1} / z, the factor that turns a normal interval on n values into Student's. It tends to 1 as
n grows (1.02 at 80 prompts); fewer than 2 prompts give no interval at all. Every draw comes from a generator
seeded by (seed, stream): the same seed gives the same interval, run after run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np

PROMPTS, TIMINGS = 0, 1  # the streams: eval prompts, timing prompts
RESOLVE_POWER = 0.8  # prompts_to_resolve: the chance the interval resolves at the prompts it names
RESOLVE_CAP = 100  # prompts_to_resolve: past this many times the prompts measured, a difference is called a tie


def student_t_cdf_two_sided(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df``, in closed form (Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + (2 4)/(3 5) cos^4 + ...)); df 1: 2 theta / pi
        term, total = 1.0, 1.0 if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= c2 * (2 * j) / (2 * j + 1)
            total += term
        return 2 / math.pi * (theta + (s * math.cos(theta) * total if df > 1 else 0.0))
    term = total = 1.0  # even: sin (1 + 1/2 cos^2 + (1 3)/(2 4) cos^4 + ...)
    for j in range(1, df // 2):
        term *= c2 * (2 * j - 1) / (2 * j)
        total += term
    return s * total


@lru_cache(maxsize=4096)
def student_t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (q > 0.5) of Student's t with integer ``df`` >= 1: bisection on the closed-form CDF; past
    1000 degrees of freedom, the normal quantile with its first Cornish-Fisher term (error below 3e-6)."""
    z = NormalDist().inv_cdf(q)
    if df > 1000:
        return z + (z ** 3 + z) / (4 * df)
    target, lo, hi = 2 * q - 1, 0.0, 1.0
    while student_t_cdf_two_sided(hi, df) < target:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_cdf_two_sided(mid, df) < target else (lo, mid)
    return (lo + hi) / 2


def expansion(n: int, level: float) -> float:
    """How far an expanded percentile interval on ``n`` values stretches the plain one at two-sided ``level``:
    sqrt(n / (n - 1)) t_{n-1} / z; infinite below 2 values (one value shows no spread)."""
    if n < 2:
        return math.inf
    q = (1 + level) / 2
    return math.sqrt(n / (n - 1)) * student_t_quantile(q, n - 1) / NormalDist().inv_cdf(q)


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
class Resampled:
    """One figure resampled on its own prompts: its point, its B raw (plain percentile) draws, NaN where a resample
    held no cycle, and how many prompts were resampled (0: a given constant, every draw the point)."""

    point: float
    draws: np.ndarray
    prompts: int

    def expanded(self, level: float) -> np.ndarray:
        """The draws with each deviation from the point stretched by ``expansion(prompts, level)``; all NaN under 2
        prompts (no spread to read), the raw draws for a constant."""
        if self.prompts == 0:
            return self.draws
        c = expansion(self.prompts, level)
        return self.draws + np.nan if not math.isfinite(c) else self.point + c * (self.draws - self.point)


@dataclass(frozen=True)
class Estimate:
    """A statistic and its bootstrap distribution, as a weighted sum of independently resampled figures
    (``terms``: (weight, figure); one for tau, two for tau - tau* (1 + margin)). Each figure is expanded for its
    own prompts at the level an interval is asked for, so an interval at a stricter level (the family-wise reading
    of ``eval.gate.decide``) is stretched as Student's t at that level would stretch it, not rescaled from 95 %."""

    point: float
    terms: tuple[tuple[float, Resampled], ...]
    prompts: int

    def draws(self, level: float) -> np.ndarray:
        return sum(w * f.expanded(level) for w, f in self.terms)

    def interval(self, level: float) -> Interval:
        draws = self.draws(level)
        finite = draws[np.isfinite(draws)]
        if not math.isfinite(self.point) or not finite.size:
            return Interval(self.point, float("nan"), float("nan"), self.prompts, level)
        low, high = np.percentile(finite, [50 * (1 - level), 50 * (1 + level)])
        return Interval(self.point, float(low), float(high), self.prompts, level)

    def __sub__(self, other: Estimate) -> Estimate:
        return Estimate(self.point - other.point, self.terms + tuple((-w, f) for w, f in other.terms), self.prompts)

    def scaled(self, factor: float) -> Estimate:
        return Estimate(self.point * factor, tuple((w * factor, f) for w, f in self.terms), self.prompts)

    @classmethod
    def resampled(cls, point: float, draws: np.ndarray, prompts: int) -> Estimate:
        """A figure from ``prompts`` prompts and its raw bootstrap draws; fewer than 2 prompts give no interval."""
        return cls(point, ((1.0, Resampled(point, draws, prompts)),), prompts)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray | float:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def _arrays(*columns: Sequence[float]) -> list[np.ndarray]:
    arrays = [np.asarray(c, dtype=float) for c in columns]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1:
        raise ValueError(f"per-prompt columns of different lengths: {[a.shape for a in arrays]}")
    return arrays


def _measured(num: Sequence[float], den: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """The prompts with a denominator (a verify cycle): a prompt whose answer ended at its prefill token says
    nothing about tokens per cycle, so it neither counts as a prompt measured nor thins the resamples."""
    n_, d_ = _arrays(num, den)
    return n_[d_ > 0], d_[d_ > 0]


def _ratio_draws(num: np.ndarray, den: np.ndarray, idx: np.ndarray) -> tuple[float, np.ndarray]:
    return float(_ratio(num.sum(), den.sum())), _ratio(num[idx].sum(1), den[idx].sum(1))


def ratio_estimate(num: Sequence[float], den: Sequence[float], boot: Bootstrap, stream: int = PROMPTS) -> Estimate:
    """sum(num) / sum(den) over the prompts with a denominator (tau: tokens over verify cycles), resampling them."""
    n_, d_ = _measured(num, den)
    if not n_.size:
        return constant(float("nan"), boot)
    return Estimate.resampled(*_ratio_draws(n_, d_, boot.indices(n_.size, stream)), n_.size)


PairedColumns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def paired_columns(a: tuple[Sequence[float], Sequence[float]], b: tuple[Sequence[float], Sequence[float]]
                   ) -> PairedColumns:
    """The prompts a paired comparison reads: those where both drafters ran a verify cycle, as (their indices in
    the dataset, a's tokens, a's cycles, b's tokens, b's cycles). ``a``, ``b``: (tokens, cycles) per prompt, in the
    same prompt order."""
    if len(a[0]) != len(b[0]):
        raise ValueError(f"a paired comparison needs the same prompts: {len(a[0])} vs {len(b[0])}")
    (ta, ca), (tb, cb) = ((np.asarray(t, dtype=float), np.asarray(c, dtype=float)) for t, c in (a, b))
    both = np.flatnonzero((ca > 0) & (cb > 0))
    return both, ta[both], ca[both], tb[both], cb[both]


def paired_difference(a: tuple[Sequence[float], Sequence[float]], b: tuple[Sequence[float], Sequence[float]],
                      boot: Bootstrap) -> Estimate:
    """ratio(a) - ratio(b) for two drafters measured on the same prompts (``paired_columns``), both recomputed on
    one matrix of resampled prompt indices."""
    _, ta, ca, tb, cb = paired_columns(a, b)
    if not ta.size:
        return constant(float("nan"), boot)
    idx = boot.indices(ta.size, PROMPTS)
    (pa, da), (pb, db) = _ratio_draws(ta, ca, idx), _ratio_draws(tb, cb, idx)
    return Estimate.resampled(pa - pb, da - db, ta.size)


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
    return Estimate.resampled(float(point), draws, ds.size)


def constant(value: float, boot: Bootstrap) -> Estimate:
    """A figure with no spread (tau* from configured timings): every draw is the value, no prompts behind it."""
    return Estimate(value, ((1.0, Resampled(value, np.full(boot.samples, value), 0)),), 0)


def prompts_to_resolve(iv: Interval, bar: float) -> int | None:
    """About how many prompts in all would resolve the interval against ``bar`` (its lower end clearing it, or its
    upper end falling below it) with an 80% chance, if the observed difference stayed what it is; None when no
    number would: a zero or non-finite difference, fewer than 2 prompts, or more than ``RESOLVE_CAP`` times the
    prompts measured (a tie for any practical purpose).

    Basis: for the same per-prompt spread, the side of the interval facing the bar shrinks as 1/sqrt(n) (times the
    small-sample expansion, which shrinks towards 1 as well); m prompts resolve the difference half of the time when
    that side's width is the distance to the bar, 80% of the time when it is (z + z_0.8) / z times smaller. An
    estimate only: the point moves as prompts are added, and gating again and again as prompts are added until
    something resolves raises the chance of a wrong verdict."""
    gap = iv.point - bar
    n = iv.prompts
    facing = iv.point - iv.low if gap > 0 else iv.high - iv.point
    if n < 2 or gap == 0 or not (math.isfinite(gap) and math.isfinite(facing)):
        return None
    z = NormalDist().inv_cdf((1 + iv.level) / 2)
    per_prompt = facing / expansion(n, iv.level) * math.sqrt(n) * (z + NormalDist().inv_cdf(RESOLVE_POWER)) / z

    def resolves(m: int) -> bool:
        return per_prompt * expansion(m, iv.level) / math.sqrt(m) <= abs(gap)

    lo, hi = n, RESOLVE_CAP * n
    if not resolves(hi):
        return None
    while hi - lo > 1:  # the smallest m in (lo, hi] that resolves
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not resolves(mid) else (lo, mid)
    return hi

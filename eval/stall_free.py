"""A run's time without the stalls of a shared machine: what tau*'s timings are read from.

tau* = t_cycle / t_decode is a ratio of two costs of the hardware. On a machine others share (2 CPU cores in CI,
a laptop), a step sometimes waits for the cores: the wait is added to that step only, never taken away, and lands
on the plain run or the speculative one by chance, so one stalled prompt can move tau* and its interval by more
than the drafters differ. Every step of a run does the same work (one token, or one cycle of k drafts and their
verification), so a run's cost is read as its steps times the lower quartile of their durations: a stall of fewer
than three steps in four leaves it where it was, and on a quiet machine (a GPU, steps within a few percent of each
other) it is the run's own time to within that spread. Steps over ``STALL_FACTOR`` times that quartile are counted
and reported as stalled, so a noisy measurement says so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

QUANTILE = 0.25
STALL_FACTOR = 2.0


def _step(durations: Sequence[float]) -> float:
    """A step's time read past the stalls: the lower quartile of the run's step durations (0 without steps)."""
    return float(np.quantile(durations, QUANTILE)) if len(durations) else 0.0


def stall_free_s(durations: Sequence[float]) -> float:
    """The run's seconds: its steps times the lower quartile of their durations (0 for a run without steps)."""
    return len(durations) * _step(durations)


def stalled(durations: Sequence[float]) -> int:
    """Steps that took over STALL_FACTOR times the run's lower quartile."""
    return int((np.asarray(durations, dtype=float) > STALL_FACTOR * _step(durations)).sum())

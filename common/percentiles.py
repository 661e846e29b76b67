"""Nearest-rank percentiles: values that occurred (an answer's length, a conversation's span), not interpolations."""

from __future__ import annotations

from typing import TypeVar

PERCENTILES = (0, 50, 90, 99, 100)
V = TypeVar("V", int, float)


def percentiles(values: list[V]) -> dict[str, V]:
    """``{"0": min, "50": median, ..., "100": max}`` of ``values``; empty for none."""
    if not values:
        return {}
    ordered = sorted(values)
    return {str(p): ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in PERCENTILES}

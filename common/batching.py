"""Length-bucketed batches under a padded-token budget, the one rule for every place that pads rows to
the longest one: regeneration's ``generate`` calls, capture's target forwards and training batches.

Batch compositions are part of what capture writes (a recomputed shard must be byte-identical to the
first attempt), so this stays a pure function of its inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def length_batches(lengths: Sequence[int], budget: int, order: Iterable[int] | None = None) -> list[list[int]]:
    """Indices sorted by length and cut so that rows x longest <= ``budget``; a row longer than the budget
    is a batch of its own. A batch padded to one 4k-token row would otherwise cost 4k tokens per short row.

    ``order`` (default: every index, ascending) is what gets sorted. The sort is stable, so equal lengths
    keep their order in ``order``: by default ascending index, i.e. the key ``(lengths[i], i)``.
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)) if order is None else order, key=lengths.__getitem__):
        if batches and (len(batches[-1]) + 1) * lengths[i] <= budget:  # ascending: i is the longest
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches

"""Length batching: every row once, within the budget, and the exact compositions capture's stores
depend on (a resumed capture must cut the same batches to stay byte-identical)."""

from __future__ import annotations

import random

from common.batching import length_batches


def test_length_batches_cover_every_row_once_within_budget() -> None:
    lengths = [10, 500, 20, 5000, 30, 400, 990, 11]
    groups = length_batches(lengths, 1000)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 1000
    assert [3] in groups and len(groups) < len(lengths)


def test_equal_lengths_keep_index_order_or_the_given_order() -> None:
    lengths = [7, 3, 7, 3, 7, 3, 9]
    # By default ties go by index: the sort key (length, index) that capture uses.
    assert length_batches(lengths, 14) == [[1, 3, 5], [0, 2], [4], [6]]
    # With an order (the training sampler's shuffled window), ties keep their place in it.
    assert length_batches(lengths, 100, [6, 4, 5, 2, 3, 0, 1]) == [[5, 3, 1, 4, 2, 0, 6]]


def _reference(lengths: list[int], budget: int, order: list[int]) -> list[list[int]]:
    """The rule written out: rows by (length, place in order); close a batch before a row that would
    make rows x longest exceed the budget."""
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in sorted(order, key=lambda i: (lengths[i], order.index(i))):
        if cur and lengths[i] * (len(cur) + 1) > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + ([cur] if cur else [])


def test_batches_match_the_rule_on_random_inputs() -> None:
    rng = random.Random(0)
    for _ in range(300):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(0, 30))]
        budget = rng.randint(1, 120)
        order = list(range(len(lengths)))
        assert length_batches(lengths, budget) == _reference(lengths, budget, order)
        rng.shuffle(order)
        assert length_batches(lengths, budget, order) == _reference(lengths, budget, order)

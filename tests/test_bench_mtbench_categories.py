"""bench/mtbench_categories.py: MT-Bench's categories in the question file's order, and tau per category."""

from __future__ import annotations

import pytest

from bench.mtbench_categories import by_category, categories
from eval.intervals import Bootstrap


def test_the_wheel_holds_eight_categories_of_ten_questions_each() -> None:
    cats = categories()
    assert len(cats) == 80 and [cats.count(c) for c in dict.fromkeys(cats)] == [10] * 8
    assert cats[0] == "writing" and cats[-1] == "humanities"


def test_each_category_is_its_own_prompts_tokens_over_cycles() -> None:
    got = by_category([4.0, 2.0, 9.0, 3.0], [2.0, 2.0, 3.0, 1.0], ["a", "a", "b", "b"],
                      Bootstrap(level=0.95, samples=200, seed=0))
    assert got["a"]["tau"] == pytest.approx(1.5) and got["b"]["tau"] == pytest.approx(3.0)
    assert got["a"]["prompts"] == 2 and got["a"]["ci"][0] <= 1.5 <= got["a"]["ci"][1]

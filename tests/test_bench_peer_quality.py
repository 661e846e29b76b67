"""bench/peer_quality.py's record: our tau minus each peer row's, with a paired interval over the same prompts;
the per-prompt columns stay in the rows' own files."""

from __future__ import annotations

import pytest

from bench.peer_quality import ours_minus, without_columns
from eval.intervals import Bootstrap

BOOT = Bootstrap(level=0.95, samples=2000, seed=0)


def row(tokens: list[float], cycles: list[float]) -> dict:
    return {"training": {"tokens_seen": 100},
            "mtbench": {"tau": sum(tokens) / sum(cycles), "per_prompt": {"tokens": tokens, "cycles": cycles}}}


def test_a_drafter_ahead_on_every_prompt_clears_zero_and_a_tie_straddles_it() -> None:
    cycles = [10.0, 20.0, 15.0, 30.0, 12.0, 18.0, 25.0, 9.0]
    hard = [1.5, 3.0, 2.0, 4.0, 1.2, 2.5, 3.5, 1.0]  # prompt difficulty both drafters share
    ours = row([c * (h + 0.2) for c, h in zip(cycles, hard, strict=True)], cycles)
    ahead = row([c * h for c, h in zip(cycles, hard, strict=True)], cycles)
    mixed = row([c * (h + (0.3 if i % 2 else 0.1)) for i, (c, h) in enumerate(zip(cycles, hard, strict=True))],
                cycles)

    got = ours_minus({"ours": ours, "specforge": ahead, "specforge_shipped": mixed}, BOOT)

    better = got["specforge"]["mtbench"]
    assert better["point"] == pytest.approx(0.2) and 0 < better["ci"][0] <= 0.2 <= better["ci"][1]
    tie = got["specforge_shipped"]["mtbench"]
    assert tie["ci"][0] < 0 < tie["ci"][1] and tie["prompts"] == 8


def test_a_row_without_columns_has_no_difference_and_columns_leave_the_record() -> None:
    ours = row([3.0, 4.0], [1.0, 2.0])
    old = {"training": {"tokens_seen": 100}, "mtbench": {"tau": 2.0}}  # a row without per-prompt columns

    assert ours_minus({"ours": ours, "specforge": old}, BOOT) == {}
    assert without_columns(ours)["mtbench"] == {"tau": ours["mtbench"]["tau"]}

"""bench/loop_split.py: each verify cycle falls outside or inside the answer's tail loop by the first token it
produces, and the object names every drafter's split and each later drafter's paired difference from the first."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from bench import loop_split
from eval.intervals import Bootstrap

BOOT = Bootstrap(level=0.95, samples=200, seed=0)


def test_cycles_from_the_loops_first_copied_token_on_are_inside_it() -> None:
    tokens = [9, 5, 6] + [1, 2, 3] * 12  # the loop's copies start at index 6
    accepted = [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]  # cycles start at 1, 3, 6, 10, ...: two outside, eight inside
    got = loop_split.split_cycles(accepted, loop_split.cycles_in_loop(tokens, accepted, min_repeat_tokens=8,
                                                                      max_period=4))
    assert got == {"outside_loops": (5, 2), "in_loops": (32, 8)}
    no_loop = loop_split.cycles_in_loop(tokens[:6], [1, 1], 8, 4)
    assert loop_split.split_cycles([1, 1], no_loop) == {"outside_loops": (4, 2), "in_loops": (0, 0)}


def test_dataset_figures_read_each_part_apart_and_the_loops_share_of_cycles() -> None:
    rows = [([9, 5, 6] + [1, 2, 3] * 12, [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]), ([7, 8, 4, 2], [0, 1])]
    splits = [loop_split.split_cycles(a, loop_split.cycles_in_loop(t, a, 8, 4)) for t, a in rows]
    figs = loop_split.dataset_figures(loop_split.per_prompt_split(splits), BOOT)
    assert figs["outside_loops"]["tau"] == pytest.approx(8 / 4) and figs["outside_loops"]["prompts"] == 2
    assert figs["in_loops"]["tau"] == pytest.approx(4.0) and figs["in_loops"]["prompts"] == 1
    assert figs["tau"] == pytest.approx(40 / 12) and figs["loop_cycle_share"] == pytest.approx(8 / 12)


def test_in_loop_cycles_that_kept_no_draft_name_the_first_draft_and_the_targets_token() -> None:
    tokens = [9, 5, 6] + [1, 2, 3] * 12  # the loop's copies start at index 6
    accepted = [1, 2, 0, 3, 0, 3, 3, 3, 3, 3]  # the third and fifth cycles (at 6 and 11) keep no draft
    firsts = [5, 6, 7, 1, 7, 1, 2, 3, 1, 2]
    got = loop_split.refused_in_loops(tokens, accepted, firsts, loop_split.cycles_in_loop(tokens, accepted, 8, 4))
    assert got == {(7, 1): 1, (7, 3): 1}
    short = [0, 1, 3]  # only the first cycle kept nothing, before the loop
    outside = loop_split.refused_in_loops(tokens, short, [4, 6, 1], loop_split.cycles_in_loop(tokens, short, 8, 4))
    assert outside == {}


def test_refused_figures_are_text_commonest_first() -> None:
    class Letters:
        def decode(self, ids: list[int]) -> str:
            return "".join(chr(ord("a") + i) for i in ids)

    figs = loop_split.refused_figures(Counter({(7, 1): 1, (7, 3): 4, (0, 2): 2}), Letters(), top=2)
    assert figs == {"cycles": 7, "commonest": [{"draft": "h", "target": "d", "cycles": 4},
                                               {"draft": "a", "target": "c", "cycles": 2}]}


@pytest.mark.real
def test_one_object_per_run_with_every_drafters_split_and_differences_from_the_first(bench_results) -> None:
    """The real target and the shipped drafter on two MT-Bench prompts, loops of 16 tokens: the same drafter twice
    differs from itself by exactly 0 in both parts, and the parts' cycles add up to the whole."""
    ckpt = "drafters/smollm2-135m-eagle3"
    assert loop_split.main(["--config", "configs/smollm2-135m-h200.yaml", "--checkpoint", ckpt, ckpt,
                            "--set", "target.device=cpu", "--set", "eval.max_new_tokens=96",
                            "--set", "eval.datasets=[{name: mt, kind: mtbench}]", "--limit", "2",
                            "--set", "regenerate.loop_min_repeat_tokens=16", "--set", "regenerate.loop_keep_tokens=0",
                            "--name", "loop_split_test"]) == 0
    obj = json.loads(bench_results.read_text())["loop_split_test"]
    assert obj["checkpoints"] == [ckpt, ckpt] and obj["limit"] == 2
    assert obj["loop"] == {"min_repeat_tokens": 16, "max_period": 256}
    mt = obj["drafters"][ckpt]["mt"]
    cycles = mt["outside_loops"]["cycles"] + mt["in_loops"]["cycles"]
    assert cycles > 0 and mt["loop_cycle_share"] == pytest.approx(mt["in_loops"]["cycles"] / cycles)
    assert 1.0 <= mt["tau"] <= 4.0 and mt["outside_loops"]["prompts"] == 2
    assert obj["minus_first"][ckpt]["mt"]["outside_loops"]["point"] == 0.0
    assert 0 <= mt["refused_in_loops"]["cycles"] <= mt["in_loops"]["cycles"]

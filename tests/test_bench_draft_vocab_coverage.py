"""bench/draft_vocab_coverage.py: one object naming, per drafter and eval set, the target's greedy tokens outside
its draft vocab, on the real target."""

from __future__ import annotations

import json

import pytest

from bench import draft_vocab_coverage


@pytest.mark.real
def test_every_drafter_and_set_has_its_share_outside_the_draft_vocab(bench_results) -> None:
    ckpt = "drafters/smollm2-135m-eagle3"
    assert draft_vocab_coverage.main(["--config", "configs/smollm2-135m-h200.yaml", "--checkpoint", ckpt,
                                      "--set", "target.device=cpu", "--set", "eval.max_new_tokens=24",
                                      "--limit", "2", "--name", "draft_vocab_coverage_test"]) == 0
    obj = json.loads(bench_results.read_text())["draft_vocab_coverage_test"]
    assert obj["max_new_tokens"] == 24 and obj["target_vocab_size"] == 49152
    figs = obj["drafters"][ckpt]
    assert figs["draft_vocab_size"] == 16384
    assert set(figs) == {"draft_vocab_size", "mtbench", "mtbench_turn2", "humaneval"}
    for name in ("mtbench", "mtbench_turn2", "humaneval"):
        assert 2 <= figs[name]["tokens"] <= 48 and 0 <= figs[name]["outside"] <= figs[name]["tokens"]
        assert 0 <= figs[name]["prompts_with_any"] <= 2

"""bench/run_copy.py: the symbol tokens it picks, the cycles inside a run it counts from the first token each produces,
and the object it writes for real drafters on the real target."""

from __future__ import annotations

import json

import pytest

from bench import run_copy
from eval.batched_speculative import RowResult
from eval.intervals import Bootstrap

BOOT = Bootstrap(level=0.95, samples=200, seed=0)


class Table:
    """A tokenizer over a fixed list of token texts; encoding splits a text into the longest known pieces."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.texts[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        while text:
            i = max((i for i, t in enumerate(self.texts) if t and text.startswith(t)), key=lambda i: len(self.texts[i]))
            out.append(i)
            text = text[len(self.texts[i]):]
        return out


def test_symbol_tokens_are_short_punctuation_that_encodes_back_to_itself() -> None:
    texts = ["a", "=", " <<", "<<", "::", "a=", "....", " ", "=\n", "<", "==", " ="]
    got = [texts[i] for i in run_copy.symbol_tokens(Table(texts))]
    assert got == ["=", " <<", "<<", "::", "<", "==", " ="]


def test_cycles_count_from_the_first_token_each_produces() -> None:
    run = 7
    row = RowResult(tokens=[7, 7, 7, 7, 5, 7, 7, 7, 7, 7, 7], accepted=[2, 0, 1, 3], first_drafts=[7, 4, 9, 7])
    # cycles start at 1 (7), 4 (5), 5 (7), 7 (7): three inside the run, two of them drafted 7 first
    assert run_copy.copy_counts(row, run) == (3, 2)
    assert run_copy.continued(row.tokens, run) is True  # 10 of 11
    assert run_copy.continued([7] * 8 + [5, 5], run) is False
    assert run_copy.continued([], run) is False


def test_a_token_fails_when_fewer_than_half_its_run_cycles_drafted_it() -> None:
    good = RowResult(tokens=[1] * 17, accepted=[3, 3, 3, 3], first_drafts=[1, 1, 1, 1])
    bad = RowResult(tokens=[2] * 6, accepted=[0, 0, 0, 0, 0], first_drafts=[3, 3, 3, 2, 3])
    figs = run_copy.drafter_figures([good, bad], [1, 2], Table(["x", "=", "<<", "~"]), BOOT)
    assert figs["run_cycles"] == 9 and figs["first_draft_copies"] == pytest.approx(5 / 9)
    assert figs["tokens_judged"] == 2 and figs["tokens_failing"] == 1 and figs["failing"] == ["<<"]
    assert figs["tau"] == pytest.approx(23 / 9)


@pytest.mark.real
def test_one_object_with_every_drafters_figures_and_differences_from_the_first(bench_results) -> None:
    """The real target and the shipped drafter twice, on the first four symbol tokens' runs."""
    ckpt = "drafters/smollm2-135m-eagle3"
    assert run_copy.main(["--config", "configs/smollm2-135m-h200.yaml", "--checkpoint", ckpt, ckpt,
                          "--set", "target.device=cpu", "--limit", "4", "--max-new", "12",
                          "--name", "run_copy_test"]) == 0
    obj = json.loads(bench_results.read_text())["run_copy_test"]
    assert obj["symbol_tokens"] == 4 and 0 < obj["runs_continued"] <= 4
    figs = obj["drafters"][ckpt]
    assert 1.0 <= figs["tau"] <= 4.0 and 0 < figs["run_cycles"] and 0.0 <= figs["first_draft_copies"] <= 1.0
    assert figs["tokens_failing"] == len(figs["failing"]) <= figs["tokens_judged"]
    assert obj["minus_first"][ckpt]["point"] == 0.0

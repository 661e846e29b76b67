"""bench/run_copy.py: the symbol tokens it picks, the cycles inside a run it counts from the first token each produces,
and the object it writes for real drafters on the real target."""

from __future__ import annotations

import json

import pytest
import torch
from table_tokenizer import Table

from bench import run_copy
from eval.batched_speculative import RowResult
from eval.intervals import Bootstrap, ratio_estimate

BOOT = Bootstrap(level=0.95, samples=200, seed=0)


def test_cycles_count_from_the_first_token_each_produces() -> None:
    run = 7
    row = RowResult(tokens=[7, 7, 7, 7, 5, 7, 7, 7, 7, 7, 7], accepted=[2, 0, 1, 3], first_drafts=[7, 4, 9, 7])
    # cycles start at 1 (7), 4 (5), 5 (7), 7 (7): three inside the run, two of them drafted 7 first
    assert run_copy.copy_counts(row, run) == (3, 2)


def test_a_token_fails_when_fewer_than_half_its_run_cycles_drafted_it() -> None:
    good = RowResult(tokens=[1] * 17, accepted=[3, 3, 3, 3], first_drafts=[1, 1, 1, 1])
    bad = RowResult(tokens=[2] * 6, accepted=[0, 0, 0, 0, 0], first_drafts=[3, 3, 3, 2, 3])
    every = torch.ones(4, dtype=torch.bool)
    figs = run_copy.drafter_figures([good, bad], [1, 2], Table(["x", "=", "<<", "~"]), BOOT, every)
    assert figs["run_cycles"] == 9 and figs["first_draft_copies"] == pytest.approx(5 / 9)
    assert figs["tokens_judged"] == 2 and figs["tokens_failing"] == 1 and figs["failing"] == ["<<"]
    assert figs["tau"] == pytest.approx(23 / 9)
    assert figs["tokens_outside_draft_vocab"] == 0  # every token proposable: the in-vocab figures are the same
    assert figs["in_draft_vocab"] == {"rows": 2} | {k: v for k, v in figs.items() if k in figs["in_draft_vocab"]}


def test_tokens_outside_the_draft_vocab_are_counted_and_left_out_of_the_in_vocab_figures() -> None:
    good = RowResult(tokens=[1] * 17, accepted=[3, 3, 3, 3], first_drafts=[1, 1, 1, 1])  # "=": copied, in vocab
    bad = RowResult(tokens=[2] * 6, accepted=[0, 0, 0, 0, 0], first_drafts=[3, 3, 3, 2, 3])  # "<<": fails, in vocab
    never = RowResult(tokens=[3] * 7, accepted=[1, 0, 0, 0, 0], first_drafts=[0, 0, 0, 0, 0])  # "~": outside
    draft_vocab = torch.tensor([True, True, True, False])
    figs = run_copy.drafter_figures([good, never, bad], [1, 3, 2], Table(["x", "=", "<<", "~"]), BOOT, draft_vocab)
    # over every row: 4 + 5 + 5 cycles inside the runs, 4 + 0 + 1 drafted the run's token first; "~" and "<<" fail
    assert figs["run_cycles"] == 14 and figs["first_draft_copies"] == pytest.approx(5 / 14)
    assert figs["tokens_judged"] == 3 and figs["failing"] == ["~", "<<"] and figs["tau"] == pytest.approx(30 / 14)
    assert figs["tokens_outside_draft_vocab"] == 1
    inside = figs["in_draft_vocab"]
    assert inside["rows"] == 2 and inside["run_cycles"] == 9 and inside["first_draft_copies"] == pytest.approx(5 / 9)
    assert inside["tokens_judged"] == 2 and inside["tokens_failing"] == 1 and inside["failing"] == ["<<"]
    iv = ratio_estimate([17, 6], [4, 5], BOOT).interval(BOOT.level)  # the same interval, over the in-vocab rows only
    assert inside["tau"] == pytest.approx(23 / 9) and inside["ci"] == pytest.approx([iv.low, iv.high])
    assert inside["ci"] != pytest.approx(figs["ci"])


def test_a_drafter_whose_vocab_holds_no_run_token_has_empty_in_vocab_figures() -> None:
    row = RowResult(tokens=[2] * 6, accepted=[0, 0, 0, 0, 0], first_drafts=[3, 3, 3, 2, 3])
    figs = run_copy.drafter_figures([row], [2], Table(["x", "=", "<<", "~"]), BOOT, torch.tensor([1, 1, 0, 1]).bool())
    assert figs["tokens_outside_draft_vocab"] == 1 and figs["tokens_failing"] == 1
    inside = figs["in_draft_vocab"]
    assert inside["rows"] == 0 and inside["run_cycles"] == 0
    assert inside["tokens_judged"] == 0 and inside["failing"] == []


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
    inside = figs["in_draft_vocab"]
    assert inside["rows"] + figs["tokens_outside_draft_vocab"] == obj["runs_continued"]
    assert set(inside["failing"]) <= set(figs["failing"])
    assert obj["minus_first"][ckpt]["point"] == 0.0

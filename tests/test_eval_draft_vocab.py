"""eval/draft_vocab.py: the target tokens a drafter can never draft, counted over the target's own outputs."""

from __future__ import annotations

import torch
from table_tokenizer import Table

from eval.draft_vocab import draft_vocab_mask, outside_draft_vocab


def test_the_draft_vocab_mask_is_the_drafters_t2d() -> None:
    class Drafter:
        t2d = torch.tensor([False, True, True, False])

    assert draft_vocab_mask(Drafter()).tolist() == [False, True, True, False]


def test_tokens_outside_the_draft_vocab_are_counted_per_output_with_the_commonest_named() -> None:
    vocab = torch.tensor([True, True, False, False])  # ids 2 ("<<") and 3 ("~") cannot be drafted
    figs = outside_draft_vocab([[0, 2, 1, 3, 3], [1, 1], [3]], vocab, Table(["x", "=", "<<", "~"]), top=1)
    assert figs["tokens"] == 8 and figs["outside"] == 4 and figs["share"] == 0.5
    assert figs["prompts_with_any"] == 2  # the second output lies wholly inside
    assert figs["commonest"] == [{"token": "~", "count": 3}]


def test_a_drafter_covering_every_token_misses_none() -> None:
    figs = outside_draft_vocab([[0, 1], []], torch.ones(2, dtype=torch.bool), Table(["x", "="]))
    assert figs == {"tokens": 2, "outside": 0, "share": 0.0, "prompts_with_any": 0, "commonest": []}
    assert outside_draft_vocab([], torch.ones(2, dtype=torch.bool), Table(["x", "="]))["share"] == 0.0

"""The draft vocabulary: the most frequent ids, ties by id, padding, SGLang's offset convention, problems."""

from __future__ import annotations

import pytest
import torch

from drafter.vocab_map import build_vocab_map, draft_to_target_ids, vocab_map_problems


def test_most_frequent_ids_with_ties_by_lower_id() -> None:
    counts = torch.zeros(20, dtype=torch.long)
    counts[[17, 3, 11, 5, 8]] = torch.tensor([9, 4, 4, 4, 1])  # 3, 5 and 11 tie; 8 is least frequent
    d2t, t2d = build_vocab_map(counts, 3)
    assert draft_to_target_ids(d2t).tolist() == [3, 5, 17]  # ascending ids; 11 loses the tie to 3 and 5
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == [3, 5, 17]
    assert d2t.tolist() == [3 - 0, 5 - 1, 17 - 2]  # target_id = i + d2t[i]


def test_matches_a_plain_python_reference() -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (300,), generator=g)  # many ties and zeros
    d2t, t2d = build_vocab_map(counts, 64)
    ranked = sorted(range(300), key=lambda i: (-int(counts[i]), i))
    seen = [i for i in ranked if counts[i] > 0][:64]
    want = sorted(seen + [i for i in range(300) if i not in seen][: 64 - len(seen)])
    assert draft_to_target_ids(d2t).tolist() == want
    assert vocab_map_problems(d2t, t2d) == []


def test_pads_with_lowest_unused_ids_when_few_tokens_seen() -> None:
    counts = torch.zeros(10, dtype=torch.long)
    counts[[7, 2]] = torch.tensor([1, 5])
    d2t, t2d = build_vocab_map(counts, 5)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 3, 7]
    assert int(t2d.sum()) == 5 and vocab_map_problems(d2t, t2d) == []
    # No counts at all still yields a valid map (the first ids).
    assert draft_to_target_ids(build_vocab_map(torch.zeros(10), 4)[0]).tolist() == [0, 1, 2, 3]


def test_full_vocab_is_identity() -> None:
    d2t, t2d = build_vocab_map(torch.randint(0, 9, (50,)), 50)
    assert torch.equal(d2t, torch.zeros(50, dtype=torch.long)) and bool(t2d.all())


def test_draft_vocab_larger_than_vocab_is_an_error() -> None:
    with pytest.raises(ValueError, match="exceeds the target vocab 10"):
        build_vocab_map(torch.ones(10), 11)


def _good() -> tuple[torch.Tensor, torch.Tensor]:
    return build_vocab_map(torch.arange(30), 8)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda d2t, t2d: d2t.__setitem__(7, 100), "outside the target vocab [0, 30)"),
    (lambda d2t, t2d: d2t.__setitem__(0, -5), "outside the target vocab"),
    (lambda d2t, t2d: d2t.__setitem__(1, d2t[0] - 1), "two draft ids to the same target id"),
    (lambda d2t, t2d: t2d.__setitem__(0, True), "t2d marks 9 target ids, d2t has 8"),
    (lambda d2t, t2d: (t2d.__setitem__(29, False), t2d.__setitem__(0, True)), "does not mark every target id"),
])
def test_problems_are_detected(edit, message: str) -> None:
    d2t, t2d = _good()
    assert vocab_map_problems(d2t, t2d) == []
    edit(d2t, t2d)
    problems = vocab_map_problems(d2t, t2d)
    assert len(problems) == 1 and message in problems[0], problems

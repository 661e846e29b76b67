"""Teacher forcing replays real decoding: at T = 0 every verify cycle's accepted count equals the chain that
the TTT unroll (training's own code) gives at the cycle's start, so a train/decode mismatch shows up as
disagreement; and the counts reduce to the same alpha as eval's histogram."""

from __future__ import annotations

import pytest
import torch
from tiny_speculative import TinyTokenizer, tiny_target_and_drafter

from eval import metrics
from eval.decode_gap import ChainCounts, cycle_columns, measure_gap, replayed_lengths
from target_model.hf_model import TargetModel

V, AUX, K, NEW = 12, (0, 1, 2), 3, 30


@pytest.fixture(scope="module")
def pair() -> tuple[TargetModel, object]:
    target, drafter = tiny_target_and_drafter(V, AUX)
    return TargetModel(target, TinyTokenizer(eos_token_id=None), "tiny", None), drafter  # answers run to NEW


def _prompts(n: int = 10) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, V, (int(m),), generator=g).tolist() for m in torch.randint(2, 20, (n,), generator=g)]


def test_cycle_columns_and_replay() -> None:
    assert cycle_columns([2, 0, 3]) == [0, 3, 4]
    correct = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 0, 0, 1, 1, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    scored = torch.ones_like(correct)
    scored[2, 5] = False
    assert replayed_lengths(correct, scored, [0, 1, 3, 5, 9], 3) == [2, 1, 3, None, None]


def test_decode_counts_reduce_to_eval_alpha() -> None:
    accepted = [0, 3, 1, 2, 2, 0, 3]
    c = ChainCounts(3)
    for a in accepted:
        c.add(torch.tensor([[i < a] for i in range(3)]), torch.ones(3, 1, dtype=torch.bool))
    hist = metrics.histogram(accepted, 3)
    assert c.conditional() == [round(x, 4) for x in metrics.conditional_rates(hist)]
    assert c.tau() == pytest.approx(metrics.tau_from_histogram(hist), abs=1e-4)


def test_every_cycle_replays_exactly_on_todays_engine(pair) -> None:
    target, drafter = pair
    gap = measure_gap(target, drafter, AUX, {"random": _prompts()}, K, NEW)["random"]
    assert gap["cycles_compared"] > 50 and gap["rows_skipped_diverged"] == 0
    assert gap["replay_agreement"] == 1.0, gap["disagreements"]
    assert gap["teacher_forced_acc_at_cycle_starts"] == gap["decode_alpha"]
    assert sum(gap["decode_alpha"]) > 0  # a 12-token vocab: drafts do get accepted


def test_a_feature_mismatch_shows_as_disagreement(pair) -> None:
    """Decoding fed other aux layers than training read: the replay must disagree."""
    target, drafter = pair
    from eval import decode_gap

    real = decode_gap.teacher_forced

    def forced_on_other_layers(t, d, aux_ids, prompt, answer, steps):
        return real(t, d, (1, 2, 3), prompt, answer, steps)

    decode_gap.teacher_forced = forced_on_other_layers
    try:
        gap = measure_gap(target, drafter, AUX, {"random": _prompts()}, K, NEW)["random"]
    finally:
        decode_gap.teacher_forced = real
    assert gap["replay_agreement"] < 0.99 and gap["disagreements"]

"""The batched speculative engine runs, per row, exactly the batch-1 engine's cycle: same tokens and the
same drafts kept per cycle, greedy and at T > 0 under both acceptance rules (SGLang's, with greedy drafts, and
speculative sampling, with sampled drafts), for prompts of different lengths in one batch."""

from __future__ import annotations

import pytest
import torch
from tiny_speculative import TinyTokenizer, tiny_target_and_drafter
from transformers import LlamaForCausalLM

from engine.batched import BatchedTarget
from eval.batched_speculative import _groups, speculative_batch
from eval.speculative import Eagle3Proposer, Engine
from target_model.hf_model import TargetModel

V, AUX, K, NEW = 12, (0, 1, 2), 3, 30


@pytest.fixture(scope="module")
def pair() -> tuple[LlamaForCausalLM, object]:
    """A tiny target with a 12-token vocab and a random drafter: small enough that drafts often match."""
    return tiny_target_and_drafter(V, AUX)


@pytest.mark.parametrize(("temperature", "rule"), [(0.0, "sglang"), (1.0, "sglang"), (1.0, "speculative_sampling")])
def test_batched_rows_equal_the_batch1_engine(pair, temperature: float, rule: str) -> None:
    target, drafter = pair
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, V, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (12,), generator=g)]
    batched = speculative_batch(BatchedTarget(target, AUX), drafter, prompts, K, NEW, [1], temperature, seed=5,
                                acceptance=rule)
    engine = Engine(TargetModel(target, TinyTokenizer(), "tiny", None), AUX, [1])
    proposer = Eagle3Proposer(drafter, AUX)
    kept = 0
    for i, p in enumerate(prompts):
        one = engine.speculative(proposer, p, K, NEW, temperature, torch.Generator().manual_seed(5 * 1_000_003 + i),
                                 acceptance=rule)
        assert (batched[i].tokens, batched[i].accepted) == (one.tokens, one.accepted), f"row {i}"
        kept += sum(one.accepted)
    assert kept > 0 or temperature == 0.0  # sampled drafts from a 12-token vocab do get accepted


def test_prefill_groups_respect_the_token_budget() -> None:
    assert _groups([5, 5, 5, 9, 2], 16) == [(0, 3), (3, 4), (4, 5)]
    assert _groups([30], 16) == [(0, 1)]


def test_acceptance_report_is_lossless_against_batched_greedy(pair) -> None:
    from eval.batched_eval import acceptance, greedy_references

    target, drafter = pair
    tm = TargetModel(target, TinyTokenizer(), "tiny", None)
    g = torch.Generator().manual_seed(2)
    prompts = {"a": [torch.randint(2, V, (int(n),), generator=g).tolist() for n in (3, 9, 15)], "b": [[4, 5, 6]]}
    refs = greedy_references(tm, prompts, NEW)
    report = acceptance(tm, drafter, AUX, prompts, K, 0.0, NEW, refs)
    assert set(report) == {"a", "b"} and report["a"]["prompts"] == 3
    assert report["a"]["lossless_mismatches"] == [] and report["b"]["lossless_mismatches"] == []
    assert report["a"]["cycles"] == sum(report["a"]["histogram"]) > 0


def test_greedy_references_carry_the_plain_loops_margins(pair) -> None:
    """The batched greedy reference has, token for token, the batch-1 plain loop's tokens and top-1/top-2
    margins (the stop token's included), so the batched lossless check can tell near-ties from mismatches."""
    from eval.batched_eval import greedy_references

    target, _ = pair
    tm = TargetModel(target, TinyTokenizer(), "tiny", None)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, V, (int(n),), generator=g).tolist() for n in (4, 11, 17)]
    refs = greedy_references(tm, {"a": prompts}, NEW)["a"]
    engine = Engine(tm, AUX, [1])
    for p, ref in zip(prompts, refs, strict=True):
        plain = engine.plain(p, NEW)
        assert ref.tokens == plain.tokens and len(ref.margins) == len(plain.margins) == len(ref.tokens)
        assert ref.margins == pytest.approx(plain.margins, abs=1e-4)


def test_greedy_references_are_kept_for_the_next_eval_of_the_target(pair, tmp_path, monkeypatch, capsys) -> None:
    """GreedyReferences generates a dataset's references on first use and keeps them: the next eval of the same
    target, prompts and budget reads them (tokens and margins equal) and generates nothing; other prompts, another
    budget or a damaged entry are generated again."""
    import eval.batched_eval as be

    target, _ = pair
    tm = TargetModel(target, TinyTokenizer(), "tiny", None)
    prompts = {"a": [[3, 4, 5], [6, 7, 8, 9]], "b": [[5, 5]]}
    first = be.GreedyReferences(tm, prompts, NEW, tmp_path)
    made = {name: first[name] for name in first}  # a Mapping: what acceptance() takes as references
    assert len(list(tmp_path.glob("*.json"))) == 2

    real = be.greedy_references
    calls = []

    def counted(*args, **kwargs):
        calls.append(list(args[1]))
        return real(*args, **kwargs)

    monkeypatch.setattr(be, "greedy_references", counted)
    capsys.readouterr()
    again = be.GreedyReferences(tm, prompts, NEW, tmp_path)
    for name in prompts:
        assert [(g.tokens, g.margins) for g in again[name]] == [(g.tokens, g.margins) for g in made[name]]
    assert calls == [] and f"greedy references: a read from {tmp_path}" in capsys.readouterr().out
    be.GreedyReferences(tm, prompts, NEW - 1, tmp_path)["a"]  # another budget: another entry
    be.GreedyReferences(tm, {"a": [[3, 4, 6]]}, NEW, tmp_path)["a"]  # other prompts: another entry
    assert calls == [["a"], ["a"]]
    for f in tmp_path.glob("*.json"):
        f.write_text("[1, 2")  # torn
    assert be.GreedyReferences(tm, prompts, NEW, tmp_path)["b"][0].tokens == made["b"][0].tokens
    assert calls[-1] == ["b"] and "unreadable" in capsys.readouterr().out


def test_the_oracle_keeps_every_greedy_draft_and_is_lossless(pair) -> None:
    """drafter None drafts the target's own greedy tokens: at T = 0 every cycle keeps all k drafts until the answer
    ends, and the output is the target's greedy output."""
    from eval.batched_eval import greedy_references

    target, _ = pair
    tm = TargetModel(target, TinyTokenizer(), "tiny", None)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, V, (int(n),), generator=g).tolist() for n in (3, 8, 14, 19)]
    refs = greedy_references(tm, {"a": prompts}, NEW)["a"]
    rows = speculative_batch(BatchedTarget(target, AUX), None, prompts, K, NEW, [1])
    for row, ref in zip(rows, refs, strict=True):
        assert row.tokens == ref.tokens
        assert all(a == K for a in row.accepted[:-1]), row.accepted  # the last cycle may end inside its drafts


def test_the_oracle_is_the_ceiling_at_t1_under_sglangs_rule(pair) -> None:
    """At T = 1 SGLang keeps a greedy draft d with probability p(d): the oracle's drafts (the target's argmax, the
    largest p) are kept more often than a drafter's, on the same prompts and seeds."""
    from eval.batched_eval import acceptance

    target, drafter = pair
    tm = TargetModel(target, TinyTokenizer(), "tiny", None)
    g = torch.Generator().manual_seed(6)
    prompts = {"a": [torch.randint(2, V, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (16,),
                                                                                                  generator=g)]}
    oracle = acceptance(tm, None, AUX, prompts, K, 1.0, NEW)["a"]
    drafted = acceptance(tm, drafter, AUX, prompts, K, 1.0, NEW)["a"]
    assert oracle["tau"] > drafted["tau"] >= 1.0
    with pytest.raises(ValueError, match="the oracle drafts greedily"):
        speculative_batch(BatchedTarget(target, AUX), None, prompts["a"], K, NEW, [1], 1.0,
                          acceptance="speculative_sampling")

"""The speculative engine: the drafter's KV cache matches full recomputation; with the real SmolLM2
target, T=0 speculative output equals greedy decoding and tau is exactly what the proposer earns."""

from __future__ import annotations

import pytest
import torch

from drafter.factory import fresh_drafter, shape_for_target
from drafter.model import causal_mask
from drafter.vocab_map import build_vocab_map
from eval import metrics
from eval.prompts import render
from eval.speculative import Draft, Eagle3Proposer, Engine
from target_model.aux_layers import default_aux_layer_ids
from target_model.hf_model import stop_token_ids

K = 3


def test_extend_in_chunks_with_rollback_equals_one_pass(tiny_drafter):
    torch.manual_seed(1)
    m, h3 = 9, 3 * tiny_drafter.shape.hidden_size
    aux, toks = torch.randn(m, h3), torch.randint(0, 97, (m,))
    one = Eagle3Proposer(tiny_drafter, (0, 1, 2))
    one.extend(toks, aux, 0)
    chunked = Eagle3Proposer(tiny_drafter, (0, 1, 2))
    chunked.extend(toks[:4], aux[:4], 0)
    chunked.extend(torch.randint(0, 97, (3,)), torch.randn(3, h3), 4)  # rejected later: rolled back
    chunked.extend(toks[4:], aux[4:], 4)
    assert chunked.length == one.length == m
    torch.testing.assert_close(chunked.keys, one.keys)
    torch.testing.assert_close(chunked.last, one.last)
    with pytest.raises(ValueError, match="gap"):
        chunked.extend(toks[:1], aux[:1], m + 1)


def test_chain_drafts_equal_uncached_recomputation(tiny_drafter):
    """Draft step i at RoPE position t+i, reading the previous step's prenorm and draft token."""
    torch.manual_seed(2)
    d, m = tiny_drafter, 6
    aux, toks = torch.randn(m, 3 * d.shape.hidden_size), torch.randint(0, 97, (m,))
    prop = Eagle3Proposer(d, (0, 1, 2))
    prop.extend(toks, aux, 0)
    draft = prop.propose(4, 0.0, None)
    hidden, ids = d.project_aux(aux[None]), toks[None]
    expect = []
    with torch.no_grad():
        for _ in range(4):
            n = hidden.shape[1]
            out = d.step(ids, hidden, torch.arange(n)[None], mask=causal_mask(n, 0))
            tok = int(d.to_target_ids(d.logits(out.prenorm[:, -1]).argmax(-1)))
            expect.append(tok)
            hidden = torch.cat([hidden, out.prenorm[:, -1:]], 1)
            ids = torch.cat([ids, torch.tensor([[tok]])], 1)
    assert draft.tokens == expect
    assert prop.length == m and prop.keys.shape[2] == m  # draft steps left no cache entries
    sampled = prop.propose(4, 0.7, torch.Generator().manual_seed(0))
    assert sampled.probs.shape == (4, 97)
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(4))
    assert not sampled.probs[:, ~d.t2d].any()  # zero probability outside the draft vocab


class ScriptedProposer:
    """Proposes the target's own greedy continuation (``right(cycle, i)``) or a wrong token otherwise:
    an oracle, an always-wrong drafter, or anything in between, for exact expectations."""

    def __init__(self, reference: list[int], vocab: int, right=lambda cycle, i: True):
        self.reference, self.vocab, self.right = reference, vocab, right

    def reset(self) -> None:
        self.known, self.cycle, self.calls = 0, 0, []

    def extend(self, tokens: torch.Tensor, aux: torch.Tensor, start: int) -> None:
        self.known = start + tokens.numel() + 1  # positions 0..start+m-1 plus the token after the last
        self.calls.append((start, tokens.clone(), aux.clone()))

    def propose(self, k: int, temperature: float, generator) -> Draft:
        toks = []
        for i in range(k):
            truth = self.reference[self.known + i] if self.known + i < len(self.reference) else 0
            toks.append(truth if self.right(self.cycle, i) else (truth + 1) % self.vocab)
        self.cycle += 1
        return Draft(toks, None)


@pytest.fixture(scope="module")
def setup(smollm2):
    ids = default_aux_layer_ids(smollm2.num_layers)
    engine = Engine(smollm2, ids, stop_token_ids(smollm2.tokenizer))
    prompt = render(smollm2.tokenizer, "Explain in detail how a bicycle works, step by step.")
    return engine, prompt, ids


@pytest.fixture(scope="module")
def greedy(setup):
    engine, prompt, _ = setup
    return engine.plain(prompt, 24)


@pytest.mark.real
def test_random_eagle3_drafter_is_lossless(setup, greedy, smollm2):
    engine, prompt, ids = setup
    assert len(greedy.tokens) == 24 and greedy.steps == 23  # no early EOS: every cycle below is full-length
    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 8192)
    drafter = fresh_drafter(shape_for_target(smollm2.hf_config, 8192, ids), smollm2.embed_weight().detach(),
                            d2t, t2d)
    gen = engine.speculative(Eagle3Proposer(drafter, ids), prompt, K, 24)
    assert gen.tokens == greedy.tokens
    assert gen.cycle_tokens >= 23 and gen.draft_s > 0 and gen.verify_s > 0


@pytest.mark.real
def test_oracle_gives_tau_k_plus_1_and_wrong_gives_1(setup, greedy, smollm2):
    engine, prompt, _ = setup
    ref = list(prompt) + greedy.tokens
    oracle = engine.speculative(ScriptedProposer(ref, smollm2.vocab_size), prompt, K, 1 + 5 * (K + 1))
    assert oracle.tokens == greedy.tokens[: 1 + 5 * (K + 1)]
    hist = metrics.histogram(oracle.accepted, K)
    assert hist == [0, 0, 0, 5] and metrics.tau_from_histogram(hist) == K + 1
    wrong = engine.speculative(ScriptedProposer(ref, smollm2.vocab_size, lambda c, i: False), prompt, K, 12)
    hist = metrics.histogram(wrong.accepted, K)
    assert hist == [11, 0, 0, 0] and metrics.tau_from_histogram(hist) == 1.0
    assert wrong.tokens == greedy.tokens[:12]


@pytest.mark.real
def test_partly_right_drafter_is_lossless_with_every_rejection_point(setup, greedy, smollm2):
    """The 'trained' stand-in: the first wrong draft moves through positions 0..k, so the target and
    drafter caches are cropped/re-extended at every length."""
    engine, prompt, _ = setup
    ref = list(prompt) + greedy.tokens
    prop = ScriptedProposer(ref, smollm2.vocab_size, lambda c, i: i < c % (K + 1))
    gen = engine.speculative(prop, prompt, K, 24)
    assert gen.tokens == greedy.tokens
    assert gen.accepted[: K + 1] == [0, 1, 2, 3]
    # The proposer was told, for every position t exactly once and in order, the target's aux at t
    # and token t+1 (ARCHITECTURE.md's convention), as a one-pass forward over the whole text has them.
    full = smollm2.forward(torch.tensor([ref]), engine.aux_ids, logits=False).aux[0]
    seen = 0
    for start, tokens, aux in prop.calls:
        assert start == seen
        seen = start + tokens.numel()
        assert tokens.tolist() == ref[start + 1: seen + 1]
        torch.testing.assert_close(aux, full[start:seen], atol=1e-3, rtol=1e-3)
    before_last = 1 + sum(a + 1 for a in gen.accepted[:-1])  # the last cycle ends generation: no extend
    assert seen == len(prompt) + before_last - 1


@pytest.mark.real
def test_sampled_decoding_with_the_eagle3_proposer_runs_to_the_budget(setup, smollm2):
    engine, prompt, ids = setup
    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 1024)
    drafter = fresh_drafter(shape_for_target(smollm2.hf_config, 1024, ids), smollm2.embed_weight().detach(), d2t, t2d)
    gen = engine.speculative(Eagle3Proposer(drafter, ids), prompt, K, 10, 0.8, torch.Generator().manual_seed(0))
    assert 1 <= len(gen.tokens) <= 10 and all(0 <= a <= K for a in gen.accepted)
    assert len(gen.tokens) == 10 or gen.tokens[-1] in engine.stop_ids

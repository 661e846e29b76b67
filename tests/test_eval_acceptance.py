"""The acceptance rules (one signature, chosen by name) and the lossless check with near-ties.

At T > 0 SGLang drafts greedily and keeps a draft d with probability p(d); after a rejection its kernel
samples p without d (sgl-kernel ``TreeSpeculativeSamplingTargetOnly`` with zero draft probs). Measured here
on a hand-made p: the acceptance rate is p(d), and the emitted token is distributed as p (the rule is
standard speculative sampling with a one-hot q). bench/sglang_acceptance.py measures the same at 100,000
draws and writes the figures to bench/results.json.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eval.lossless import check
from eval.speculative import (
    ACCEPTANCE_RULES,
    Draft,
    Engine,
    accept_greedy,
    accept_sampled,
    accept_sglang,
    acceptance_rule,
)
from target_model.hf_model import TargetModel

T = 0.8
LOGITS = torch.tensor([[1.5, 0.2, -0.3, 0.9, -1.0, 0.0],   # p0: argmax 0; the draft proposes 3 (p0(3) = 0.24)
                       [0.1, 1.2, 0.4, -0.5, 0.8, -0.2],   # p1 after the first draft
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])    # bonus row
DRAFT = [3, 1]
CHI2_5DOF_P001 = 20.52  # chi-square critical value, 5 degrees of freedom, p = 0.001


def draws(rule, n: int, seed: int = 0, draft=None) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    return [rule(LOGITS, draft or Draft(DRAFT, None), T, g) for _ in range(n)]


def test_sglang_rule_accepts_d_with_probability_p_of_d():
    p = torch.softmax(LOGITS / T, -1)
    n = 10_000
    out = draws(accept_sglang, n)
    first = sum(a >= 1 for a, _ in out) / n
    both = sum(a == 2 for a, _ in out) / n
    for rate, want in ((first, float(p[0, 3])), (both, float(p[0, 3] * p[1, 1]))):
        sigma = math.sqrt(want * (1 - want) / n)  # binomial standard deviation of the observed rate
        assert abs(rate - want) <= 4 * sigma, (rate, want, sigma)


def test_sglang_rule_output_distribution_is_the_targets():
    """The finding, measured: the first emitted token follows p0; after a rejection the resample is p0
    without d renormalised; the second token (given the first draft kept) follows p1."""
    p = torch.softmax(LOGITS / T, -1)
    n = 10_000
    out = draws(accept_sglang, n, seed=1)
    first = torch.bincount(torch.tensor([DRAFT[0] if a >= 1 else nxt for a, nxt in out]), minlength=6).float()
    chi2 = float(((first - n * p[0]) ** 2 / (n * p[0])).sum())
    assert chi2 < CHI2_5DOF_P001, (chi2, (first / n).tolist(), p[0].tolist())
    after_reject = torch.bincount(torch.tensor([nxt for a, nxt in out if a == 0]), minlength=6).float()
    assert after_reject[DRAFT[0]] == 0  # the rejected draft is never resampled
    residual = p[0].clone()
    residual[DRAFT[0]] = 0
    residual /= residual.sum()
    m = after_reject.sum()
    keep = residual > 0
    chi2 = float(((after_reject[keep] - m * residual[keep]) ** 2 / (m * residual[keep])).sum())
    assert chi2 < 18.47, chi2  # 4 dof, p = 0.001
    second = torch.bincount(torch.tensor([DRAFT[1] if a == 2 else nxt for a, nxt in out if a >= 1]),
                            minlength=6).float()
    m = second.sum()
    chi2 = float(((second - m * p[1]) ** 2 / (m * p[1])).sum())
    assert chi2 < CHI2_5DOF_P001, chi2


def test_the_rules_differ_in_acceptance_not_in_output():
    """min(1, p/q) with drafts sampled from q accepts sum(min(p, q)) of the time, SGLang's greedy draft
    p(argmax q): the tau an eval reports depends on the rule, which is why SGLang's is the default."""
    p = torch.softmax(LOGITS / T, -1)
    q = torch.tensor([0.05, 0.05, 0.05, 0.7, 0.05, 0.1])  # the drafter's belief; its argmax is DRAFT[0]
    g = torch.Generator().manual_seed(2)
    n = 10_000
    kept = 0
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g))
        a, _ = accept_sampled(LOGITS[[0, 2]], Draft([d], q[None]), T, g)
        kept += a
    ours, sglang = float(torch.minimum(p[0], q).sum()), float(p[0, 3])
    assert abs(kept / n - ours) < 0.02 and abs(ours - sglang) > 0.1


def test_one_signature_selected_by_name():
    g = torch.Generator().manual_seed(0)
    for name, rule in ACCEPTANCE_RULES.items():
        a, nxt = rule(LOGITS, Draft(DRAFT, None), T, g)
        assert 0 <= a <= 2 and 0 <= nxt < 6, name
        assert rule(LOGITS, DRAFT, T, g)[0] in (0, 1, 2)  # a plain token list works too
    assert acceptance_rule("sglang", 0.7) == (accept_sglang, False)  # greedy drafts
    assert acceptance_rule("speculative_sampling", 0.7) == (accept_sampled, True)  # drafts sampled from q
    assert acceptance_rule("sglang", 0.0) == (accept_greedy, False) == acceptance_rule("speculative_sampling", 0)
    with pytest.raises(ValueError, match="eval.acceptance"):
        acceptance_rule("typo", 0.7)


class RecordingProposer:
    """Proposes fixed tokens and records the temperature it was asked to draft at."""

    def __init__(self):
        self.temperatures: list[float] = []

    def reset(self) -> None:
        pass

    def extend(self, tokens, aux, start) -> None:
        pass

    def propose(self, k, temperature, generator) -> Draft:
        self.temperatures.append(temperature)
        return Draft([1] * k, None)


@pytest.mark.parametrize(("rule", "draft_temperature"), [("sglang", 0.0), ("speculative_sampling", 0.9)])
def test_engine_drafts_greedily_under_sglangs_rule(rule: str, draft_temperature: float):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50)
    engine = Engine(TargetModel(LlamaForCausalLM(cfg), None, "tiny", None), (0, 1, 2), stop_ids=[])
    prop = RecordingProposer()
    gen = engine.speculative(prop, [3, 4, 5], 2, 8, 0.9, torch.Generator().manual_seed(0), rule)
    assert len(gen.tokens) == 8 and set(prop.temperatures) == {draft_temperature}


def test_lossless_check_reports_near_ties_apart():
    greedy, margins = [5, 6, 7, 8], [2.0, 0.5, 3e-5, 1.0]
    assert check(greedy, margins, [5, 6, 7, 8], 1e-4) is None
    tie = check(greedy, margins, [5, 6, 9, 8], 1e-4)
    assert tie is not None and tie.near_tie and tie.position == 2 and tie.margin == 3e-5
    real = check(greedy, margins, [5, 9, 7, 8], 1e-4)
    assert real is not None and not real.near_tie and (real.position, real.greedy, real.speculative) == (
        1, [6, 7, 8], [9, 7, 8])
    short = check(greedy, margins, [5, 6], 1e-4)  # one output a prefix of the other: never a tie
    assert short is not None and short.margin is None and not short.near_tie


def test_summary_fails_only_on_real_mismatches():
    """The measure-level report: a near-tie divergence is listed apart and does not fail the check."""
    from eval.measure import Settings, summarize
    from eval.speculative import Generation

    ref = {"ds": [Generation([5, 6, 7], margins=[1.0, 5e-5, 1.0]), Generation([1, 2], margins=[1.0, 1.0])]}
    spec = {"ds": [Generation([5, 9, 7], accepted=[1, 0], verify_s=0.02),
                   Generation([1, 2], accepted=[1], verify_s=0.01)]}
    ll = summarize(spec, ref, 10.0, Settings(3, 0.0, 8, tie_epsilon=1e-4))["lossless"]
    assert ll["ok"] and not ll["mismatches"] and [m["prompt"] for m in ll["near_ties"]] == [0]
    spec["ds"][1] = Generation([1, 3], accepted=[0], verify_s=0.01)
    ll = summarize(spec, ref, 10.0, Settings(3, 0.0, 8, tie_epsilon=1e-4))["lossless"]
    assert not ll["ok"] and [m["prompt"] for m in ll["mismatches"]] == [1]

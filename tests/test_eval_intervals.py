"""The gate's intervals (eval/intervals.py) and the decision rule read through them (eval.gate.decide), on constructed
per-prompt data: a real gain on enough prompts promotes, the same gain on 5 prompts is unresolved, a real loss
rejects, a tie or a single prompt decides nothing; the intervals hold their level on few prompts; the bootstrap is
seeded."""

from __future__ import annotations

import numpy as np
import pytest

from eval.gate import decide
from eval.gate_stats import evidence, influential_prompts
from eval.intervals import (
    RESOLVE_CAP,
    Bootstrap,
    constant,
    expansion,
    paired_difference,
    prompts_to_resolve,
    ratio_estimate,
    student_t_quantile,
    tau_star_estimate,
)

BOOT = Bootstrap(0.95, 2000, 0)


def pair(n: int, gain: float, seed: int = 0, spread: float = 0.3) -> tuple[tuple, tuple]:
    """(candidate, incumbent) per-prompt (tokens, cycles) on the same ``n`` prompts: prompts differ in difficulty
    (tau 1.6..2.6, 10..40 cycles, shared by both drafters), and the candidate's tau is the incumbent's + ``gain``
    + noise of sd ``spread`` per prompt, centred so that the observed difference of the two taus is ``gain`` itself
    on any ``n``: only the number of prompts differs between a resolved gain and an unresolved one."""
    rng = np.random.default_rng(seed)
    cycles = rng.integers(10, 40, n)
    inc_tau = rng.uniform(1.6, 2.6, n)
    noise = rng.normal(0, 1, n)
    noise = (noise - np.average(noise, weights=cycles)) / noise.std() * spread
    return ((inc_tau + gain + noise) * cycles, cycles), (inc_tau * cycles, cycles)


def gate_on(n: int, gain: float, tau_star: float = 1.2, **kw):
    cand, inc = pair(n, gain, **kw)
    ev = {"mtbench": evidence(cand, constant(tau_star, BOOT), 0.0, BOOT, inc)}
    return decide(ev, margin=0.0, min_delta=0.0)


def test_tau_is_a_ratio_of_sums_and_its_interval_holds_it():
    est = ratio_estimate([30, 10, 20, 0], [10, 10, 10, 0], BOOT)  # the fourth prompt ended at its prefill token
    iv = est.interval(0.95)
    assert est.point == 2.0 and iv.prompts == 3 and iv.low < 2.0 < iv.high  # a prompt without a cycle is none
    c = expansion(3, 0.95)
    # every resample's ratio lies between the prompts' own taus; the interval stretches its deviations by c
    assert 1.0 <= 2.0 + (iv.low - 2.0) / c + 1e-9 and 2.0 + (iv.high - 2.0) / c <= 3.0 + 1e-9
    same = ratio_estimate([20] * 8, [10] * 8, BOOT).interval(0.95)
    assert (same.low, same.high) == (2.0, 2.0)  # no spread between prompts: no width


def test_prompts_without_a_verify_cycle_neither_count_nor_thin_the_resamples():
    """An answer that ended at its prefill token says nothing about a drafter: the interval, the prompts it names
    and the prompts said to resolve it are those of the prompts measured, paired ones dropped from both sides."""
    cand, inc = pair(12, 0.1)
    padded = [tuple(np.concatenate([col, np.zeros(5)]) for col in side) for side in (cand, inc)]
    for got, want in ((ratio_estimate(*padded[0], BOOT), ratio_estimate(*cand, BOOT)),
                      (paired_difference(*padded, BOOT), paired_difference(cand, inc, BOOT))):
        assert got.interval(0.95) == want.interval(0.95) and got.prompts == 12
        assert prompts_to_resolve(got.interval(0.95), 0.0) == prompts_to_resolve(want.interval(0.95), 0.0)
    one_sided = (np.append(cand[0], 7.0), np.append(cand[1], 3)), (np.append(inc[0], 0.0), np.append(inc[1], 0))
    assert paired_difference(*one_sided, BOOT).interval(0.95) == paired_difference(cand, inc, BOOT).interval(0.95)


def test_the_bootstrap_is_seeded():
    cand, inc = pair(30, 0.1)
    one = paired_difference(cand, inc, BOOT).interval(0.95)
    assert one == paired_difference(cand, inc, Bootstrap(0.95, 2000, 0)).interval(0.95)
    other = paired_difference(cand, inc, Bootstrap(0.95, 2000, 1)).interval(0.95)
    assert (other.low, other.high) != (one.low, one.high) and other.point == one.point
    wider = paired_difference(cand, inc, Bootstrap(0.99, 2000, 0)).interval(0.99)
    assert wider.low < one.low and wider.high > one.high


def test_pairing_cancels_what_the_prompts_share():
    """Both drafters see the same hard and easy prompts: the paired interval of the difference is much narrower
    than the two taus' intervals side by side."""
    cand, inc = pair(40, 0.1, spread=0.05)
    diff = paired_difference(cand, inc, BOOT).interval(0.95)
    tau = ratio_estimate(*cand, BOOT).interval(0.95)
    assert diff.half_width < tau.half_width / 3


def test_a_real_gain_on_enough_prompts_promotes():
    d = gate_on(400, 0.1)
    assert d.verdict == "promote" and d.promote, d.reasons
    assert d.lines["mtbench"].startswith("mtbench: PASS (400 prompts, 95% intervals): tau ")
    assert "difference +0.100 [" in d.lines["mtbench"] and "clears min_delta 0" in d.lines["mtbench"]


def test_the_same_gain_on_5_prompts_is_unresolved_and_says_how_many_would_resolve_it():
    d = gate_on(5, 0.1)
    assert d.verdict == "unresolved" and not d.promote, d.reasons
    line = d.lines["mtbench"]
    assert line.startswith("mtbench: UNRESOLVED (5 prompts") and "holds min_delta 0: unresolved, about " in line
    assert "vs break-even" in line and "gap" in line and d.reasons[-1].startswith("unresolved: nothing promoted")
    need = int(line.split("about ")[1].split(" prompts")[0])
    assert 5 < need < 400


def test_a_real_loss_rejects():
    d = gate_on(50, -0.3)
    assert d.verdict == "reject", d.reasons
    assert "is below min_delta 0 (a real loss)" in d.lines["mtbench"]


def test_a_loss_on_one_dataset_rejects_whatever_another_leaves_unresolved():
    (c1, i1), (c2, i2) = pair(5, 0.1), pair(50, -0.3, seed=1)
    ts = constant(1.2, BOOT)
    ev = {"a": evidence(c1, ts, 0.0, BOOT, i1), "b": evidence(c2, ts, 0.0, BOOT, i2)}
    d = decide(ev, 0.0, 0.0)
    assert d.verdict == "reject" and d.lines["a"].startswith("a: UNRESOLVED") and d.lines["b"].startswith("b: FAIL")


def test_break_even_is_read_through_both_intervals():
    """tau* from 6 timing prompts with their spread: a tau clearly above it promotes, one inside its spread is
    unresolved (and the line counts timing prompts too), one clearly below rejects."""
    decode_s, steps = [0.50, 0.55, 0.45, 0.60, 0.52, 0.48], [50] * 6  # ~10 ms a token
    cycle_s, cycles = [0.40, 0.42, 0.38, 0.45, 0.41, 0.39], [20] * 6  # ~20 ms a cycle: tau* ~ 2
    ts = tau_star_estimate(decode_s, steps, cycle_s, cycles, BOOT)
    iv = ts.interval(0.95)
    assert ts.point == pytest.approx((sum(cycle_s) / 120) / (sum(decode_s) / 300)) and iv.prompts == 6
    assert iv.low < ts.point < iv.high
    cycles_each = np.full(200, 20)
    jitter = np.resize([-0.05, 0.05], 200)
    lines = {}
    for tau, verdict in ((2.6, "promote"), (ts.point + 0.03, "unresolved"), (1.4, "reject")):
        d = decide({"he": evidence(((tau + jitter) * 20, cycles_each), ts, 0.0, BOOT)}, 0.0)
        assert d.verdict == verdict, (tau, d.reasons)
        lines[verdict] = d.lines["he"]
    assert "timing prompts) would resolve the observed difference" in lines["unresolved"]


def test_margin_and_min_delta_are_the_bars():
    cand, inc = pair(400, 0.1)
    ts = constant(1.2, BOOT)
    assert decide({"a": evidence(cand, ts, 0.0, BOOT, inc)}, 0.0, min_delta=0.3).verdict == "reject"
    assert decide({"a": evidence(cand, ts, 1.0, BOOT, inc)}, 1.0, 0.0).verdict == "reject"  # needs tau >= 2.4
    assert decide({"a": evidence(cand, ts, 0.5, BOOT, inc)}, 0.5, 0.0).verdict == "promote"  # needs 1.8


def test_problems_and_unmeasured_datasets_reject():
    cand, inc = pair(400, 0.1)
    ok = {"a": evidence(cand, constant(1.2, BOOT), 0.0, BOOT, inc)}
    assert decide(ok, 0.0, checkpoint_problems=["fc.weight: NaN"]).verdict == "reject"
    assert decide(ok, 0.0, lossless_mismatches=["a prompt 0 differs"]).verdict == "reject"
    assert decide({}, 0.0).reasons == ["no gate dataset was measured"]
    nothing = {"a": evidence(([0, 0], [0, 0]), constant(1.2, BOOT), 0.0, BOOT)}
    d = decide(nothing, 0.0)
    assert d.verdict == "reject" and "not measured" in d.lines["a"]


def test_prompts_to_resolve_scales_the_facing_side_and_asks_for_80_percent():
    from dataclasses import replace
    from statistics import NormalDist

    iv = ratio_estimate([30, 10, 25, 15], [10] * 4, BOOT).interval(0.95)
    at = replace(iv, point=2.0, low=1.5, high=2.6, prompts=10)
    power = (1.959964 + NormalDist().inv_cdf(0.8)) / 1.959964
    want = next(m for m in range(11, 10_000)  # the lower side (0.5), not the upper one, faces a bar below
                if 0.5 * power * (10 / m) ** 0.5 * expansion(m, 0.95) / expansion(10, 0.95) <= 0.1)
    assert prompts_to_resolve(at, 1.9) == want and 300 < want < 600  # (0.5 / 0.1)^2 x 10 x ~2 / 1.18^2
    assert prompts_to_resolve(at, 2.0) is None  # a zero difference: no number of prompts
    assert prompts_to_resolve(at, 2.0 - 1e-6) is None  # past RESOLVE_CAP times the prompts: a tie
    assert prompts_to_resolve(replace(at, low=1.99, high=2.01), 1.9) == 11  # at least one more than now
    d = decide({"a": evidence(pair(20, 1e-4)[0], constant(1.2, BOOT), 0.0, BOOT)}, 0.0, 0.0)
    assert d.verdict == "promote"  # far above break-even, and no incumbent
    cand, inc = pair(20, 1e-4)
    tie = decide({"a": evidence(cand, constant(1.2, BOOT), 0.0, BOOT, inc)}, 0.0, 0.0)
    assert f"not even {RESOLVE_CAP}x these prompts would resolve so small a difference: a tie" in tie.lines["a"]


def test_student_t_quantiles_and_the_expansion():
    for df, table in ((1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423), (79, 1.9905)):
        assert student_t_quantile(0.975, df) == pytest.approx(table, abs=1e-4)
    assert student_t_quantile(0.995, 5) == pytest.approx(4.0321, abs=1e-4)
    assert student_t_quantile(0.975, 2000) == pytest.approx(1.9612, abs=1e-4)
    assert expansion(1, 0.95) == float("inf") and expansion(5, 0.95) == pytest.approx(1.584, abs=1e-3)
    assert 1.0 < expansion(400, 0.95) < expansion(80, 0.95) < 1.03


def test_the_intervals_hold_their_level_on_few_prompts():
    """A paired null (no true difference; prompts of varied difficulty and length): how often the 95% interval of the
    difference misses 0 on 5 prompts. A plain percentile interval misses about 16% of the time; the expanded one
    stays near the nominal 5%."""
    rng = np.random.default_rng(7)
    boot = Bootstrap(0.95, 1000, 0)
    misses, plain_misses, trials = 0, 0, 400
    for _ in range(trials):
        cycles = rng.integers(10, 40, 5)
        inc = rng.uniform(1.6, 2.6, 5)
        cand = inc + rng.normal(0, 0.3, 5)
        est = paired_difference((cand * cycles, cycles), (inc * cycles, cycles), boot)
        iv = est.interval(0.95)
        misses += not iv.low <= 0 <= iv.high
        (_, figure), = est.terms
        low, high = np.percentile(figure.draws, [2.5, 97.5])  # the plain percentile interval on the same draws
        plain_misses += not low <= 0 <= high
    assert plain_misses / trials > 0.10 and misses / trials < 0.08, (plain_misses, misses)


def test_one_prompt_gives_no_interval_and_decides_nothing():
    ev = {"mtbench": evidence(([30], [10]), constant(1.2, BOOT), 0.0, BOOT, ([25], [10]))}
    iv = ev["mtbench"].vs_incumbent
    assert iv.point == pytest.approx(0.5) and np.isnan(iv.low) and np.isnan(iv.high)
    d = decide(ev, 0.0)
    assert d.verdict == "unresolved", d.reasons
    assert "unresolved: fewer than 2 prompts give no interval" in d.lines["mtbench"]


def test_a_tie_with_the_incumbent_is_unresolved_not_a_promotion():
    cand, _ = pair(50, 0.0)
    d = decide({"mtbench": evidence(cand, constant(1.2, BOOT), 0.0, BOOT, cand)}, 0.0, 0.0)
    assert d.verdict == "unresolved", d.reasons
    assert "difference +0.000 [+0.000, +0.000] holds min_delta 0: unresolved, no number of prompts resolves a " \
           "zero difference" in d.lines["mtbench"]


def test_a_stricter_level_stretches_each_figure_by_its_own_prompts():
    """An interval at any level expands each resampled figure for its own prompts at that level (Student's t at 99%
    on 5 prompts, not the 95% stretch rescaled), also inside tau - tau*, whose two figures have different counts."""
    tau = ratio_estimate([30, 10, 25, 15, 20], [10] * 5, BOOT)
    (_, figure), = tau.terms
    for level in (0.95, 0.99):
        stretched = figure.point + expansion(5, level) * (figure.draws - figure.point)
        want = np.percentile(stretched, [50 * (1 - level), 50 * (1 + level)])
        assert [tau.interval(level).low, tau.interval(level).high] == pytest.approx(want)
    ts = tau_star_estimate([0.5, 0.55, 0.45], [50] * 3, [0.4, 0.42, 0.38], [20] * 3, BOOT)
    gap = tau - ts.scaled(1.1)
    (_, f_tau), (w_ts, f_ts) = gap.terms
    assert w_ts == pytest.approx(-1.1) and f_ts.prompts == 3 and gap.prompts == 5
    draws = f_tau.expanded(0.99) - 1.1 * (f_ts.point + expansion(3, 0.99) * (f_ts.draws - f_ts.point))
    assert gap.interval(0.99).high == pytest.approx(np.percentile(draws, 99.5))
    assert gap.point == pytest.approx(tau.point - 1.1 * ts.point)


def test_a_loss_is_real_only_at_the_level_all_comparisons_together_call_for():
    """The reject side reads every comparison's upper end at 1 - (1 - level) / m over the m comparisons of the
    decision: the same difference (95% upper end below 0) rejects when it is one of 2 comparisons, and is
    unresolved when it is one of 6 (three datasets, each against break-even and the incumbent), where one such
    interval among six would miss by chance far more often than 2.5%. Promotion is read at 95% either way."""
    ts = constant(1.2, BOOT)
    lose, lose_inc = pair(50, -0.12)
    alone = decide({"a": evidence(lose, ts, 0.0, BOOT, lose_inc)}, 0.0, 0.0)
    assert alone.verdict == "reject", alone.reasons
    assert "is below min_delta 0 (a real loss) at the 97.5% level 2 comparisons call for" in alone.lines["a"]
    win, win_inc = pair(400, 0.2)
    among = {"a": evidence(lose, ts, 0.0, BOOT, lose_inc), "b": evidence(win, ts, 0.0, BOOT, win_inc),
             "c": evidence(win, ts, 0.0, BOOT, win_inc)}
    d = decide(among, 0.0, 0.0)
    assert among["a"].vs_incumbent.high < 0 and d.verdict == "unresolved", d.reasons
    assert ("lies below min_delta 0 on its own, but not at the 99.17% level 6 comparisons call for (upper end +"
            in d.lines["a"]) and "unresolved, not a real loss" in d.lines["a"]
    assert d.lines["b"].startswith("b: PASS")
    assert decide({"a": evidence(lose, ts, 0.0, BOOT, lose_inc)}, 0.0, 0.0, comparisons=6).verdict == "unresolved"


def test_the_record_names_the_prompt_a_wide_difference_leans_on():
    """One prompt where the candidate no longer follows a long run (100 cycles for 255 tokens become 220) among
    163 where it gains a little: the record names that prompt first, with its share of the difference, which is
    the difference with it minus the difference without it."""
    cand, inc = pair(164, 0.03, seed=3, spread=0.1)
    tc, cc = np.asarray(cand[0], dtype=float), np.asarray(cand[1], dtype=float)
    tc[56], cc[56], inc[0][56], inc[1][56] = 255.0, 220.0, 255.0, 100.0
    top = influential_prompts((tc, cc), inc)
    assert [p["prompt"] for p in top][:1] == [56] and len(top) == 3
    keep = np.arange(164) != 56
    without = tc[keep].sum() / cc[keep].sum() - inc[0][keep].sum() / inc[1][keep].sum()
    whole = tc.sum() / cc.sum() - inc[0].sum() / inc[1].sum()
    assert top[0]["shift"] == pytest.approx(whole - without) and top[0]["shift"] < -0.02
    assert (top[0]["tau"], top[0]["incumbent_tau"]) == pytest.approx((255 / 220, 2.55))
    assert abs(top[1]["shift"]) <= abs(top[0]["shift"]) and abs(top[2]["shift"]) <= abs(top[1]["shift"])
    ev = evidence((tc, cc), constant(1.2, BOOT), 0.0, BOOT, inc)
    assert ev.influential == top  # what evidence_record writes beside the paired interval


def test_prompts_without_a_cycle_on_either_side_are_never_named():
    cand = ([10.0, 0.0, 9.0, 30.0], [5.0, 0.0, 3.0, 10.0])
    inc = ([10.0, 8.0, 0.0, 20.0], [4.0, 4.0, 0.0, 10.0])
    assert [p["prompt"] for p in influential_prompts(cand, inc)] == [3, 0]
    assert influential_prompts(([1.0, 0.0], [1.0, 0.0]), ([1.0, 2.0], [1.0, 1.0])) == []

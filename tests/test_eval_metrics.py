"""Pure eval arithmetic: acceptance statistics, break-even, speculative sampling, cache cropping."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval import breakeven, metrics
from eval.commands import breakeven_command
from eval.speculative import Draft, accept_greedy, accept_sampled, crop_cache, first_divergence

REPO = Path(__file__).resolve().parents[1]


def test_alpha_from_histogram_matches_definition_on_hand_made_cycles():
    # k = 3; ten cycles accepting these many drafts.
    accepted = [0, 1, 3, 3, 2, 0, 1, 3, 2, 3]
    hist = metrics.histogram(accepted, 3)
    assert hist == [2, 2, 2, 4]
    # By definition: draft i accepted in a cycle iff accepted >= i.
    p = [sum(a >= i for a in accepted) / 10 for i in range(4)]
    assert metrics.unconditional_rates(hist) == pytest.approx([0.8, 0.6, 0.4])
    assert metrics.conditional_rates(hist) == pytest.approx([p[1] / p[0], p[2] / p[1], p[3] / p[2]])
    assert metrics.conditional_rates(hist) == pytest.approx([0.8, 0.75, 4 / 6])
    assert metrics.tau_from_histogram(hist) == pytest.approx(sum(a + 1 for a in accepted) / 10)


def test_rates_with_unreached_positions_are_nan_and_bad_counts_raise():
    hist = metrics.histogram([0, 0, 1], 3)
    alpha = metrics.conditional_rates(hist)
    assert alpha[0] == pytest.approx(1 / 3) and alpha[1] == 0.0 and math.isnan(alpha[2])
    with pytest.raises(ValueError):
        metrics.histogram([4], 3)


def test_phase_lines_and_speed():
    t = metrics.PhaseTimes(draft_s=0.0010, verify_s=0.01998, overhead_s=0.00016, cycles=1)
    lines = metrics.phase_lines(t)
    assert lines[1] == "Target verify: 19.98 ms/cyc (94.5%)"
    sp = metrics.speed(tokens=3, cycle_s=t.total_s, decode_ms=12.0)
    assert sp["spec_tps"] == pytest.approx(3 / 0.02114)
    assert sp["speedup"] == pytest.approx(sp["spec_tps"] / (1000 / 12.0))


def test_breakeven_seed_figures():
    assert breakeven.tau_star(29.8, 12.1) == pytest.approx(2.46, abs=0.005)
    out = breakeven.breakeven(12.1, 29.0, 3, target_tps=150)
    assert 0.77 <= out["alpha_required"]["k_infinity"] <= 0.78
    assert out["alpha_required"]["finite_k"] is None  # 4.35 tokens/cycle: more than k+1 = 4
    a = breakeven.alpha_for_tokens(2.46, 3)
    assert breakeven.expected_tokens(a, 3) == pytest.approx(2.46, abs=1e-6)
    assert breakeven.cycle_ms(20.0, 3.0, 0.8, 3) == pytest.approx(29.8)


def test_breakeven_cli_prints_json(capsys):
    assert breakeven_command(12.1, 29.8) == 0
    out = json.loads(capsys.readouterr().out)
    assert round(out["tau_star"], 2) == 2.46 and "alpha_required" not in out
    assert breakeven_command(12.1, 29.8, steps=7, target_tps=150.0) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0.77 <= out["alpha_required"]["k_infinity"] <= 0.78
    assert 0.77 <= out["alpha_required"]["finite_k"] <= 0.9  # reachable with 7 drafts, needs more alpha
    assert breakeven_command(0.0, 29.8) == 2
    r = subprocess.run([sys.executable, "-m", "eval", "breakeven", "--decode-ms", "12.1", "--cycle-ms", "29.8",
                        "--steps", "7", "--target-tps", "150"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["alpha_required"] == out["alpha_required"]


@pytest.mark.parametrize(("args", "line"), [
    (["--decode-ms", "nan", "--cycle-ms", "10"], "argument --decode-ms: must be a finite number > 0, got nan"),
    (["--decode-ms", "10", "--cycle-ms", "inf"], "argument --cycle-ms: must be a finite number > 0, got inf"),
    (["--decode-ms", "10", "--cycle-ms", "30", "--steps", "-3"],
     "argument --steps: must be a whole number >= 1, got -3"),
    (["--decode-ms", "10", "--cycle-ms", "30", "--steps", "0"],
     "argument --steps: must be a whole number >= 1, got 0"),
    (["--decode-ms", "10", "--cycle-ms", "30", "--target-tps", "-5"],
     "argument --target-tps: must be a finite number > 0, got -5"),
])
def test_breakeven_cli_refuses_timings_that_give_meaningless_figures(args, line, capsys):
    """float() takes nan and inf, int() takes -3: each must be a one-line error naming the flag, exit 2."""
    from eval.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["breakeven", *args])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    assert captured.err.strip().splitlines()[-1] == f"python -m eval breakeven: error: {line}"


def test_accept_greedy_prefix_and_bonus():
    logits = torch.full((4, 10), -1.0)
    for i, tok in enumerate([3, 5, 7, 9]):
        logits[i, tok] = 1.0
    assert accept_greedy(logits, [3, 5, 7]) == (3, 9)
    assert accept_greedy(logits, [3, 4, 7]) == (1, 5)
    assert accept_greedy(logits, [0, 5, 7]) == (0, 3)


@pytest.mark.parametrize("with_probs", [False, True])
def test_speculative_sampling_reproduces_the_target_distribution(with_probs):
    """The first emitted token of a cycle must be distributed exactly as the target's p."""
    g = torch.Generator().manual_seed(0)
    p_logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]] * 2)
    p = torch.softmax(p_logits[0], -1)
    q = torch.tensor([0.1, 0.6, 0.1, 0.1, 0.1])
    n, counts = 2000, torch.zeros(5)  # seeded: deterministic; a wrong residual is off by > 0.1
    for _ in range(n):
        d = int(torch.multinomial(q, 1, generator=g)) if with_probs else 1
        draft = Draft([d], q[None] if with_probs else None)
        a, nxt = accept_sampled(p_logits, draft, 1.0, g)
        counts[d if a == 1 else nxt] += 1
    assert torch.allclose(counts / n, p, atol=0.03)


def test_crop_cache_and_first_divergence():
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 7, 4), torch.zeros(1, 2, 7, 4), 0)
    crop_cache(cache, 4)
    assert cache.get_seq_length() == 4
    crop_cache(cache, 9)  # never grows
    assert cache.get_seq_length() == 4
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_a_datasets_stats_count_the_prompts_that_ended_at_their_prefill_token():
    """Measured, but with no verify cycle: counted apart, and their per-prompt rows hold no tokens either."""
    from eval.measure import dataset_stats
    from eval.speculative import Generation

    gens = [Generation([5, 6, 7, 8], accepted=[2, 0]), Generation([2]), Generation([4, 9], accepted=[1])]
    stats = dataset_stats(gens, k=3)
    assert stats["prompts"] == 3 and stats["prompts_without_cycles"] == 1
    assert stats["per_prompt"] == {"tokens": [4, 0, 2], "cycles": [2, 0, 1]}
    assert stats["tau"] == pytest.approx(6 / 3)


def test_a_time_of_zero_is_not_measured_not_an_error():
    """A drafter that ran no verify cycle has no cycle time: tau* is NaN and no alpha follows (the gate reads it as
    not measured); a time given by hand is still checked by ``tau_star``."""
    out = breakeven.breakeven(12.1, 0.0, 3, target_tps=150)
    assert math.isnan(out["tau_star"]) and out["alpha_breakeven"] == {"finite_k": None, "k_infinity": None}
    assert out["alpha_required"] == {"finite_k": None, "k_infinity": None}
    with pytest.raises(ValueError, match="timings must be > 0"):
        breakeven.tau_star(0.0, 12.1)

"""Run the plain and speculative loops over the eval prompts and reduce them to per-dataset figures.

Plain decoding runs once per prompt; every drafter (candidate, incumbent) then decodes the same
prompts, so their taus and timings are comparable and the T=0 outputs can be checked token by token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from eval import breakeven, lossless, metrics
from eval.speculative import Engine, Generation, Proposer
from eval.stall_free import stall_free_s, stalled


@dataclass
class Settings:
    num_steps: int
    temperature: float
    max_new_tokens: int
    seed: int = 0
    acceptance: str = "sglang"  # the T > 0 rule (eval.speculative.ACCEPTANCE_RULES)
    tie_epsilon: float = 1e-4  # T = 0: divergences at a smaller top-1/top-2 margin are near-ties


def _generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + index)


def dataset_stats(gens: Sequence[Generation], k: int) -> dict:
    """tau, alpha and the histogram over every cycle, and per prompt its cycle tokens and cycles: tau is their ratio
    of sums, which ``eval.intervals`` resamples prompt by prompt."""
    hist = metrics.histogram([a for g in gens for a in g.accepted], k)
    return {"tau": metrics.tau_from_histogram(hist), "histogram": hist, "cycles": sum(hist),
            "alpha_conditional": metrics.conditional_rates(hist),
            "alpha_unconditional": metrics.unconditional_rates(hist),
            "tokens": sum(len(g.tokens) for g in gens), "prompts": len(gens),
            "prompts_without_cycles": sum(not g.accepted for g in gens),  # ended at the prefill token: no tau
            "per_prompt": {"tokens": [g.cycle_tokens for g in gens], "cycles": [len(g.accepted) for g in gens]}}


def divergences(reference: Sequence[Generation], gens: Sequence[Generation], dataset: str,
                epsilon: float) -> list[dict]:
    """One entry per prompt whose speculative tokens differ from plain greedy decoding (``eval.lossless``)."""
    out = []
    for i, (ref, g) in enumerate(zip(reference, gens, strict=True)):
        d = lossless.check(ref.tokens, ref.margins, g.tokens, epsilon)
        if d is not None:
            out.append({"dataset": dataset, "prompt": i, "first_divergence": d.position, "margin": d.margin,
                        "near_tie": d.near_tie, "greedy": d.greedy, "speculative": d.speculative})
    return out


def summarize(per_dataset: Mapping[str, Sequence[Generation]], references: Mapping[str, Sequence[Generation]],
              decode_ms: float, s: Settings, dtype: torch.dtype = torch.float32) -> dict:
    """Per-dataset acceptance, phase times, speed and the lossless check (``dtype``: the target's; only an
    exact one is checked, ``eval.lossless.unchecked_reason``)."""
    gens = [g for gs in per_dataset.values() for g in gs]
    times = metrics.PhaseTimes(sum(g.draft_s for g in gens), sum(g.verify_s for g in gens),
                               sum(g.overhead_s for g in gens), sum(len(g.accepted) for g in gens))
    ms = times.ms_per_cycle()
    cycle_s = [stall_free_s(g.cycle_s) for g in gens]
    cycle_ms = 1000 * sum(cycle_s) / times.cycles if times.cycles else float("nan")
    out = {"datasets": {name: dataset_stats(gs, s.num_steps) for name, gs in per_dataset.items()},
           "phases_ms_per_cycle": ms, "phase_lines": metrics.phase_lines(times),
           "cycle_ms": cycle_ms,  # without the stalls (eval.stall_free), as tau* reads it; the phases: their means
           "stalled_cycles": sum(stalled(g.cycle_s) for g in gens),
           "draft_step_ms": ms["draft"] / s.num_steps,
           "speed": metrics.speed(sum(g.cycle_tokens for g in gens), sum(cycle_s), decode_ms),
           # every prompt of every dataset in order, as plain's per_prompt: the timing samples of tau*
           "per_prompt_timing": {"cycle_s": cycle_s, "cycles": [len(g.accepted) for g in gens]}}
    out["measured_breakeven"] = breakeven.breakeven(decode_ms, cycle_ms, s.num_steps) if times.cycles else None
    reason = lossless.unchecked_reason(s.temperature, dtype)
    if reason is None:
        found = [m for name, gs in per_dataset.items() for m in divergences(references[name], gs, name, s.tie_epsilon)]
        mismatches = [m for m in found if not m["near_tie"]]
        out["lossless"] = {"checked": True, "ok": not mismatches, "prompts": len(gens), "mismatches": mismatches,
                           "near_ties": [m for m in found if m["near_tie"]], "tie_epsilon": s.tie_epsilon}
    else:
        out["lossless"] = {"checked": False, "ok": True, "reason": reason}
    return out


def measure(engine: Engine, prompts: Mapping[str, Sequence[Sequence[int]]], proposers: Mapping[str, Proposer],
            s: Settings) -> dict:
    """Plain decode (t_decode and the greedy reference) and each proposer, on every prompt."""
    total = sum(len(p) for p in prompts.values()) * (1 + len(proposers))
    bar = tqdm(total=total, desc="eval decode", unit="run")
    plain: dict[str, list[Generation]] = {}
    spec: dict[str, dict[str, list[Generation]]] = {name: {} for name in proposers}
    for ds, ids_list in prompts.items():
        plain[ds] = []
        for name in proposers:
            spec[name][ds] = []
        for i, ids in enumerate(ids_list):
            plain[ds].append(engine.plain(ids, s.max_new_tokens, s.temperature, _generator(s.seed, i)))
            bar.update()
            for name, prop in proposers.items():
                spec[name][ds].append(engine.speculative(prop, ids, s.num_steps, s.max_new_tokens, s.temperature,
                                                         _generator(s.seed, i), s.acceptance))
                bar.update()
    bar.close()
    runs = [g for gs in plain.values() for g in gs]
    steps = sum(g.steps for g in runs)
    decode_s = [stall_free_s(g.step_s) for g in runs]  # each prompt's, without the stalls (eval.stall_free)
    decode_ms = 1000 * sum(decode_s) / steps if steps else float("nan")
    return {"settings": vars(s) | {"batch_size": 1},
            "prompts": {ds: len(p) for ds, p in prompts.items()},
            "plain": {"decode_ms": decode_ms, "decode_steps": steps,
                      "decode_ms_with_stalls": 1000 * sum(g.decode_s for g in runs) / steps if steps else float("nan"),
                      "stalled_steps": sum(stalled(g.step_s) for g in runs),
                      "tokens_per_s": 1000 / decode_ms if steps else float("nan"),
                      "prefill_s": sum(g.prefill_s for g in runs),
                      "per_prompt": {"decode_s": decode_s, "steps": [g.steps for g in runs]}},
            "drafters": {name: summarize(spec[name], plain, decode_ms, s, engine.target.dtype) for name in proposers}}

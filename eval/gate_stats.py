"""From a measurement's per-prompt figures to the gate's evidence (``eval.gate.Evidence``) and back to the report.

Every measurement (the HF engine's report, ``eval quality``'s batched passes, the live servers' requests) keeps,
per prompt, the tokens its verify cycles produced and how many cycles ran; per timing prompt, the plain decode's
seconds and steps and the speculative run's cycle seconds and cycles. Here those columns become intervals
(``eval.intervals``), at the level, resample count and seed of the ``gate`` config section.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from common.config import GateConfig
from eval.gate import Decision, Evidence
from eval.intervals import (
    Bootstrap,
    Estimate,
    constant,
    paired_columns,
    paired_difference,
    ratio_estimate,
    tau_star_estimate,
)

PerPrompt = tuple[Sequence[float], Sequence[float]]  # (tokens, cycles) per prompt


def bootstrap(gate: GateConfig) -> Bootstrap:
    return Bootstrap(gate.confidence, gate.bootstrap_samples, gate.bootstrap_seed)


def per_prompt(stats: Mapping) -> PerPrompt:
    """A dataset's (tokens, cycles) columns (``eval.measure.dataset_stats``)."""
    return stats["per_prompt"]["tokens"], stats["per_prompt"]["cycles"]


def tau_ci(stats: Mapping, boot: Bootstrap) -> list[float]:
    """[low, high] of a dataset's tau."""
    iv = ratio_estimate(*per_prompt(stats), boot).interval(boot.level)
    return [iv.low, iv.high]


def timed_tau_star(plain: Mapping, timing: Mapping, boot: Bootstrap) -> Estimate:
    """tau* from the batch-1 engine's per-prompt timings: ``plain["per_prompt"]`` (decode_s, steps) and a drafter's
    ``per_prompt_timing`` (cycle_s, cycles), on the same prompts in the same order."""
    p, t = plain["per_prompt"], timing
    return tau_star_estimate(p["decode_s"], p["steps"], t["cycle_s"], t["cycles"], boot)


INFLUENTIAL_PROMPTS = 3  # how many prompts a record names as moving the paired difference most


def influential_prompts(cand: PerPrompt, inc: PerPrompt, n: int = INFLUENTIAL_PROMPTS) -> list[dict]:
    """The ``n`` prompts the paired difference leans on most: for each prompt where both drafters ran a verify
    cycle (the prompts ``paired_difference`` uses), ``shift`` = the difference with it minus the difference without
    it (leave-one-out), so a wide interval driven by one prompt (say, a long run of one token the candidate no longer
    follows) names that prompt. ``prompt``: its index in the dataset; ``tau`` and ``incumbent_tau``: its own."""
    both, tc, cc, ti, ci = paired_columns(cand, inc)
    if both.size < 2:
        return []
    whole = tc.sum() / cc.sum() - ti.sum() / ci.sum()
    shift = whole - ((tc.sum() - tc) / (cc.sum() - cc) - (ti.sum() - ti) / (ci.sum() - ci))
    order = np.argsort(-np.abs(shift), kind="stable")[:n]
    return [{"prompt": int(both[j]), "shift": float(shift[j]), "tau": float(tc[j] / cc[j]),
             "incumbent_tau": float(ti[j] / ci[j])} for j in order]


def evidence(cand: PerPrompt, tau_star: Estimate, margin: float, boot: Bootstrap,
             inc: PerPrompt | None = None) -> Evidence:
    """One dataset's evidence: tau, tau*, tau - tau* (1 + margin) and, with an incumbent on the same prompts, the
    paired difference. The gap's interval resamples tau* over its timing prompts apart from the eval prompts, as if
    the two were independent: an approximation, since the timing prompts are eval prompts (every one in the batch-1
    engine's gate and on live servers, the first few in ``eval quality``)."""
    tau = ratio_estimate(*cand, boot)
    level = boot.level
    gap = tau - tau_star.scaled(1 + margin)
    if inc is None:
        return Evidence(tau.interval(level), tau_star.interval(level), gap.interval(level), gap=gap)
    diff = paired_difference(cand, inc, boot)
    return Evidence(tau.interval(level), tau_star.interval(level), gap.interval(level),
                    ratio_estimate(*inc, boot).interval(level), diff.interval(level), gap=gap, difference=diff,
                    influential=influential_prompts(cand, inc))


def report_tau_star(report: Mapping, boot: Bootstrap) -> Estimate:
    """tau* of an ``eval.evaluate`` report: from the candidate's and plain decoding's timing prompts, or a constant
    when the timings came from the config."""
    if report["breakeven"]["source"] != "measured":
        return constant(report["breakeven"]["tau_star"], boot)
    return timed_tau_star(report["plain"], report["drafters"]["candidate"]["per_prompt_timing"], boot)


def annotate(report: dict, boot: Bootstrap) -> dict:
    """Add the intervals to an ``eval.evaluate`` report: ``ci`` to every drafter's dataset, ``ci``, ``timing_prompts``
    and ``level`` to the break-even."""
    for d in report["drafters"].values():
        for st in d["datasets"].values():
            st["ci"] = tau_ci(st, boot)
    iv = report_tau_star(report, boot).interval(boot.level)
    report["breakeven"] |= {"ci": [iv.low, iv.high], "timing_prompts": iv.prompts, "level": boot.level}
    return report


def report_evidence(report: Mapping, datasets: Sequence[str], margin: float, boot: Bootstrap) -> dict[str, Evidence]:
    """Each gate dataset's evidence from an ``eval.evaluate`` report (the incumbent's, when it was measured)."""
    tau_star = report_tau_star(report, boot)
    cand = report["drafters"]["candidate"]["datasets"]
    inc = report["drafters"].get("incumbent", {}).get("datasets")
    return {ds: evidence(per_prompt(cand[ds]), tau_star, margin, boot, per_prompt(inc[ds]) if inc else None)
            for ds in datasets}


def evidence_record(ev: Mapping[str, Evidence], d: Decision) -> dict:
    """The intervals for the history and the report: per dataset every interval and its line."""
    out = {}
    for name, e in ev.items():
        out[name] = {"tau": e.tau.to_dict(), "tau_star": e.tau_star.to_dict(),
                     "vs_breakeven": e.vs_breakeven.to_dict(), "line": d.lines.get(name)}
        if e.vs_incumbent is not None:
            out[name] |= {"incumbent_tau": e.incumbent_tau.to_dict(), "vs_incumbent": e.vs_incumbent.to_dict(),
                          "influential_prompts": e.influential}
    return out

"""Write one eval's report: report.json (machines), report.md (people), alpha.png, tau.png (with the intervals) and
tau_per_prompt.png (candidate against incumbent, prompt by prompt) as plots, and log the figures to the run config's
experiment trackers (``tracking:``)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from common.files import json_safe, json_text, remove_temps, write_bytes_atomic, write_text_atomic
from common.tracking import flat_config, make_trackers
from eval.stall_free import STALL_FACTOR

PLOTS = ("alpha", "tau", "tau_per_prompt")  # the PNGs beside report.json, by stem


def decimals(x: Any, places: int = 3, signed: bool = False) -> str:
    """A figure for people (report.md, the gate's reasons): ``x`` with ``places`` decimals, with its sign when
    ``signed`` (a difference), "–" when it is missing or not finite."""
    sign = "+" if signed else ""
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:{sign}.{places}f}"


def ci_text(ci: Any, places: int = 3, signed: bool = False) -> str:
    """``[1.602, 1.980]``, or "–" without an interval; a bound that is not finite as "–"."""
    return f"[{decimals(ci[0], places, signed)}, {decimals(ci[1], places, signed)}]" if ci else "–"


def prompt_counts(r: dict) -> str:
    """``80 mtbench, 79 mtbench_turn2 (1 record with too few user turns skipped)``: each dataset's prompts, and the
    records it skipped for fewer user turns than its ``turn``, where there were any."""
    skipped = r.get("records_skipped_short") or {}
    return ", ".join(f"{n} {d}" + (f" ({k} record{'s' * (k != 1)} with too few user turns skipped)"
                                   if (k := skipped.get(d)) else "") for d, n in r["prompts"].items())


def stalls_note(r: dict) -> str:
    """The steps a shared machine stalled (eval.stall_free), which the timings leave out, when there were any."""
    plain = r["plain"].get("stalled_steps", 0)
    cycles = {name: d.get("stalled_cycles", 0) for name, d in r["drafters"].items()}
    if not plain and not any(cycles.values()):
        return ""
    return (f" Stalled steps left out of the timings (over {STALL_FACTOR:g}x their run's lower quartile): {plain} of "
            f"{r['plain']['decode_steps']} plain, " + ", ".join(f"{c} {name} cycles" for name, c in cycles.items())
            + f"; with them, plain decode {decimals(r['plain']['decode_ms_with_stalls'], 2)} ms/token.")


def markdown(r: dict) -> str:
    s, be = r["settings"], r["breakeven"]
    k = s["num_steps"]
    spread = (f"; {100 * be['level']:g}% interval {ci_text(be['ci'])} over {be['timing_prompts']} timing prompts"
              if be.get("timing_prompts") else "")
    lines = [f"# Eval report: {r['name']}", "",
             f"Target `{r['target']}` on {r['device']}, batch size 1, k = {k} chained drafts "
             f"(up to {k + 1} tokens per cycle), T = {s['temperature']}"
             + (f" (acceptance: {s.get('acceptance')})" if s["temperature"] > 0 else "")
             + f", max_new_tokens = {s['max_new_tokens']}, "
             f"prompts: " + prompt_counts(r) + ".", "",
             "## Break-even", "",
             f"- tau* = {decimals(be['tau_star'])} = cycle {decimals(be['cycle_ms'], 2)} ms / decode "
             f"{decimals(be['decode_ms'], 2)} ms "
             f"({be['source']} timings){spread}",
             f"- alpha to break even (constant per draft): {decimals(be['alpha_breakeven']['finite_k'])} with k = {k}, "
             f"{decimals(be['alpha_breakeven']['k_infinity'])} as k -> inf"]
    if "alpha_required" in be:
        lines.append(f"- goal {be['target_tps']} tok/s needs {decimals(be['tokens_per_cycle_required'])} tokens/cycle: "
                     f"alpha {decimals(be['alpha_required']['finite_k'])} (k = {k}), "
                     f"{decimals(be['alpha_required']['k_infinity'])} (k -> inf)")
    p = r["plain"]
    lines += ["", f"Plain target decode: {decimals(p['decode_ms'], 2)} ms/token "
              f"({decimals(p['tokens_per_s'], 1)} tok/s)." + stalls_note(r), ""]
    for name, d in r["drafters"].items():
        ck = r.get("checkpoints", {}).get(name, {})
        lines += [f"## Drafter `{name}`" + (f" — `{ck['path']}`" if ck else ""), ""]
        if ck.get("fingerprint"):
            lines += [f"Fingerprint `{ck['fingerprint'][:16]}`", ""]
        hdr = ["dataset", "prompts", "cycles", "tau", "interval"] + [f"alpha_{i}" for i in range(1, k + 1)] + \
              [f"P(d{i})" for i in range(1, k + 1)] + ["accepted 0..k"]
        lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for ds, st in d["datasets"].items():
            row = [ds, str(st.get("prompts", "–")), str(st["cycles"]), decimals(st["tau"]), ci_text(st.get("ci"))] + \
                  [decimals(a) for a in st["alpha_conditional"]] + \
                  [decimals(a) for a in st["alpha_unconditional"]] + [" / ".join(map(str, st["histogram"]))]
            lines.append("| " + " | ".join(row) + " |")
        sp = d["speed"]
        lines += ["", *[f"- {x}" for x in d["phase_lines"]],
                  f"- cycle {decimals(d.get('cycle_ms', d['phases_ms_per_cycle']['cycle']), 2)} ms without stalls "
                  f"({decimals(d['phases_ms_per_cycle']['cycle'], 2)} ms with them); "
                  f"speculative {decimals(sp['spec_tps'], 1)} tok/s "
                  f"vs plain {decimals(sp['plain_tps'], 1)} tok/s: speed-up x{decimals(sp['speedup'], 2)}"]
        ll = d["lossless"]
        if ll["checked"]:
            verdict = ("OK: identical to greedy decoding" if ll["ok"]
                       else f"FAIL: {len(ll['mismatches'])} prompt(s) differ")
            lines.append(f"- lossless (T=0, {ll['prompts']} prompts): {verdict}")
            lines += [f"  - {m['dataset']} prompt {m['prompt']}: first divergence at token {m['first_divergence']} "
                      f"(greedy {m['greedy']} vs speculative {m['speculative']})" for m in ll["mismatches"]]
            if ll.get("near_ties"):
                lines.append(f"- near-ties (top-1/top-2 logit margin < {ll['tie_epsilon']}; not failures): "
                             f"{len(ll['near_ties'])} prompt(s)")
                lines += [f"  - {m['dataset']} prompt {m['prompt']}: token {m['first_divergence']}, margin "
                          f"{decimals(m['margin'], 5)} (greedy {m['greedy']} vs speculative {m['speculative']})"
                          for m in ll["near_ties"]]
        else:
            lines.append(f"- lossless: not checked ({ll['reason']})")
        lines.append("")
    if "gate" in r:
        lines += [*gate_lines(r["gate"]), ""]
    lines += influence_lines(r.get("intervals") or {})
    return "\n".join(lines)


def influence_lines(intervals: dict) -> list[str]:
    """Per dataset gated against an incumbent, the prompts its paired difference leans on most: one prompt that
    moves it far is worth reading before trusting (or doubting) the interval."""
    rows = [f"- {ds}: " + "; ".join(f"prompt {p['prompt']} {p['shift']:+.3f} (tau {p['tau']:.2f} against "
                                    f"{p['incumbent_tau']:.2f})" for p in rec["influential_prompts"])
            for ds, rec in intervals.items() if rec.get("influential_prompts")]
    if not rows:
        return []
    return ["## What moves the paired difference", "",
            "Each prompt's share of the difference (the difference with it minus without it), largest first:", "",
            *rows, ""]


def gate_lines(g: dict) -> list[str]:
    """The gate's section of a report: its decision and reasons. The report is written before the decision is
    recorded, so it names the history that says whether the decision took effect."""
    lines = [f"## Gate: **{g['decision'].upper()}**", "", *[f"- {x}" for x in g["reasons"]]]
    if g.get("history_file"):
        lines.append(f"- takes effect once recorded in `{g['history_file']}`, which says what serves")
    return lines


def plots(r: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    be, k = r["breakeven"], r["settings"]["num_steps"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, d in r["drafters"].items():
        for ds, st in d["datasets"].items():
            ys = [float("nan") if a is None else a for a in st["alpha_conditional"]]
            ax.plot(range(1, k + 1), ys, marker="o", label=f"{name} / {ds}")
    need = be["alpha_breakeven"]["finite_k"]
    if need is not None:
        ax.axhline(need, color="red", linestyle="--", label=f"alpha for break-even ({need:.2f})")
    ax.set(xlabel="draft position k", ylabel="alpha_k = P(k accepted | k-1 accepted)", ylim=(0, 1.05),
           xticks=range(1, k + 1), title="Conditional acceptance per draft position")
    ax.legend(fontsize=7)
    alpha_png, tau_png, per_prompt_png = (out_dir / f"{p}.png" for p in PLOTS)
    save_png(fig, alpha_png)

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(r["drafters"])
    datasets = list(r["prompts"])
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        stats = [r["drafters"][name]["datasets"][ds] for ds in datasets]
        taus = [st["tau"] or 0 for st in stats]
        cis = [[t if x is None else x for x in (st.get("ci") or [t, t])] for t, st in zip(taus, stats, strict=True)]
        errs = [[max(t - lo, 0) for t, (lo, _) in zip(taus, cis, strict=True)],
                [max(hi - t, 0) for t, (_, hi) in zip(taus, cis, strict=True)]]
        ax.bar([i + j * width for i in range(len(datasets))], taus, width, yerr=errs, capsize=3, label=name)
    if be["tau_star"] is not None:  # null: not measured (no verify cycle)
        ax.axhline(be["tau_star"], color="red", linestyle="--", label=f"tau* ({be['tau_star']:.2f})")
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(datasets))], datasets)
    ax.set(ylabel="tau (tokens / verify cycle)", title="Acceptance length against break-even (bars: intervals)")
    ax.legend(fontsize=7)
    save_png(fig, tau_png)
    per_prompt_plot(r, per_prompt_png)
    return [alpha_png, tau_png, per_prompt_png]


def save_png(fig: Any, path: Path) -> None:
    """Close ``fig`` and write it as ``path`` rendered in memory, with one rename: a kill mid-write leaves the
    previous plot or none, never a torn PNG that a reader or a tracker would choke on."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.tight_layout()
        fig.savefig(buf, dpi=100, format="png")
    finally:
        plt.close(fig)
    write_bytes_atomic(path, buf.getvalue())


def prompt_taus(stats: dict) -> list[float]:
    """tau of each prompt (NaN for one that ran no verify cycle)."""
    pp = stats.get("per_prompt") or {"tokens": [], "cycles": []}
    return [t / c if c else float("nan") for t, c in zip(pp["tokens"], pp["cycles"], strict=True)]


def per_prompt_plot(r: dict, path: Path) -> None:
    """One panel per dataset: each prompt's tau, the candidate's against the incumbent's (the diagonal: no change;
    a dot's size: the candidate's verify cycles on it, its weight in tau), or against the prompt's index when no
    incumbent was measured; the paired interval of the difference in the title, tau* as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets, drafters = list(r["prompts"]), r["drafters"]
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 4.2), squeeze=False)
    tau_star = r["breakeven"]["tau_star"]
    for ax, ds in zip(axes[0], datasets, strict=True):
        cand = drafters["candidate"]["datasets"][ds]
        ys = prompt_taus(cand)
        sizes = [8 + 2 * c for c in (cand.get("per_prompt") or {}).get("cycles", [])] or None
        iv = (r.get("intervals") or {}).get(ds, {}).get("vs_incumbent")
        if "incumbent" in drafters:
            xs = prompt_taus(drafters["incumbent"]["datasets"][ds])
            ax.scatter(xs, ys, s=sizes, alpha=0.6)
            finite = [v for v in xs + ys if v == v]
            lo, hi = (min(finite), max(finite)) if finite else (1.0, 2.0)
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, label="no change")
            ax.set(xlabel="incumbent tau on the prompt", ylabel="candidate tau on the prompt")
        else:
            ax.scatter(range(len(ys)), ys, s=sizes, alpha=0.6)
            ax.set(xlabel="prompt", ylabel="candidate tau on the prompt")
        if tau_star is not None:
            ax.axhline(tau_star, color="red", linestyle="--", lw=0.8, label=f"tau* ({tau_star:.2f})")
        title = f"{ds}: {len(ys)} prompts"
        if iv and iv["point"] is not None:
            title += f"\ndelta tau {iv['point']:+.3f} {ci_text(iv['ci'])} ({100 * iv['level']:g}%)"
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    save_png(fig, path)


def figures(r: dict) -> dict[str, float]:
    """The report's headline numbers under flat names, for experiment trackers."""
    flat = {"eval/tau_star": r["breakeven"]["tau_star"], "eval/decode_ms": r["plain"]["decode_ms"]}
    for name, d in r["drafters"].items():
        flat[f"eval/{name}/speedup"] = d["speed"]["speedup"]
        for ds, st in d["datasets"].items():
            flat[f"eval/{name}/{ds}/tau"] = st["tau"]
            if st.get("ci"):
                flat[f"eval/{name}/{ds}/tau_ci_low"], flat[f"eval/{name}/{ds}/tau_ci_high"] = st["ci"]
            for i, a in enumerate(st["alpha_conditional"], 1):
                flat[f"eval/{name}/{ds}/alpha_{i}"] = a
    return {k: v for k, v in flat.items() if v is not None}


def log_to_trackers(r: dict, tracking: Any, logging_dir: Path, images: list[Path]) -> None:
    """One eval run per report in every tracker of ``tracking`` (the run config's section): settings,
    figures, and the plots where the tracker takes images (TensorBoard, wandb); the PNGs stay beside the
    report either way."""
    import numpy as np
    from accelerate import PartialState
    from PIL import Image

    PartialState()  # accelerate's trackers log through its process state (here: one process, the main one)
    pictures = {p.stem: np.asarray(Image.open(p).convert("RGB")) for p in images}
    for tracker in make_trackers(tracking, logging_dir, "eval", r["name"]):
        tracker.start()
        tracker.store_init_configuration(flat_config(r["settings"]))
        tracker.log(figures(r))
        if tracker.name == "tensorboard":
            tracker.log_images({k: v[None] for k, v in pictures.items()}, dataformats="NHWC")
        elif tracker.name == "wandb":
            tracker.log_images({k: [v] for k, v in pictures.items()})
        tracker.finish()


def write_report(r: dict, out_dir: str | Path) -> Path:
    """Every file atomically; temps of a killed earlier write are cleared first (the caller holds the run's lock,
    so no live writer owns them)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_temps(out)
    r = json_safe(r)
    write_text_atomic(out / "report.json", json_text(r, indent=2) + "\n")
    write_text_atomic(out / "report.md", markdown(r))
    plots(r, out)
    return out

"""The gate fed by live SGLang servers (``python -m eval gate --live``, ``eval run --live``).

A drafter for a 1T target can only be measured where it is served. Three servers of the same target:
``eval.sglang.server_url`` speculates with the candidate, ``incumbent_url`` with the drafter serving now (same
``--speculative-*`` flags), ``baseline_url`` does not speculate. At each concurrency in ``eval.sglang.concurrency``
every eval prompt goes to each server with that many requests in flight; per request SGLang's ``meta_info``
(``eval.sglang_client``) gives the tokens, verify passes, the acceptance histogram and the latencies:

    tau       = tokens per verify cycle after the prefill token: from the histogram, sum((a+1) h[a]) / sum(h)
                (else (completion_tokens - 1) / spec_verify_ct per request, summed)
    alpha_k   = conditional acceptance per draft position, from the histogram
    t_cycle   = decode time / spec_verify_ct on the candidate's server (decode time = e2e_latency -
                first_token_latency, the latter with --enable-metrics; else e2e_latency, prefill included)
    t_decode  = decode time / (completion_tokens - 1) on the baseline (e2e_latency / completion_tokens without
                first_token_latency); without a baseline server, eval.timings (decode_ms, cycle_ms[k]) instead
    tau*      = t_cycle / t_decode, per concurrency

With the run's regenerated conversations at hand, the held-out turns (``eval.context_buckets``: histories the
drafter never trained on, rendered as the server renders them) go to the candidate's and incumbent's servers too:
tau by history length (< 1k, 1-2k, 2-4k tokens), reported beside the gate's figures.

The decision is ``eval.gate.decide`` once per concurrency (tau > tau* (1 + margin), tau > incumbent + min_delta
on every gate dataset, each read through its bootstrap interval over the requests); the candidate ships only if it
passes at every concurrency. The servers' own settings
(``/server_info``) are checked first: the candidate and incumbent must speculate with the same flags, the
baseline must not, all must serve one target, and a server must serve the checkpoint it is gated as.

The gate's frame is the HF gate's (``eval.gate_flow.run_gate``), with this measurement: the whole gate holds the
promotions lock after ``reconcile``, the report is saved, the decision record is appended (for a promotion, before
``promoted`` switches to its immutable copy), then the decision printed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import ConfigError, GateConfig, RunConfig
from common.files import json_safe, json_text, write_text_atomic
from drafter.sglang_checkpoint import fingerprint
from eval import breakeven, metrics
from eval.context_buckets import HeldOutBuckets, holdout_buckets
from eval.gate import decide
from eval.gate_flow import Measured, gate_datasets, run_gate
from eval.gate_stats import bootstrap, evidence, evidence_record, per_prompt, timed_tau_star
from eval.gate_tries import at_level, tries
from eval.intervals import constant
from eval.prompts import rendered_datasets
from eval.report import decimals, gate_lines
from eval.sglang_client import ServerError, add_histogram, auth_headers, generate, histogram_of, server_info
from target_model.hf_model import tokenizer_from_config

SPEC_ALGORITHMS = ("EAGLE3", "EAGLE")
ROLE_KEYS = {"candidate": "server_url", "incumbent": "incumbent_url", "baseline": "baseline_url"}


# ---------------------------------------------------------------- one request, one server
@dataclass(frozen=True)
class RequestStats:
    """What one finished /generate says about itself."""

    completion_tokens: int
    verify: int | None  # spec_verify_ct; None on a server without speculation
    histogram: list[int] | None
    e2e_s: float  # meta_info.e2e_latency, else the client's wall time
    ttft_s: float | None  # meta_info.first_token_latency (servers started with --enable-metrics)

    @property
    def decode_s(self) -> float:
        return self.e2e_s - (self.ttft_s or 0.0)


def request_stats(body: dict, client_s: float, url: str, speculative: bool) -> RequestStats:
    meta = body["meta_info"]
    tokens = meta.get("completion_tokens")
    verify = meta.get("spec_verify_ct")
    if not isinstance(tokens, int):
        raise ServerError(f"{url}/generate: meta_info.completion_tokens missing")
    if speculative and verify is None and tokens <= 1:
        # Ended at its prefill token: no verify cycle, and SGLang then sends no spec_* field at all
        # (tokenizer_manager.py ``_calculate_spec_decoding_metrics`` runs only when spec_verify_ct > 0).
        verify = 0
    if speculative and not isinstance(verify, int):
        raise ServerError(f"{url}/generate: meta_info.spec_verify_ct missing for a request of {tokens} tokens "
                          "(is speculative decoding on?)")
    e2e = meta.get("e2e_latency")
    ttft = meta.get("first_token_latency")
    return RequestStats(tokens, verify if speculative else None, histogram_of(meta) if speculative else None,
                        float(e2e) if isinstance(e2e, int | float) else client_s,
                        float(ttft) if isinstance(ttft, int | float) else None)


def run_prompts(url: str, prompts: Sequence[Sequence[int]], concurrency: int, temperature: float,
                max_new_tokens: int, timeout: float, headers: Mapping[str, str],
                speculative: bool) -> list[RequestStats]:
    """Every prompt once, ``concurrency`` requests in flight; results in prompt order."""
    def one(ids: Sequence[int]) -> RequestStats:
        body, elapsed = generate(url, ids, temperature, max_new_tokens, timeout, headers)
        return request_stats(body, elapsed, url, speculative)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, prompts))


def _cycle_tokens(r: RequestStats, exact: bool) -> int:
    """Tokens a request's verify cycles produced: from its histogram when every request has one (``exact``), else
    completion_tokens - 1 (the prefill token is no cycle's)."""
    return sum((a + 1) * n for a, n in enumerate(r.histogram or [])) if exact else r.completion_tokens - 1


def spec_summary(all_results: Sequence[RequestStats]) -> dict:
    """tau, alpha_k and t_cycle of a speculating server over some requests. A request without a verify cycle
    (it ended at its prefill token) says nothing about the drafter: counted (``requests_without_cycles``) and left
    out of every figure."""
    results = [r for r in all_results if r.verify]
    verify = sum(r.verify or 0 for r in results)
    tokens = sum(r.completion_tokens for r in results)
    hist: list[int] = []
    for r in results:
        add_histogram(hist, r.histogram or [])
    exact = all(r.histogram is not None for r in results) and sum(hist) == verify and verify > 0
    if exact:
        tau, source = metrics.tau_from_histogram(hist), "spec_correct_drafts_histogram"
    else:
        tau = (tokens - len(results)) / verify if verify else float("nan")
        source = "(completion_tokens - 1) / spec_verify_ct"
    timed = all(r.ttft_s is not None for r in results)
    out = {"requests": len(all_results), "requests_without_cycles": len(all_results) - len(results),
           "completion_tokens": tokens, "spec_verify_ct": verify, "tau": tau,
           "tau_source": source, "sglang_accept_length": tokens / verify if verify else float("nan"),
           "histogram": hist if exact else None,
           "cycle_ms": 1000 * sum(r.decode_s for r in results) / verify if verify else float("nan"),
           "cycle_source": "e2e_latency - first_token_latency" if timed else
           "e2e_latency (prefill and queueing included: start the servers with --enable-metrics)",
           # per request in prompt order, one without cycles as zeros: the candidate and the incumbent stay paired
           "per_prompt": {"tokens": [_cycle_tokens(r, exact) if r.verify else 0 for r in all_results],
                          "cycles": [r.verify or 0 for r in all_results]},
           "per_prompt_timing": {"cycle_s": [r.decode_s if r.verify else 0.0 for r in all_results],
                                 "cycles": [r.verify or 0 for r in all_results]}}
    if exact:
        out["alpha_conditional"] = metrics.conditional_rates(hist)
        out["alpha_unconditional"] = metrics.unconditional_rates(hist)
    return out


def decode_summary(results: Sequence[RequestStats]) -> dict:
    """t_decode of a server without speculation."""
    timed = all(r.ttft_s is not None for r in results)
    steps = sum(r.completion_tokens - (1 if timed else 0) for r in results)
    seconds = sum(r.decode_s for r in results)
    return {"requests": len(results), "completion_tokens": sum(r.completion_tokens for r in results),
            "decode_ms": 1000 * seconds / steps if steps else float("nan"),
            "per_prompt": {"decode_s": [r.decode_s for r in results],
                           "steps": [r.completion_tokens - (1 if timed else 0) for r in results]},
            "source": "(e2e_latency - first_token_latency) / (completion_tokens - 1)" if timed else
            "e2e_latency / completion_tokens (prefill included: start the servers with --enable-metrics)"}


# ---------------------------------------------------------------- the servers' own settings
def served_settings(info: dict) -> dict:
    """The fields of /server_info the gate relies on (sglang srt/arg_groups/fields/spec.py names)."""
    return {"model_path": info.get("model_path"), "speculative_algorithm": info.get("speculative_algorithm"),
            "num_steps": info.get("speculative_num_steps"), "topk": info.get("speculative_eagle_topk"),
            "draft_tokens": info.get("speculative_num_draft_tokens"),
            "draft_model_path": info.get("speculative_draft_model_path"), "version": info.get("version")}


def _name(path: Any) -> str:
    return Path(str(path).rstrip("/")).name


def check_servers(servers: Mapping[str, dict], urls: Mapping[str, str], checkpoints: Mapping[str, str]) -> list[str]:
    """Every reason the servers cannot be compared as configured; empty when they can."""
    problems = []
    for role in ("candidate", "incumbent"):
        s = servers.get(role)
        if s is None:
            continue
        if s["speculative_algorithm"] not in SPEC_ALGORITHMS:
            problems.append(f"eval.sglang.{ROLE_KEYS[role]}: {urls[role]} serves with speculative_algorithm "
                            f"{s['speculative_algorithm']!r}; start it with --speculative-algorithm EAGLE3 "
                            f"--speculative-draft-model-path <the {role}>")
        elif role in checkpoints and _name(s["draft_model_path"]) != _name(checkpoints[role]):
            problems.append(f"eval.sglang.{ROLE_KEYS[role]}: {urls[role]} serves the drafter "
                            f"{s['draft_model_path']}, not the {role} {checkpoints[role]}")
    base = servers.get("baseline")
    if base is not None and base["speculative_algorithm"]:
        problems.append(f"eval.sglang.baseline_url: {urls['baseline']} speculates ({base['speculative_algorithm']}); "
                        "t_decode needs a server without --speculative-algorithm")
    flags = ("num_steps", "topk", "draft_tokens")
    if "incumbent" in servers and "candidate" in servers:
        c, i = ([servers[r][f] for f in flags] for r in ("candidate", "incumbent"))
        if c != i:
            problems.append(f"eval.sglang.server_url and eval.sglang.incumbent_url speculate with different "
                            f"(num_steps, topk, draft_tokens): {tuple(c)} vs {tuple(i)}; serve both with the same "
                            "--speculative-* flags (eval sweep compares settings)")
    models = {r: _name(s["model_path"]) for r, s in servers.items()}
    if len(set(models.values())) > 1:
        problems.append(f"eval.sglang: the servers serve different targets {models}")
    return problems


# ---------------------------------------------------------------- measure, decide
def measure_live(cfg: RunConfig, prompts: Mapping[str, Sequence[Sequence[int]]],
                 checkpoints: Mapping[str, str], context: HeldOutBuckets | None = None) -> dict:
    """The live report: settings of every server and, per concurrency, t_decode, t_cycle, tau* and each
    drafter's tau/alpha per dataset; with ``context``, tau by history length (``live_tau_by_context``).
    ``checkpoints``: role -> local dir the server of that role must serve."""
    live = cfg.eval.sglang
    if live is None:
        raise ConfigError("eval.sglang: missing; --live needs at least eval.sglang.server_url")
    urls = {role: getattr(live, key) for role, key in ROLE_KEYS.items() if getattr(live, key)}
    headers = auth_headers(live.api_key_env)
    if "incumbent" in checkpoints and "incumbent" not in urls:
        raise ConfigError("eval.sglang.incumbent_url: missing; an incumbent is measured on its own server")
    servers = {role: served_settings(server_info(url, live.timeout_s, headers)) for role, url in urls.items()}
    problems = check_servers(servers, urls, checkpoints)
    if problems:
        raise ServerError("; ".join(problems))
    k = int(servers["candidate"]["num_steps"] or cfg.eval.num_steps)
    if "baseline" not in urls:
        t = cfg.eval.timings
        if t is None or k not in t.cycle_ms:
            raise ConfigError(f"eval.sglang.baseline_url: missing, and eval.timings has no cycle time for the "
                              f"served k = {k}; give a baseline server or eval.timings.cycle_ms.{k}")
    T, n_new = cfg.eval.temperature, cfg.eval.max_new_tokens
    report: dict = {"mode": "live", "target": servers["candidate"]["model_path"], "servers": servers,
                    "urls": urls, "prompts": {ds: len(p) for ds, p in prompts.items()},
                    "settings": {"num_steps": k, "topk": servers["candidate"]["topk"],
                                 "draft_tokens": servers["candidate"]["draft_tokens"], "temperature": T,
                                 "max_new_tokens": n_new, "concurrency": list(live.concurrency)},
                    "by_concurrency": {}}
    everything = [p for ps in prompts.values() for p in ps]
    for c in live.concurrency:
        row: dict = {"drafters": {}}
        if "baseline" in urls:
            base = decode_summary(run_prompts(urls["baseline"], everything, c, T, n_new, live.timeout_s, headers,
                                              speculative=False))
            row["baseline"] = base
            decode_ms, source = base["decode_ms"], "measured (baseline server)"
        else:
            decode_ms, source = cfg.eval.timings.decode_ms, f"config (eval.timings, k = {k})"
        for role in ("candidate", "incumbent"):
            if role not in urls:
                continue
            per_ds = {ds: run_prompts(urls[role], p, c, T, n_new, live.timeout_s, headers, speculative=True)
                      for ds, p in prompts.items()}
            for ds, rs in per_ds.items():
                if not any(r.verify for r in rs):
                    raise ServerError(f"eval.sglang.{ROLE_KEYS[role]}: {urls[role]}: none of the {len(rs)} {ds} "
                                      f"requests at concurrency {c} had a verify cycle (each ended at its first "
                                      "token): nothing to measure; check the prompts and eval.max_new_tokens")
            row["drafters"][role] = {"datasets": {ds: spec_summary(rs) for ds, rs in per_ds.items()},
                                     "all": spec_summary([r for rs in per_ds.values() for r in rs])}
        cycle_ms = (row["drafters"]["candidate"]["all"]["cycle_ms"] if "baseline" in urls
                    else cfg.eval.timings.cycle_ms[k])
        row["breakeven"] = breakeven.breakeven(decode_ms, cycle_ms, k, cfg.eval.target_tps) | {"source": source}
        for d in row["drafters"].values():
            tau = d["all"]["tau"]
            d["tokens_per_s_per_request"] = 1000 * tau / cycle_ms if math.isfinite(tau) else float("nan")
            d["speedup"] = tau / row["breakeven"]["tau_star"]
        report["by_concurrency"][str(c)] = row
    if context is not None:
        report["tau_by_context"] = live_tau_by_context(cfg, context, urls, headers)
    return report


def live_tau_by_context(cfg: RunConfig, context: HeldOutBuckets, urls: Mapping[str, str],
                        headers: Mapping[str, str]) -> dict:
    """tau per history-length bucket on the held-out turns, from the candidate's and the incumbent's servers at
    the highest concurrency (tau hardly moves with it; the long prompts go fastest there), each bucket's interval
    resampling conversations. A report figure: the gate decides on its datasets alone."""
    if context.skipped:
        return context.header()
    prompts = context.ids()
    if not prompts:
        return {**context.header(), "skipped": "no held-out turn fits a bucket"}
    live, boot = cfg.eval.sglang, bootstrap(cfg.gate)
    c = max(live.concurrency)
    drafters = {}
    for role in ("candidate", "incumbent"):
        if role not in urls:
            continue
        measured = {name: per_prompt(spec_summary(run_prompts(urls[role], ps, c, cfg.eval.temperature,
                                                              cfg.eval.max_new_tokens, live.timeout_s, headers,
                                                              speculative=True)))
                    for name, ps in prompts.items()}
        drafters[role] = context.figures(measured, boot)
    return {**context.header(), "concurrency": c, "drafters": drafters}


def decide_live(report: dict, gate_datasets: Sequence[str], gate: GateConfig) -> tuple[str, list[str], dict, dict]:
    """``decide`` at every concurrency, on intervals from the requests (the candidate's and the incumbent's servers
    answer the same prompts, so they are paired request by request; tau* is resampled over the baseline's and the
    candidate's requests, fixed when it comes from eval.timings). The verdict is promote only if every concurrency
    promotes, reject if any rejects (a loss read family-wise over every concurrency's comparisons), else
    unresolved. Returns (verdict, reasons, taus, intervals) per concurrency."""
    boot = bootstrap(gate)
    verdicts, reasons, taus, intervals, evs = [], [], {}, {}, {}
    for c, row in report["by_concurrency"].items():
        cand = row["drafters"]["candidate"]
        inc = row["drafters"].get("incumbent", {}).get("datasets")
        taus[c] = {ds: cand["datasets"][ds]["tau"] for ds in gate_datasets}
        tau_star = (timed_tau_star(row["baseline"], cand["all"]["per_prompt_timing"], boot) if "baseline" in row
                    else constant(row["breakeven"]["tau_star"], boot))
        evs[c] = {ds: evidence(per_prompt(cand["datasets"][ds]), tau_star, gate.margin, boot,
                               per_prompt(inc[ds]) if inc else None) for ds in gate_datasets}
    comparisons = sum(e.comparisons for ev in evs.values() for e in ev.values())  # a loss is read over them all
    for c, ev in evs.items():
        d = decide(ev, gate.margin, gate.min_delta, comparisons=comparisons)
        verdicts.append(d.verdict)
        reasons += [f"concurrency {c}: {r}" for r in d.reasons]
        intervals[c] = evidence_record(ev, d)
    verdict = next((v for v in ("reject", "unresolved") if v in verdicts), "promote")
    return verdict, reasons, taus, intervals


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = [f"# Live eval report: {r['name']}", "",
             f"Target `{r['target']}` on SGLang, k = {s['num_steps']}, topk = {s['topk']}, draft tokens = "
             f"{s['draft_tokens']}, T = {s['temperature']}, max_new_tokens = {s['max_new_tokens']}; prompts: "
             + ", ".join(f"{n} {d}" for d, n in r["prompts"].items()) + ".", ""]
    for role, srv in r["servers"].items():
        lines.append(f"- {role}: {r['urls'][role]} (drafter `{srv['draft_model_path']}`, SGLang {srv['version']})")
    for c, row in r["by_concurrency"].items():
        be = row["breakeven"]
        lines += ["", f"## Concurrency {c}", "",
                  f"- tau* = {decimals(be['tau_star'])} = cycle {decimals(be['cycle_ms'], 2)} ms / decode "
                  f"{decimals(be['decode_ms'], 2)} "
                  f"ms ({be['source']})"]
        hdr = ["drafter", "dataset", "tau", "alpha_1..k", "cycle ms", "tok/s per request", "speed-up"]
        lines += ["", "| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
        for role, d in row["drafters"].items():
            for ds, st in d["datasets"].items():
                alphas = " / ".join(decimals(a, 2) for a in st.get("alpha_conditional") or []) or "–"
                lines.append(f"| {role} | {ds} | {decimals(st['tau'])} | {alphas} | {decimals(st['cycle_ms'], 2)} | "
                             f"{decimals(d['tokens_per_s_per_request'], 1)} | x{decimals(d['speedup'], 2)} |")
        skipped = [f"- {role}, {ds}: {st['requests_without_cycles']} of {st['requests']} requests ended at their "
                   "first token (no verify cycle): left out of tau and the cycle time"
                   for role, d in row["drafters"].items() for ds, st in d["datasets"].items()
                   if st.get("requests_without_cycles")]
        lines += ["", *skipped] if skipped else []
    lines += context_markdown(r.get("tau_by_context"))
    lines += ["", "Lossless: not checked on live servers (compare outputs with `eval gate` on the HF target)."]
    if "gate" in r:
        lines += ["", *gate_lines(r["gate"])]
    return "\n".join(lines) + "\n"


def context_markdown(ctx: dict | None) -> list[str]:
    """The report's tau-by-history-length table (or the reason there is none)."""
    if not ctx:
        return []
    if "skipped" in ctx:
        return ["", f"tau by history length: not measured ({ctx['skipped']})."]
    roles = list(ctx["drafters"])
    lines = ["", f"## tau by history length (held-out turns, concurrency {ctx['concurrency']})", "",
             f"{ctx['holdout_conversations']} held-out conversations of `{ctx['source']}`; intervals resample "
             "conversations. Not part of the decision.", "",
             "| history tokens | prompts | conversations | " + " | ".join(f"{r} tau" for r in roles) + " |",
             "|" + "---|" * (3 + len(roles))]
    for name in ctx["drafters"][roles[0]]:  # the candidate's server is always measured
        b = {r: ctx["drafters"][r][name] for r in roles}
        first = b[roles[0]]
        lines.append(f"| {name} | {first['prompts']} | {first['conversations']} | " + " | ".join(
            f"{decimals(x['tau'])} [{decimals(x['ci'][0])}, {decimals(x['ci'][1])}]" for x in b.values()) + " |")
    return lines


def write_live_report(cfg: RunConfig, report: dict) -> Path:
    out = cfg.eval_dir / report["name"]
    out.mkdir(parents=True, exist_ok=True)
    clean = json_safe(report)
    write_text_atomic(out / "report.json", json_text(clean, indent=2) + "\n")
    write_text_atomic(out / "report.md", markdown(clean))
    print(markdown(clean))
    print(f"report: {out}/report.{{json,md}}")
    return out


def live_tokenizer(cfg: RunConfig) -> Any:
    """The target's tokenizer: the gate renders prompts as the server renders them."""
    return tokenizer_from_config(cfg.target)


def live_prompts(cfg: RunConfig, tokenizer: Any = None) -> dict[str, list[list[int]]]:
    """The eval prompts rendered with the target's tokenizer (loaded unless given) and chat_template_kwargs, as the
    server renders."""
    return rendered_datasets(tokenizer or live_tokenizer(cfg), cfg.eval.datasets,
                             template_kwargs=cfg.target.chat_template_kwargs)


def live_inputs(cfg: RunConfig, prompts: Mapping[str, Sequence[Sequence[int]]] | None
                ) -> tuple[Mapping[str, Sequence[Sequence[int]]], HeldOutBuckets]:
    """The eval prompts (rendered unless given) and the run's held-out turns by history length
    (eval.sglang.context_prompts per bucket), the target's tokenizer loaded at most once, only when needed."""
    tokenizer = functools.cache(lambda: live_tokenizer(cfg))
    context = holdout_buckets(cfg.conversations_path, cfg.train.holdout_fraction, cfg.eval.sglang.context_prompts,
                              tokenizer, cfg.target.chat_template_kwargs)
    return prompts or live_prompts(cfg, tokenizer()), context


def run_live(cfg: RunConfig, checkpoint: str | None, name: str,
             prompts: Mapping[str, Sequence[Sequence[int]]] | None = None) -> dict:
    """``eval run --live``: the report only."""
    eval_prompts, context = live_inputs(cfg, prompts)
    report = measure_live(cfg, eval_prompts, {"candidate": checkpoint} if checkpoint else {}, context)
    report["name"] = name
    write_live_report(cfg, report)
    return report


def live_gate(cfg: RunConfig, checkpoint: str, incumbent: str | None, do_promote: bool, name: str,
              prompts: Mapping[str, Sequence[Sequence[int]]] | None = None) -> str:
    """``eval gate --live``: "promoted", "passed", "unresolved" or "rejected"; history and report written as the HF
    gate's, in the same frame (``eval.gate_flow.run_gate``: the promotions lock, reconcile, the crash-safe
    promotion)."""
    def measure(_serving: dict | None, fp: str) -> Measured:
        checkpoints = {"candidate": checkpoint} | ({"incumbent": incumbent} if incumbent else {})
        eval_prompts, context = live_inputs(cfg, prompts)
        report = measure_live(cfg, eval_prompts, checkpoints, context)
        report["name"] = name
        gate_ds = gate_datasets(cfg)
        served = report["servers"].get("incumbent")
        # the incumbent by its weights when its directory is given, else by the path its server names
        tried = tries(cfg, fp, fingerprint(incumbent) if incumbent else served["draft_model_path"] if served else None,
                      "live")
        verdict, reasons, taus, intervals = decide_live(report, gate_ds, at_level(cfg, tried.level).gate)
        reasons.append(tried.line(cfg.gate.history_file))
        report["intervals"] = intervals
        by_c = report["by_concurrency"]
        record = {
            "incumbent": {"served": served["draft_model_path"], "url": report["urls"]["incumbent"]} if served else None,
            "tau": taus,
            "incumbent_tau": {c: {ds: row["drafters"]["incumbent"]["datasets"][ds]["tau"] for ds in gate_ds}
                              for c, row in by_c.items()} if served else None,
            "tau_star": {c: row["breakeven"]["tau_star"] for c, row in by_c.items()},
            "timings_source": {c: row["breakeven"]["source"] for c, row in by_c.items()}, "intervals": intervals,
            "tries": tried.record()}
        return Measured(report, verdict == "promote", reasons, record, verdict == "unresolved")

    return run_gate(cfg, checkpoint, do_promote, "eval gate --live", measure, write_live_report, {"mode": "live"})

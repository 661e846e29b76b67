"""Measure drafter checkpoints on the eval datasets with real speculative decoding, and write the report.

``evaluate`` loads the HF target and each drafter (candidate, optionally the incumbent), decodes every
eval prompt plainly and speculatively (``eval.measure``) and adds the break-even τ* from the configured
or measured timings, with a bootstrap interval for every tau and for tau* (``eval.gate_stats``); ``evaluate_live``
asks a running SGLang server instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.config import ConfigError, RunConfig
from drafter.factory import load_for_target
from drafter.sglang_checkpoint import fingerprint
from eval import breakeven
from eval.gate_stats import annotate, bootstrap
from eval.measure import Settings, measure
from eval.prompts import rendered_datasets
from eval.report import PLOTS, log_to_trackers, markdown, write_report
from eval.sglang_client import live_eval
from eval.speculative import Eagle3Proposer, Engine
from eval.turns import eval_prompts, records_skipped_short
from target_model.hf_model import load_target_from_config, stop_token_ids, tokenizer_from_config


def evaluate(cfg: RunConfig, checkpoints: dict[str, str], name: str) -> dict:
    """Load the target and each drafter (role -> checkpoint dir), decode every eval prompt, and assemble
    the report (with the records each dataset skipped for too few user turns: prompts it does not measure)."""
    target = load_target_from_config(cfg.target)
    proposers = {}
    for role, path in checkpoints.items():
        drafter, ids = load_for_target(path, target.embed_weight(), target.num_layers, cfg.target.aux_layer_ids,
                                       device=target.device, dtype=target.dtype)
        proposers[role] = Eagle3Proposer(drafter, ids)
    prompts = eval_prompts(target, cfg.eval.datasets, cfg.eval.max_new_tokens, cfg.target.chat_template_kwargs)
    engine = Engine(target, proposers["candidate"].aux_layer_ids, stop_token_ids(target.tokenizer))
    s = Settings(cfg.eval.num_steps, cfg.eval.temperature, cfg.eval.max_new_tokens, cfg.eval.seed,
                 cfg.eval.acceptance, cfg.eval.tie_epsilon)
    report = {"name": name, "target": cfg.target.name, "device": str(target.device), **measure(engine, prompts,
                                                                                                proposers, s)}
    report["records_skipped_short"] = records_skipped_short(prompts)  # per dataset, beside report["prompts"]
    report["checkpoints"] = {role: {"path": str(Path(p).resolve()), "fingerprint": fingerprint(p)}
                             for role, p in checkpoints.items()}
    if cfg.eval.timings:  # a cycle with k drafts costs its own time: the entry for this k (checked at load)
        decode, cycle = cfg.eval.timings.decode_ms, cfg.eval.timings.cycle_ms[s.num_steps]
        source = f"config (eval.timings, k = {s.num_steps})"
    else:
        decode = report["plain"]["decode_ms"]
        cycle, source = report["drafters"]["candidate"]["cycle_ms"], "measured"
    report["breakeven"] = breakeven.breakeven(decode, cycle, s.num_steps, cfg.eval.target_tps) | {"source": source}
    return annotate(report, bootstrap(cfg.gate))


def save_report(cfg: RunConfig, report: dict) -> Path:
    """report.{json,md} and the plots under run_dir/eval/<name>, logged to the configured trackers too; the
    Markdown is printed."""
    out = write_report(report, cfg.eval_dir / report["name"])
    written = json.loads((out / "report.json").read_text())
    if cfg.tracking.report_to:
        log_to_trackers(written, cfg.tracking, cfg.tracking_dir, [out / f"{p}.png" for p in PLOTS])
    print(markdown(written))
    print(f"report: {out}/report.{{json,md}}, " + ", ".join(f"{p}.png" for p in PLOTS))
    return out


def evaluate_live(cfg: RunConfig) -> dict:
    """τ and α_k from a live SGLang server (unverified: see eval/sglang_client.py)."""
    if cfg.eval.sglang is None:
        raise ConfigError("eval.sglang: missing (server_url, optional baseline_url) for live mode")
    tok = tokenizer_from_config(cfg.target)  # as the live gate renders (live_gate.live_tokenizer)
    prompts = rendered_datasets(tok, cfg.eval.datasets, template_kwargs=cfg.target.chat_template_kwargs)
    return live_eval(cfg.eval.sglang.server_url, cfg.eval.sglang.baseline_url, prompts, cfg.eval.temperature,
                     cfg.eval.max_new_tokens)

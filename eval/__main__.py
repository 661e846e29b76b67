"""python -m eval {run,gate,breakeven,sglang}: measure a drafter checkpoint and decide whether it ships.

  run        speculative decoding against the HF target on the eval datasets; report only
  gate       run + the ship decision (exit 0 pass / 1 reject / 2 error), --promote to copy it into place
  breakeven  tau* and the alpha a tok/s goal needs, from given timings (JSON)
  sglang     tau and alpha_k from a live SGLang server (unverified: see eval/sglang_client.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.config import ConfigError, RunConfig, load_config
from common.wheels import MissingWheelError
from drafter.checkpoint import CheckpointError, check_checkpoint, fingerprint
from drafter.factory import load_for_target
from drafter.target import TargetError, load_target_from_config, resolve_source, stop_token_ids
from eval import breakeven
from eval.gate import append_history, decide, promote
from eval.measure import Settings, measure
from eval.prompts import PromptError, rendered_datasets
from eval.report import markdown, write_report
from eval.sglang_client import ServerError, live_eval
from eval.speculative import Eagle3Proposer, Engine

EXIT_PASS, EXIT_REJECT, EXIT_ERROR = 0, 1, 2


def evaluate(cfg: RunConfig, checkpoints: dict[str, str], name: str) -> dict:
    """Load the target and each drafter, decode every eval prompt, and assemble the report."""
    target = load_target_from_config(cfg.target)
    proposers = {}
    for role, path in checkpoints.items():
        drafter, ids = load_for_target(path, target.embed_weight(), target.num_layers, cfg.target.aux_layer_ids,
                                       device=target.device, dtype=target.dtype)
        proposers[role] = Eagle3Proposer(drafter, ids)
    prompts = rendered_datasets(target.tokenizer, cfg.eval.datasets)
    engine = Engine(target, proposers["candidate"].aux_layer_ids, stop_token_ids(target.tokenizer))
    s = Settings(cfg.eval.num_steps, cfg.eval.temperature, cfg.eval.max_new_tokens, cfg.eval.seed)
    report = {"name": name, "target": cfg.target.name, "device": str(target.device), **measure(engine, prompts,
                                                                                                proposers, s)}
    report["checkpoints"] = {role: {"path": str(Path(p).resolve()), "fingerprint": fingerprint(p)}
                             for role, p in checkpoints.items()}
    if cfg.eval.timings:
        decode, cycle, source = cfg.eval.timings.decode_ms, cfg.eval.timings.cycle_ms, "config (eval.timings)"
    else:
        decode = report["plain"]["decode_ms"]
        cycle, source = report["drafters"]["candidate"]["phases_ms_per_cycle"]["cycle"], "measured"
    report["breakeven"] = breakeven.breakeven(decode, cycle, s.num_steps, cfg.eval.target_tps) | {"source": source}
    return report


def save(cfg: RunConfig, report: dict) -> Path:
    out = write_report(report, cfg.eval_dir / report["name"],
                       cfg.train.wandb_project if cfg.train.report_to == "wandb" else None)
    print(markdown(json.loads((out / "report.json").read_text())))
    print(f"report: {out}/report.{{json,md}}, alpha.png, tau.png")
    return out


def gate(cfg: RunConfig, checkpoint: str, incumbent: str | None, do_promote: bool, name: str) -> int:
    record: dict = {"checkpoint": str(Path(checkpoint).resolve()), "fingerprint": None, "incumbent": None}
    problems = check_checkpoint(checkpoint)
    if problems:  # nothing to measure: SGLang would serve it wrongly
        d = decide({}, float("nan"), cfg.gate.margin, checkpoint_problems=problems)
        append_history(cfg.gate.history_file, record | {"decision": "rejected", "reasons": d.reasons})
        print("REJECTED\n" + "\n".join(f"  - {r}" for r in d.reasons))
        return EXIT_REJECT
    record["fingerprint"] = fingerprint(checkpoint)
    notes = []
    if incumbent is None and (Path(cfg.gate.promoted_dir) / "config.json").is_file():
        incumbent = cfg.gate.promoted_dir  # what is serving now
    if incumbent is not None and check_checkpoint(incumbent, check_finite=False):
        notes.append(f"incumbent {incumbent} fails check_checkpoint; compared against break-even only")
        incumbent = None
    checkpoints = {"candidate": checkpoint} | ({"incumbent": incumbent} if incumbent else {})
    report = evaluate(cfg, checkpoints, name)
    gate_ds = cfg.gate.datasets or [d.name for d in cfg.eval.datasets]
    cand = report["drafters"]["candidate"]
    tau = {ds: cand["datasets"][ds]["tau"] for ds in gate_ds}
    inc_tau = ({ds: report["drafters"]["incumbent"]["datasets"][ds]["tau"] for ds in gate_ds}
               if incumbent else None)
    mismatches = [f"{m['dataset']} prompt {m['prompt']} differs from greedy at token {m['first_divergence']}"
                  for m in cand["lossless"].get("mismatches", [])]
    d = decide(tau, report["breakeven"]["tau_star"], cfg.gate.margin, inc_tau, cfg.gate.min_delta,
               lossless_mismatches=mismatches)
    decision = ("promoted" if do_promote else "passed") if d.promote else "rejected"
    if d.promote and do_promote:
        notes.append(f"copied to {promote(checkpoint, cfg.gate.promoted_dir)}")
    report["gate"] = {"decision": decision, "reasons": d.reasons + notes, "datasets": gate_ds,
                      "margin": cfg.gate.margin, "min_delta": cfg.gate.min_delta}
    save(cfg, report)
    append_history(cfg.gate.history_file, record | {
        "incumbent": report["checkpoints"].get("incumbent"), "tau": tau, "incumbent_tau": inc_tau,
        "alpha": {ds: cand["datasets"][ds]["alpha_conditional"] for ds in gate_ds},
        "tau_star": report["breakeven"]["tau_star"], "timings_source": report["breakeven"]["source"],
        "decision": decision, "reasons": d.reasons + notes})
    print(decision.upper())
    return EXIT_PASS if d.promote else EXIT_REJECT


def sglang(cfg: RunConfig) -> dict:
    from transformers import AutoTokenizer

    if cfg.eval.sglang is None:
        raise ConfigError("eval.sglang: missing (server_url, optional baseline_url) for live mode")
    tok = AutoTokenizer.from_pretrained(resolve_source(cfg.target.name, cfg.target.gguf_file),
                                        trust_remote_code=cfg.target.trust_remote_code)
    prompts = rendered_datasets(tok, cfg.eval.datasets)
    return live_eval(cfg.eval.sglang.server_url, cfg.eval.sglang.baseline_url, prompts, cfg.eval.temperature,
                     cfg.eval.max_new_tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("run", "gate", "sglang"):
        p = sub.add_parser(cmd)
        p.add_argument("--config", required=True)
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
        if cmd != "sglang":
            p.add_argument("--checkpoint", required=True)
            p.add_argument("--name", help="report folder under run_dir/eval (default: the checkpoint's name)")
        if cmd == "gate":
            p.add_argument("--incumbent", help="default: gate.promoted_dir when it holds a drafter")
            p.add_argument("--promote", action="store_true", help="copy a passing checkpoint to gate.promoted_dir")
    be = sub.add_parser("breakeven")
    be.add_argument("--decode-ms", type=float, required=True)
    be.add_argument("--cycle-ms", type=float, required=True)
    be.add_argument("--steps", type=int, default=3)
    be.add_argument("--target-tps", type=float)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "breakeven":
            print(json.dumps(breakeven.breakeven(args.decode_ms, args.cycle_ms, args.steps, args.target_tps), indent=2))
            return EXIT_PASS
        cfg = load_config(args.config, args.set)
        if args.cmd == "sglang":
            print(json.dumps(sglang(cfg), indent=2))
            return EXIT_PASS
        if not Path(args.checkpoint).is_dir():
            raise CheckpointError(f"{args.checkpoint}: no such checkpoint directory")
        name = args.name or Path(args.checkpoint).resolve().name
        if args.cmd == "run":
            save(cfg, evaluate(cfg, {"candidate": args.checkpoint}, name))
            return EXIT_PASS
        return gate(cfg, args.checkpoint, args.incumbent, args.promote, name)
    except (ConfigError, CheckpointError, TargetError, PromptError, MissingWheelError, ServerError,
            FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())

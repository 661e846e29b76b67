"""python -m eval {run,gate,quality,coverage,breakeven,sglang,sweep}: measure a drafter and decide whether it ships.

  run        speculative decoding on the eval datasets (the HF target, or --live: the eval.sglang servers); report
  quality    tau and alpha_k on every prompt of the eval datasets in batched passes, at several k:T (--settings),
             the lossless check, tau* per k from batch-1 timings, every tau with its interval, tau by history
             length on the held-out conversations; run_dir/eval/<name>/quality.json
  coverage   the share of the run's answer tokens (conversations.jsonl, the target's own) outside each drafter's
             draft vocab, no model loaded: a cycle end at T = 0 whatever the weights; run_dir/draft_vocab_coverage.json
  gate       run + the ship decision (exit 0 pass / 1 reject or unresolved / 2 error), --promote to serve it from
             gate.promoted_dir; --live takes tau, alpha_k and the timings from SGLang servers at each
             eval.sglang.concurrency
  breakeven  tau* and the alpha a tok/s goal needs, from given timings (JSON)
  sglang     tau and alpha_k from a live SGLang server (unverified: see eval/sglang_client.py)
  sweep      the --speculative-num-steps/-eagle-topk/-num-draft-tokens with the best tokens/s, from a cost
             table (--table) or measured on eval.sglang.server_url + sweep_urls (--config)
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from eval import commands
from eval.quality import DEFAULT_SETTINGS


def positive_number(text: str) -> float:
    """A finite number > 0: float() also takes nan and inf, which give meaningless figures without an error."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def whole_number(low: int) -> Callable[[str], int]:
    """An int >= ``low``: a count below it would be sliced or clamped into another count without a word."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {low}, got {text}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("run", "gate", "quality", "sglang"):
        p = sub.add_parser(cmd)
        p.add_argument("--config", required=True)
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
        if cmd != "sglang":
            p.add_argument("--checkpoint", required=True)
            p.add_argument("--name", help="report folder under run_dir/eval (default: the checkpoint's name)")
        if cmd in ("run", "gate"):
            p.add_argument("--live", action="store_true", help="measure on the eval.sglang servers")
        if cmd == "gate":
            p.add_argument("--incumbent", help="default: gate.promoted_dir when it holds a drafter")
            p.add_argument("--promote", action="store_true",
                           help="serve a passing checkpoint: gate.promoted_dir -> promotions/<fingerprint>/")
        if cmd == "quality":  # the target runs in float32 unless --set target.dtype=...
            p.add_argument("--incumbent", help="the drafter the candidate must beat: measured on the same prompts at "
                                               "the first setting, the gate reads the paired difference")
            p.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), metavar="K:T",
                           help="k:T pairs (drafts per cycle, temperature); the first one is the gate's")
            p.add_argument("--timing-prompts", type=whole_number(2), default=8,
                           help="prompts the batch-1 timings run on (at least 2: one gives tau* no interval)")
            p.add_argument("--limit", type=whole_number(1),
                           help="prompts per dataset (smoke runs; the figures are for all)")
            p.add_argument("--context-prompts", type=whole_number(0), default=80,
                           help="held-out turns per history-length bucket (tau_by_context; 0: none)")
    cv = sub.add_parser("coverage")
    cv.add_argument("--config", required=True, help="the run: its target's tokenizer and conversations.jsonl")
    cv.add_argument("--checkpoint", nargs="+", required=True, help="the drafters whose draft vocabs to read")
    cv.add_argument("--conversations", help="another conversations.jsonl (default: the run's)")
    cv.add_argument("--limit", type=whole_number(1), help="the first N conversations only")
    cv.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    sw = sub.add_parser("sweep")
    sw.add_argument("--config", help="measure on eval.sglang.server_url + sweep_urls and baseline_url")
    sw.add_argument("--table", help="a cost table JSON instead of measuring (see eval/serving_sweep.py)")
    sw.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    sw.add_argument("--out", help="output folder (default: run_dir/eval/sweep; with --table alone, beside it)")
    be = sub.add_parser("breakeven")
    be.add_argument("--decode-ms", type=positive_number, required=True)
    be.add_argument("--cycle-ms", type=positive_number, required=True)
    be.add_argument("--steps", type=whole_number(1), default=3)
    be.add_argument("--target-tps", type=positive_number)
    args = ap.parse_args(argv)
    if args.cmd == "breakeven":
        return commands.breakeven_command(args.decode_ms, args.cycle_ms, args.steps, args.target_tps)
    if args.cmd == "sglang":
        return commands.sglang_command(args.config, args.set)
    if args.cmd == "coverage":
        return commands.coverage_command(args.config, args.checkpoint, args.set, args.conversations, args.limit)
    if args.cmd == "sweep":
        return commands.sweep_command(args.config, args.table, args.set, args.out)
    if args.cmd == "quality":
        return commands.quality_command(args.config, args.checkpoint, args.set, args.name, args.settings,
                                        args.timing_prompts, args.limit, args.context_prompts, args.incumbent)
    if args.cmd == "run":
        return commands.run_command(args.config, args.checkpoint, args.set, args.name, args.live)
    return commands.gate_command(args.config, args.checkpoint, args.set, args.name, args.incumbent, args.promote,
                                 args.live)


if __name__ == "__main__":
    sys.exit(main())

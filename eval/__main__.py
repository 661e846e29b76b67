"""python -m eval {run,gate,breakeven,sglang}: measure a drafter checkpoint and decide whether it ships.

  run        speculative decoding against the HF target on the eval datasets; report only
  gate       run + the ship decision (exit 0 pass / 1 reject / 2 error), --promote to serve it from gate.promoted_dir
  breakeven  tau* and the alpha a tok/s goal needs, from given timings (JSON)
  sglang     tau and alpha_k from a live SGLang server (unverified: see eval/sglang_client.py)
"""

from __future__ import annotations

import argparse
import sys

from eval.commands import breakeven_command, gate_command, run_command, sglang_command


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
            p.add_argument("--promote", action="store_true",
                           help="serve a passing checkpoint: gate.promoted_dir -> promotions/<fingerprint>/")
    be = sub.add_parser("breakeven")
    be.add_argument("--decode-ms", type=float, required=True)
    be.add_argument("--cycle-ms", type=float, required=True)
    be.add_argument("--steps", type=int, default=3)
    be.add_argument("--target-tps", type=float)
    args = ap.parse_args(argv)
    if args.cmd == "breakeven":
        return breakeven_command(args.decode_ms, args.cycle_ms, args.steps, args.target_tps)
    if args.cmd == "sglang":
        return sglang_command(args.config, args.set)
    if args.cmd == "run":
        return run_command(args.config, args.checkpoint, args.set, args.name)
    return gate_command(args.config, args.checkpoint, args.set, args.name, args.incumbent, args.promote)


if __name__ == "__main__":
    sys.exit(main())

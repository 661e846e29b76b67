"""Where real decoding loses acceptance against the held-out set, for one checkpoint.

    python bench/decode_gap.py --config configs/smollm2-135m-h200.yaml --checkpoint runs/smollm2-h200/checkpoints/best

On every eval prompt (first turn, chat-templated; ``--limit`` for smoke runs) the drafter decodes at T = 0 with
k = eval.num_steps and each cycle is replayed by teacher forcing (``eval.decode_gap``): decode alpha_k, teacher-
forced acc_k over the same greedy answers (all positions, and the cycle starts only), and the share of cycles the
replay reproduces. Then teacher forcing on the run's held-out conversations, over whole answers and over the
first eval.max_new_tokens tokens of each. The target runs in fp32 (the quality eval's setting) unless
--target-dtype says otherwise. Writes
"decode_gap" with a cause sentence computed from those figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.results import record
from eval.decode_gap import cause, holdout_figures, measure_gap
from eval.quality import load_drafter, setup


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--limit", type=int, help="eval prompts per dataset (smoke runs; figures are for all)")
    ap.add_argument("--holdout-samples", type=int, default=400, help="held-out conversations to replay (0: none)")
    ap.add_argument("--loopy-conversations", type=Path,
                    help="also replay the held-out ones of these conversations (e.g. regenerated without stop_loops)")
    ap.add_argument("--target-dtype", default="float32",
                    help="the target's dtype (bfloat16: the features training saw on a GPU; the eval's is float32)")
    ap.add_argument("--name", default="decode_gap", help="the results.json object to write")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    cfg, target, prompts = setup(args.config, args.limit, args.target_dtype)
    drafter, aux_ids = load_drafter(target, cfg, args.checkpoint)
    k, max_new = cfg.eval.num_steps, cfg.eval.max_new_tokens
    per_dataset = measure_gap(target, drafter, aux_ids, prompts, k, max_new)
    figures: dict = {"checkpoint": str(args.checkpoint), "k": k, "max_new_tokens": max_new,
                     "target_dtype": args.target_dtype, **per_dataset}
    whole = first = None
    if args.holdout_samples and cfg.conversations_path.is_file():
        held = holdout_figures(cfg, target, drafter, aux_ids, cfg.conversations_path, args.holdout_samples, k, max_new)
        figures["holdout"] = held
        whole, first = held["acc"][0], held[f"acc_first{max_new}"][0]
        for name in per_dataset:
            figures[name][f"holdout_acc0_first{max_new}"] = first
    if args.holdout_samples and args.loopy_conversations:
        figures["holdout_loopy"] = holdout_figures(cfg, target, drafter, aux_ids, args.loopy_conversations,
                                                   args.holdout_samples, k, max_new)
    loopy = figures["holdout_loopy"]["acc"][0] if "holdout_loopy" in figures else None
    figures["cause"] = cause(per_dataset, whole, first, loopy)
    record(args.name, figures)
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

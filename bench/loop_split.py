"""How much of a drafter's tau comes from the target's degenerate loops: tau outside the loop tails and inside them,
per eval set, k = 3, T = 0, fp32 target, each with its bootstrap interval; and for each drafter after the first, its
paired difference from the first outside the loops and inside them.

    python bench/loop_split.py --config configs/smollm2-135m-h200.yaml --set target.device=cpu \
        --checkpoint drafters/smollm2-135m-eagle3 runs/smollm2-h200-stage11

A greedy small target often ends an answer in a loop (the same block again until max_new_tokens), and a drafter
copies such a tail almost perfectly, so tau over a whole answer mixes two things: how well the drafter predicts
the target's text, and how much of the answer is a loop. A target that does not loop when it is served (the
mission's) sees only the first. A loop is what regeneration cuts (``engine.loops.loop_start`` with
``regenerate.loop_min_repeat_tokens`` and ``loop_max_period``); a verify cycle is inside it when the first token it
produces is one of the loop's copies. At T = 0 every drafter yields the target's greedy tokens, so every drafter's
answers share one split. A cycle keeps no draft when the target refuses its first draft, the one a drafter makes from
the target's own features; inside a loop, which a drafter should copy, such cycles say what it drafted instead, so
each set also names the commonest first drafts refused there, with the token the target produced. Recorded as
"loop_split".
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from bench.drafters_parser import drafters_parser
from bench.results import record
from engine.batched import BatchedTarget
from engine.loops import loop_start
from eval.batched_speculative import cycle_starts, speculative_batch
from eval.gate_stats import bootstrap
from eval.intervals import Bootstrap, paired_difference, ratio_estimate
from eval.quality import load_drafter, quality_config, target_and_prompts
from target_model.hf_model import stop_token_ids

PARTS = ("outside_loops", "in_loops")
PerPrompt = dict[str, list[int]]


def cycles_in_loop(tokens: Sequence[int], accepted: Sequence[int], min_repeat_tokens: int, max_period: int
                   ) -> list[tuple[int, bool]]:
    """(where it starts in ``tokens``, whether it is inside the tail loop) of each verify cycle of one answer."""
    start = loop_start(tokens, min_repeat_tokens, max_period)
    return [(pos, start is not None and pos >= start) for pos in cycle_starts(accepted)]


def split_cycles(accepted: Sequence[int], cycles: Sequence[tuple[int, bool]]) -> dict[str, tuple[int, int]]:
    """(tokens, cycles) of one answer's verify cycles outside its tail loop and inside it (``cycles``: its
    ``cycles_in_loop``)."""
    out = {part: [0, 0] for part in PARTS}
    for a, (_, inside) in zip(accepted, cycles, strict=True):
        part = out["in_loops" if inside else "outside_loops"]
        part[0] += a + 1
        part[1] += 1
    return {part: (t, c) for part, (t, c) in out.items()}


def per_prompt_split(splits: Sequence[dict[str, tuple[int, int]]]) -> dict[str, PerPrompt]:
    """Per part, the per-prompt columns (tokens, cycles) that ``eval.intervals`` resamples, from each answer's
    ``split_cycles``."""
    return {part: {"tokens": [s[part][0] for s in splits], "cycles": [s[part][1] for s in splits]} for part in PARTS}


def refused_in_loops(tokens: Sequence[int], accepted: Sequence[int], first_drafts: Sequence[int],
                     cycles: Sequence[tuple[int, bool]]) -> Counter[tuple[int, int]]:
    """(first draft, the target's token) of each cycle inside the tail loop that kept no draft (``cycles``: the
    answer's ``cycles_in_loop``)."""
    return Counter((first, tokens[pos]) for a, first, (pos, inside) in zip(accepted, first_drafts, cycles, strict=True)
                   if inside and a == 0)


def refused_figures(refused: Counter[tuple[int, int]], tokenizer: Any, top: int = 5) -> dict:
    """How many in-loop cycles kept no draft, and their commonest (first draft, target token) pairs, as text."""
    return {"cycles": sum(refused.values()),
            "commonest": [{"draft": tokenizer.decode([d]), "target": tokenizer.decode([t]), "cycles": n}
                          for (d, t), n in refused.most_common(top)]}


def part_figures(cols: PerPrompt, boot: Bootstrap) -> dict:
    """tau of one part with its interval, and the cycles and prompts behind it."""
    iv = ratio_estimate(cols["tokens"], cols["cycles"], boot).interval(boot.level)
    return {"tau": iv.point, "ci": [iv.low, iv.high], "cycles": sum(cols["cycles"]),
            "prompts": sum(c > 0 for c in cols["cycles"])}


def dataset_figures(split: dict[str, PerPrompt], boot: Bootstrap) -> dict:
    """tau over every cycle, both parts' figures and the share of the cycles spent inside loops."""
    tokens, cycles = ({part: sum(split[part][col]) for part in PARTS} for col in ("tokens", "cycles"))
    total = sum(cycles.values())
    return {"tau": sum(tokens.values()) / total if total else float("nan"),
            **{part: part_figures(split[part], boot) for part in PARTS},
            "loop_cycle_share": cycles["in_loops"] / total if total else 0.0}


def paired(a: dict[str, PerPrompt], b: dict[str, PerPrompt], boot: Bootstrap) -> dict:
    """a minus b in each part, on the prompts where both ran a cycle in it."""
    out = {}
    for part in PARTS:
        iv = paired_difference((a[part]["tokens"], a[part]["cycles"]), (b[part]["tokens"], b[part]["cycles"]),
                               boot).interval(boot.level)
        out[part] = iv.to_dict()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = drafters_parser(__doc__, "loop_split")
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts of each set only (smoke runs)")
    args = ap.parse_args(argv)
    cfg = quality_config(args.config, overrides=args.set)
    target, prompts = target_and_prompts(cfg, args.limit)
    boot, regen = bootstrap(cfg.gate), cfg.regenerate
    stops = stop_token_ids(target.tokenizer)
    splits: dict[str, dict[str, dict[str, PerPrompt]]] = {}
    refused: dict[str, dict[str, dict]] = {}
    for ckpt in args.checkpoint:
        drafter, aux_ids = load_drafter(target, cfg, ckpt)
        engine = BatchedTarget(target.model, aux_ids)
        splits[ckpt], refused[ckpt] = {}, {}
        for name, ps in prompts.items():
            with torch.no_grad():
                rows = speculative_batch(engine, drafter, ps, 3, cfg.eval.max_new_tokens, stops,
                                         desc=f"{ckpt} {name}")
            marks = [cycles_in_loop(r.tokens, r.accepted, regen.loop_min_repeat_tokens, regen.loop_max_period)
                     for r in rows]  # each answer's loop found once, for both readings
            splits[ckpt][name] = per_prompt_split([split_cycles(r.accepted, m)
                                                   for r, m in zip(rows, marks, strict=True)])
            counts = sum((refused_in_loops(r.tokens, r.accepted, r.first_drafts, m)
                          for r, m in zip(rows, marks, strict=True)), Counter())
            refused[ckpt][name] = refused_figures(counts, target.tokenizer)
    first = args.checkpoint[0]
    record(args.name, {"checkpoints": args.checkpoint, "limit": args.limit, "k": 3, "temperature": 0.0,
                       "confidence": boot.level,
                       "loop": {"min_repeat_tokens": regen.loop_min_repeat_tokens,
                                "max_period": regen.loop_max_period},
                       "drafters": {c: {name: {**dataset_figures(split, boot), "refused_in_loops": refused[c][name]}
                                        for name, split in by_set.items()} for c, by_set in splits.items()},
                       "minus_first": {c: {name: paired(splits[c][name], splits[first][name], boot)
                                           for name in splits[c]} for c in args.checkpoint[1:]}})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How much of the target's greedy output on the eval sets lies outside each drafter's draft vocabulary.

    python bench/draft_vocab_coverage.py --config configs/smollm2-135m-h200.yaml --set target.device=cpu \
        --checkpoint drafters/smollm2-135m-eagle3

Every prompt of the config's eval sets, the target's greedy answers (``eval.max_new_tokens``, fp32 target; read from
the references an earlier eval kept, else decoded), and per drafter and set the tokens its ``t2d`` does not hold: at
T = 0 each ends a verify cycle whatever the weights (``drafter.vocab_map``), so their share is the part of the gap to
a perfect drafter that fine-tuning cannot close while a warm start keeps the map. ``eval quality`` reports the same
beside tau; this reads it for several drafters without drafting. Recorded as "draft_vocab_coverage".
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.drafters_parser import drafters_parser
from bench.results import record
from drafter.vocab_map import outside_draft_vocab
from eval.batched_eval import GreedyReferences
from eval.quality import quality_config, target_and_prompts
from eval.vocab_coverage import draft_vocab_of


def main(argv: Sequence[str] | None = None) -> int:
    ap = drafters_parser(__doc__, "draft_vocab_coverage")
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts of each set only (smoke runs)")
    args = ap.parse_args(argv)
    cfg = quality_config(args.config, overrides=args.set)
    target, prompts = target_and_prompts(cfg, args.limit)
    refs = GreedyReferences(target, prompts, cfg.eval.max_new_tokens)
    outputs = {name: [g.tokens for g in refs[name]] for name in prompts}
    figures = {}
    for ckpt in args.checkpoint:
        vocab = draft_vocab_of(ckpt, target.vocab_size)  # the map alone: no drafter built
        figures[ckpt] = {"draft_vocab_size": int(vocab.sum()),
                         **{name: outside_draft_vocab(outs, vocab, target.tokenizer) for name, outs in outputs.items()}}
    record(args.name, {"checkpoints": args.checkpoint, "limit": args.limit, "max_new_tokens": cfg.eval.max_new_tokens,
                       "target_vocab_size": target.vocab_size, "drafters": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())

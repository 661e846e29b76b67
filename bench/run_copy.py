"""Whether a drafter copies a run of one token: the target continues a run of each symbol token (every token of the
target's vocabulary that is one to three punctuation characters, with or without a leading space), and each drafter
drafts it, k = 3, T = 0, fp32 target.

    python bench/run_copy.py --config configs/smollm2-135m-h200.yaml --set target.device=cpu \
        --checkpoint drafters/smollm2-135m-eagle3 runs/smollm2-h200-stage15

A greedy target that falls into a loop often repeats one token (a row of ``=`` or ``<<``), and a drafter that copies
the run keeps every draft there, while one that drafts something else keeps none. The eval sets hold few such runs
(one HumanEval prompt ends in a long run of ``<<``), so whether a drafter copies them is a matter of single tokens
that the eval's tau cannot separate from noise; this measures it over every symbol token at once. Each prompt is a
user turn asking to continue and an assistant turn that starts with ``--run-length`` copies of the token; a row counts
when the target's own answer keeps the run for at least 90 % of its tokens (at T = 0 every drafter sees the same
answers). Per drafter: tau over those rows with its interval, the share of the cycles inside the run whose first draft
is the run's token, and the tokens whose run it mostly fails to copy; the same figures again over the rows whose token
is in its draft vocabulary (``t2d``), with how many are not (a token outside it can never be drafted, and a warm start
keeps the map, so no training fixes those); for each drafter after the first, its paired tau difference from the
first. Recorded as "run_copy".
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from bench.drafters_parser import drafters_parser
from bench.results import record
from data_prep.symbol_runs import continued, symbol_tokens
from drafter.vocab_map import draft_vocab_mask
from engine.batched import BatchedTarget
from eval.batched_speculative import RowResult, cycle_starts, speculative_batch
from eval.gate_stats import bootstrap
from eval.intervals import Bootstrap, paired_difference, ratio_estimate
from eval.quality import load_drafter, quality_config
from target_model.hf_model import load_target_from_config, stop_token_ids

MIN_RUN_CYCLES = 4  # a token's copying is judged only over at least this many cycles inside its run


def run_prompts(tokenizer: Any, token_ids: Sequence[int], run_length: int) -> list[list[int]]:
    """A user turn asking to continue, then an assistant turn that starts with ``run_length`` copies of each token."""
    head = tokenizer.apply_chat_template([{"role": "user", "content": "Continue the text."}],
                                         add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(head, add_special_tokens=False)
    return [ids + [t] * run_length for t in token_ids]


def copy_counts(row: RowResult, run_token: int) -> tuple[int, int]:
    """(cycles whose first produced token is the run's, those whose first draft was it too)."""
    firsts = [first for pos, first in zip(cycle_starts(row.accepted), row.first_drafts, strict=True)
              if row.tokens[pos] == run_token]
    return len(firsts), sum(first == run_token for first in firsts)


def tau_columns(rows: Sequence[RowResult]) -> tuple[list[int], list[int]]:
    """The per-row (tokens, cycles) columns ``eval.intervals`` resamples."""
    return [len(r.tokens) for r in rows], [len(r.accepted) for r in rows]


def copy_figures(rows: Sequence[RowResult], run_tokens: Sequence[int], tokenizer: Any, boot: Bootstrap) -> dict:
    """tau over the rows with its interval, the first-draft copy rate inside the runs, and the failing tokens."""
    iv = ratio_estimate(*tau_columns(rows), boot).interval(boot.level)
    counts = [copy_counts(r, t) for r, t in zip(rows, run_tokens, strict=True)]
    cycles, hits = sum(c for c, _ in counts), sum(h for _, h in counts)
    failing = [tokenizer.decode([t]) for (c, h), t in zip(counts, run_tokens, strict=True)
               if c >= MIN_RUN_CYCLES and h < c / 2]
    return {"tau": iv.point, "ci": [iv.low, iv.high], "run_cycles": cycles,
            "first_draft_copies": hits / cycles if cycles else float("nan"),
            "tokens_judged": sum(c >= MIN_RUN_CYCLES for c, _ in counts),
            "tokens_failing": len(failing), "failing": failing}


def drafter_figures(rows: Sequence[RowResult], run_tokens: Sequence[int], tokenizer: Any, boot: Bootstrap,
                    draft_vocab: torch.Tensor) -> dict:
    """``copy_figures`` over every row, and again over the rows whose run token is in ``draft_vocab`` (the drafter's
    ``draft_vocab_mask``) with the count of those that are not: failing a token it cannot propose says nothing of
    its weights, so only the in-vocab figures show what training could change."""
    inside = draft_vocab[torch.as_tensor(list(run_tokens), dtype=torch.long)].tolist()
    proposable = [(r, t) for r, t, ok in zip(rows, run_tokens, inside, strict=True) if ok]
    in_vocab = copy_figures([r for r, _ in proposable], [t for _, t in proposable], tokenizer, boot)
    return copy_figures(rows, run_tokens, tokenizer, boot) | {
        "in_draft_vocab": {"rows": len(proposable)} | in_vocab,
        "tokens_outside_draft_vocab": len(rows) - len(proposable)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = drafters_parser(__doc__, "run_copy")
    ap.add_argument("--run-length", type=int, default=16, help="copies of the token the assistant turn starts with")
    ap.add_argument("--max-new", type=int, default=48, help="answer tokens per prompt")
    ap.add_argument("--limit", type=int, default=None, help="the first N symbol tokens only (smoke runs)")
    args = ap.parse_args(argv)
    cfg = quality_config(args.config, overrides=args.set)
    target = load_target_from_config(cfg.target)
    tok, boot = target.tokenizer, bootstrap(cfg.gate)
    symbols = symbol_tokens(tok)[: args.limit]
    prompts = run_prompts(tok, symbols, args.run_length)
    stops = stop_token_ids(tok)
    rows: dict[str, list[RowResult]] = {}
    vocab: dict[str, torch.Tensor] = {}
    for ckpt in args.checkpoint:
        drafter, aux_ids = load_drafter(target, cfg, ckpt)
        vocab[ckpt] = draft_vocab_mask(drafter)
        with torch.no_grad():
            rows[ckpt] = speculative_batch(BatchedTarget(target.model, aux_ids), drafter, prompts, 3, args.max_new,
                                           stops, desc=ckpt)
    first = args.checkpoint[0]
    kept = [i for i, (r, t) in enumerate(zip(rows[first], symbols, strict=True)) if continued(r.tokens, t)]
    runs = [symbols[i] for i in kept]
    rows = {c: [rs[i] for i in kept] for c, rs in rows.items()}
    figures = {c: drafter_figures(rs, runs, tok, boot, vocab[c]) for c, rs in rows.items()}
    base = tau_columns(rows[first])
    minus_first = {c: paired_difference(tau_columns(rows[c]), base, boot).interval(boot.level).to_dict()
                   for c in args.checkpoint[1:]}
    record(args.name, {"checkpoints": args.checkpoint, "k": 3, "temperature": 0.0, "confidence": boot.level,
                       "run_length": args.run_length, "max_new_tokens": args.max_new, "limit": args.limit,
                       "symbol_tokens": len(symbols), "runs_continued": len(kept), "drafters": figures,
                       "minus_first": minus_first})
    return 0


if __name__ == "__main__":
    sys.exit(main())

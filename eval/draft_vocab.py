"""How much of the target's own output a drafter can never draft: the tokens outside its draft vocabulary.

A drafter proposes only the target ids its ``t2d`` marks (the ``draft_vocab_size`` ids its lm_head covers), so a
target token outside them is never an accepted draft: at T = 0 each one ends a verify cycle whatever the weights.
Their share of the target's greedy output is the part of the gap to a perfect drafter that training cannot close
(a warm start keeps the drafter's map); a drafter trained for another target (the K2 drafter on K2.5 traffic) shows
here how much of the new target's output its vocabulary misses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from drafter.model import Eagle3Drafter


def draft_vocab_mask(drafter: Eagle3Drafter) -> torch.Tensor:
    """The drafter's ``t2d`` on the CPU, (target vocab,) bool: the target ids its lm_head can propose."""
    return drafter.t2d.detach().bool().cpu()


def outside_draft_vocab(outputs: Sequence[Sequence[int]], draft_vocab: torch.Tensor, tokenizer: Any,
                        top: int = 10) -> dict:
    """Over the target's outputs (one token list per prompt): how many tokens lie outside ``draft_vocab``, their
    share, the prompts with at least one, and the ``top`` commonest as text with their counts."""
    inside = draft_vocab.tolist()
    missed = [[t for t in out if not inside[t]] for out in outputs]
    total, outside = sum(len(out) for out in outputs), sum(len(m) for m in missed)
    common = Counter(t for m in missed for t in m).most_common(top)
    return {"tokens": total, "outside": outside, "share": outside / total if total else 0.0,
            "prompts_with_any": sum(bool(m) for m in missed),
            "commonest": [{"token": tokenizer.decode([t]), "count": n} for t, n in common]}

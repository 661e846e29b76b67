"""The draft vocabulary: which target tokens the drafter's lm_head can emit.

``d2t[i]`` is an offset (``target_id = i + d2t[i]``, as SGLang reads it); ``t2d`` marks the target ids
inside the draft vocab. A warm start keeps the drafter's own map: its lm_head rows are tied to it. A target token
outside the map is never an accepted draft, so at T = 0 each one the target writes ends a verify cycle whatever the
weights (``outside_draft_vocab``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def build_vocab_map(counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """The ``draft_vocab_size`` most frequent target ids (ties broken by lower id; padded with the
    lowest unused ids when fewer distinct tokens were seen), in ascending id order.

    counts: (vocab_size,) token counts over loss-masked positions. Returns (d2t int64, t2d bool).
    """
    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} exceeds the target vocab {vocab_size}")
    ids = torch.arange(vocab_size)
    # Stable sort by count descending keeps ascending id order among equal counts.
    order = torch.sort(counts.long(), descending=True, stable=True).indices
    chosen = order[:draft_vocab_size]
    chosen = chosen[counts[chosen] > 0]
    if chosen.numel() < draft_vocab_size:
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, ids[unused][: draft_vocab_size - chosen.numel()]])
    chosen = torch.sort(chosen).values
    d2t = chosen - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.long(), t2d


def draft_to_target_ids(d2t: Tensor) -> Tensor:
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def vocab_map_problems(d2t: Tensor, t2d: Tensor) -> list[str]:
    """Reasons the map is inconsistent (empty when fine)."""
    problems = []
    target_ids = draft_to_target_ids(d2t.long())
    vocab = t2d.numel()
    bad = (target_ids < 0) | (target_ids >= vocab)
    if bad.any():
        i = int(bad.nonzero()[0])
        problems.append(f"d2t[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(target_ids[i])}, "
                        f"outside the target vocab [0, {vocab}) ({int(bad.sum())} such entries)")
        return problems
    if target_ids.unique().numel() != target_ids.numel():
        problems.append("d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != d2t.numel():
        problems.append(f"t2d marks {int(t2d.sum())} target ids, d2t has {d2t.numel()} draft ids")
    elif not bool(t2d.bool()[target_ids].all()):
        problems.append("t2d does not mark every target id that d2t maps to")
    return problems


def draft_vocab_mask(drafter: torch.nn.Module) -> Tensor:
    """A drafter's ``t2d`` on the CPU, (target vocab,) bool: the target ids its lm_head can propose."""
    return drafter.t2d.detach().bool().cpu()


def outside_draft_vocab(outputs: Sequence[Sequence[int]], draft_vocab: Tensor, tokenizer: Any, top: int = 10) -> dict:
    """Over the target's outputs (one token list each): how many tokens lie outside ``draft_vocab``, their share, the
    outputs with at least one, and the ``top`` commonest as text with their counts. Their share is the part of the
    gap to a perfect drafter that training cannot close while the map is kept."""
    inside = draft_vocab.tolist()
    missed = [[t for t in out if not inside[t]] for out in outputs]
    total, outside = sum(len(out) for out in outputs), sum(len(m) for m in missed)
    common = Counter(t for m in missed for t in m).most_common(top)
    return {"tokens": total, "outside": outside, "share": outside / total if total else 0.0,
            "prompts_with_any": sum(bool(m) for m in missed),
            "commonest": [{"token": tokenizer.decode([t]), "count": n} for t, n in common]}

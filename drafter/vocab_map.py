"""The draft vocabulary: which target tokens the drafter's lm_head can emit.

``d2t[i]`` is an offset (``target_id = i + d2t[i]``, as SGLang reads it); ``t2d`` marks the target ids
inside the draft vocab. A warm start keeps the drafter's own map: its lm_head rows are tied to it.
"""

from __future__ import annotations

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

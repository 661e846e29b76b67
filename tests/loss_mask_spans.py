"""The text of each run of loss-masked tokens: what the loss-mask tests compare against."""

from __future__ import annotations

from typing import Any


def masked_spans(tok: Any, rendered: Any) -> list[str]:
    """Each maximal run of tokens with loss, decoded (``rendered``: anything with input_ids and loss_mask)."""
    spans, cur = [], []
    for t, m in zip(rendered.input_ids, rendered.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans

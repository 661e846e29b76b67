"""When each conversation of a stream was open, so the end of a run can be read.

A conversation's turns run one after another: its span (opened to written) is at least its answer tokens times
a decode step. When the conversation written last was opened early and its span is most of the run, the run
waited on that chain, and more devices (each with a share of the conversations) cannot shorten it; when it was
opened late, the run waited on opening, which a share halves."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from common.percentiles import percentiles


@dataclass(frozen=True)
class Span:
    opened_s: float  # since the stream started
    span_s: float  # opened to written
    turns: int
    answer_tokens: int

    @property
    def settled_s(self) -> float:
        return self.opened_s + self.span_s


class ConversationSpans:
    """Open and settle times of a stream's conversations, keyed as the stream keys them."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.opened: dict[str, float] = {}
        self.spans: list[Span] = []

    def open(self, key: str) -> None:
        self.opened[key] = time.perf_counter()

    def settle(self, key: str, turns: int, answer_tokens: int) -> None:
        """The conversation ``key`` is written (or failed): its span ends now."""
        opened = self.opened.pop(key)
        self.spans.append(Span(round(opened - self.start, 3), round(time.perf_counter() - opened, 3), turns,
                               answer_tokens))

    def summary(self) -> dict[str, Any]:
        """Spans' percentiles, the longest one and the one written last (each with when it was opened, its turns
        and answer tokens), and when the last conversation was opened; empty when none settled."""
        if not self.spans:
            return {}
        return {"conversations": len(self.spans),
                "span_s": percentiles([s.span_s for s in self.spans]),
                "longest": asdict(max(self.spans, key=lambda s: s.span_s)),
                "settled_last": asdict(max(self.spans, key=lambda s: s.settled_s)),
                "opened_last_s": max(s.opened_s for s in self.spans)}

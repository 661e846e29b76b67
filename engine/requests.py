"""A stream's requests and answers: a prompt and its budget in, a continuation in the row of the answer it follows,
and the answer out."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class Generated:
    tokens: list[int]  # the answer, without its stop token (a "loop" answer: cut after the loop's first copy + keep)
    finish_reason: str  # "stop" | "length" | "loop"
    stop_token: int | None = None  # the stop token that ended it
    # with ``margins=True``: the top-1 minus top-2 logit behind each token, the stop token's last (the T=0
    # lossless check tells a near-tie from a real mismatch by it: eval.lossless); a "loop" answer's are cut too
    margins: list[float] = field(default_factory=list)
    generated: int = 0  # "loop": the tokens it had when the loop was found (len(tokens) kept of them)


@dataclass
class Request:
    key: Hashable
    prompt: Sequence[int]
    max_new_tokens: int


@dataclass
class Continuation:
    """A request that continues in the row of the answer it follows: ``reuse`` positions of the row's cache
    are its prompt's first tokens. ``Request`` stays as it was, so a preempted continuation starts again
    from scratch like any request."""

    row: int
    request: Request
    reuse: int
    polls: int = 0  # polls it has waited for its prefill

"""The T = 0 lossless check, for any engine: speculative output must equal plain greedy decoding, except where
the target itself is at a near-tie.

Why the exception: verify scores k+1 tokens in one pass and decode scores one; in bf16 the two sums round
differently, so when the target's top-1 and top-2 logits are within rounding of each other either engine
may pick either token, with no drafter bug involved. A divergence where the plain run's top-1/top-2 margin
is below ``eval.tie_epsilon`` is reported as a near-tie, apart from real mismatches; the rest of that prompt
cannot be compared (the texts differ from there on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Divergence:
    position: int  # index of the first differing generated token
    margin: float | None  # plain run's top-1 minus top-2 logit there (None: one output is a prefix of the other)
    near_tie: bool
    greedy: list[int]  # a few tokens from the divergence on, each side
    speculative: list[int]

    def to_dict(self) -> dict:
        return asdict(self)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or the shorter length when one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check(greedy: Sequence[int], margins: Sequence[float], speculative: Sequence[int],
          epsilon: float) -> Divergence | None:
    """None when the outputs are equal; else where they part and whether that is a near-tie.
    ``margins[i]``: the plain run's top-1/top-2 logit margin for its token i."""
    pos = first_divergence(greedy, speculative)
    if pos is None:
        return None
    margin = margins[pos] if pos < min(len(greedy), len(speculative)) and pos < len(margins) else None
    return Divergence(pos, margin, margin is not None and margin < epsilon, list(greedy[pos:pos + 4]),
                      list(speculative[pos:pos + 4]))

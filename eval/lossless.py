"""The T = 0 lossless check, for any engine: speculative output must equal plain greedy decoding, except where
the target itself is at a near-tie.

Why the exception: verify scores k+1 tokens in one pass and decode scores one; the two sums round differently,
so when the target's top-1 and top-2 logits are within rounding of each other either engine may pick either
token, with no drafter bug involved. A divergence where the plain run's top-1/top-2 margin is below
``eval.tie_epsilon`` is reported as a near-tie, apart from real mismatches; the rest of that prompt cannot be
compared (the texts differ from there on).

Only a float32 (or float64) target is checked. In bf16 that rounding moves a logit by a rounding step of its
size (eps 2^-7: 1/128 of a logit of 1, 0.125 at 16), so a correct engine parts from plain decoding at margins of
that size, far above ``eval.tie_epsilon``: measured on CPU (random drafter, 48 new tokens), 9 of 10 MT-Bench
prompts on SmolLM2 in bf16 parted, 4 of them at margins 0.03-0.125, the others at exact ties
(``tests/test_eval_lossless.py`` shows the same on a tiny model, which float32 keeps lossless). No margin
tolerance separates that from a bug: a bug's first divergence is where its error first beats the margin, which
can be as small as rounding, so a tolerance scaled to bf16 (eps x65536 fp32's) would hide bugs as well. The
engines are the same code at every dtype and are checked exactly in float32 (the tests, ``bench/drafter_quality.py``,
eval with ``--set target.dtype=float32``), so a reduced-precision report says the check was not run, and why,
rather than fail a correct drafter (``unchecked_reason``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

EXACT_DTYPES = (torch.float32, torch.float64)


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


def unchecked_reason(temperature: float, dtype: torch.dtype) -> str | None:
    """Why a run's outputs cannot be checked against plain greedy decoding; None when they can."""
    if temperature > 0:
        return "T>0: outputs are samples, not comparable"
    if dtype not in EXACT_DTYPES:
        name = str(dtype).removeprefix("torch.")
        return (f"target dtype {name}: verify and decode round differently at eps {torch.finfo(dtype).eps:.1e}, "
                f"far above eval.tie_epsilon, so a divergence would not mean a bug; check it in float32 "
                "(--set target.dtype=float32)")
    return None

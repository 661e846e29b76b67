"""How a stream picks each answer token: greedy, or sampled with one random number per token drawn from the request's
own seed and the token's position, so a sampled answer is the same in any batch, row or run (``Picker``)."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0


def request_seed(seed: int, key: Hashable) -> int:
    """A request's own sampling seed: ``seed`` and the request's key (its repr) through sha256, so a conversation's
    turn draws the same random numbers whichever batch, row or run serves it (Python's ``hash`` of a str changes
    from process to process)."""
    digest = hashlib.sha256(f"{seed}:{key!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic on signed values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def counter_uniform(seeds: Tensor, counters: Tensor) -> Tensor:
    """(B,) float64 in [0, 1): splitmix64 of each row's (seed, counter) on the device (int64 arithmetic wraps), a
    counter-based generator: the number drawn for a token depends on its request and position alone."""
    z = seeds + (counters + 1) * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).double() * 2.0 ** -53


class Picker:
    """Greedy argmax, or temperature / top-k / top-p sampling with one uniform number per row from
    ``counter_uniform``: each request's seed (``request_seed``) and the position of the token drawn, so a sampled
    answer is the same in any batch and after any resume (up to the logits' own last bits, which a batch's shape
    can move)."""

    def __init__(self, s: Sampling):
        self.s = s

    @property
    def greedy(self) -> bool:
        return self.s.temperature <= 0

    def __call__(self, logits: Tensor, seeds: Tensor | None = None, counters: Tensor | None = None) -> Tensor:
        if self.greedy:
            return logits.argmax(-1)
        z = logits.float() / self.s.temperature
        if self.s.top_k:
            kth = torch.topk(z, min(self.s.top_k, z.shape[-1]), dim=-1).values[..., -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.s.top_p < 1.0:
            sorted_z, order = z.sort(-1, descending=True)
            cum = sorted_z.softmax(-1).cumsum(-1)
            drop = cum - sorted_z.softmax(-1) >= self.s.top_p  # keep the smallest prefix reaching top_p
            z = z.scatter(-1, order, sorted_z.masked_fill(drop, float("-inf")))
        cdf = z.softmax(-1).double().cumsum(-1)
        u = counter_uniform(seeds, counters)[:, None] * cdf[:, -1:]  # the cdf's own total: sums in fp64 drift
        return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=z.shape[-1] - 1)

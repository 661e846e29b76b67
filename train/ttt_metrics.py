"""Training metrics: per-step accuracy and loss sums, and the simulated accept length.

Simulated accept length (τ_sim) of a chain draft of n = ttt_length tokens, from the unrolled steps:
row t of step i holds the i-th draft token of the chain that starts after position t (step i reads
the true tokens, i.e. the state after i accepted drafts). With c_i = 1 when step i's draft equals the
target's argmax and s_i = 1 when step i is scored (its predicted token is supervised),

    a_i = #rows(s_i and c_0..c_i) / #rows(s_i and c_0..c_{i-1})    (conditional acceptance of step i)
    τ_sim = 1 + a_0 + a_0·a_1 + … + a_0·…·a_{n-1}

i.e. the expected tokens per verify cycle of greedy chain drafting (the bonus token counts 1).
Targets outside the draft vocab are scored as misses: serving misses them too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Counts:
    """Sums that add across micro-batches and processes (one tensor, so one all-reduce)."""

    data: Tensor  # (4, n): loss sum (mean CE per batch), batches, hits, scored; plus chain rows below
    chain: Tensor  # (2, n): rows with s_i and all of c_0..c_i / rows with s_i and c_0..c_{i-1}

    @staticmethod
    def zeros(n: int, device: torch.device | str = "cpu") -> Counts:
        return Counts(torch.zeros(4, n, dtype=torch.float64, device=device),
                      torch.zeros(2, n, dtype=torch.float64, device=device))

    def add(self, step_losses: Tensor, correct: Tensor, scored: Tensor) -> None:
        n = step_losses.shape[0]
        self.data[0, :n] += step_losses.double()
        self.data[1, :n] += 1
        self.data[2, :n] += (correct & scored).flatten(1).sum(1).double()
        self.data[3, :n] += scored.flatten(1).sum(1).double()
        prefix = torch.cumprod(correct.long(), dim=0).bool()  # c_0..c_i all true
        before = torch.cat([torch.ones_like(prefix[:1]), prefix[:-1]])
        self.chain[0, :n] += (prefix & scored).flatten(1).sum(1).double()
        self.chain[1, :n] += (before & scored).flatten(1).sum(1).double()

    def flat(self) -> Tensor:
        return torch.cat([self.data.flatten(), self.chain.flatten()])

    @staticmethod
    def from_flat(flat: Tensor, n: int) -> Counts:
        return Counts(flat[: 4 * n].view(4, n).clone(), flat[4 * n:].view(2, n).clone())

    def summary(self, prefix: str) -> dict[str, float]:
        n = self.data.shape[1]
        out: dict[str, float] = {}
        for i in range(n):
            out[f"{prefix}loss_{i}"] = float(self.data[0, i] / self.data[1, i].clamp(min=1))
            out[f"{prefix}acc_{i}"] = float(self.data[2, i] / self.data[3, i].clamp(min=1))
        out[f"{prefix}accept_length"] = accept_length(self.chain)
        return out


def conditional_acceptance(chain: Tensor) -> Tensor:
    """a_i from the chain sums (0 where no row reached step i)."""
    return torch.where(chain[1] > 0, chain[0] / chain[1].clamp(min=1), torch.zeros_like(chain[0]))


def accept_length(chain: Tensor) -> float:
    """τ_sim = 1 + Σ_k Π_{i≤k} a_i (module docstring)."""
    return float(1 + torch.cumprod(conditional_acceptance(chain), 0).sum())

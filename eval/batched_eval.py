"""Acceptance of a drafter on whole eval sets in a few batched passes: tau, alpha_k and the lossless check.

The batch-1 engine (``eval.measure``) gives timings; this gives the acceptance statistics of every prompt
at once (``eval.batched_speculative``), against greedy references from the same target
(``engine.continuous_batching``, with the top-1/top-2 margin behind each token), reduced by the same
functions as the batch-1 report: a divergence at a near-tie (``eval.lossless``) is reported apart, not as a
mismatch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from drafter.model import Eagle3Drafter
from engine.batched import BatchedTarget
from engine.continuous_batching import generate
from eval.acceptance_store import kept_entry, target_key, target_outputs_dir
from eval.batched_speculative import speculative_batch
from eval.lossless import unchecked_reason
from eval.measure import dataset_stats, divergences
from eval.speculative import Generation
from target_model.hf_model import TargetModel, stop_token_ids

REFERENCES_VERSION = 1  # in the key of kept greedy references: changes when the way they are generated does


def greedy_references(target: TargetModel, prompts: Mapping[str, Sequence[Sequence[int]]],
                      max_new: int) -> dict[str, list[Generation]]:
    """The target's own greedy answers (what T=0 speculative output must equal) and their margins."""
    engine, stops = BatchedTarget(target.model), stop_token_ids(target.tokenizer)
    out = {}
    for name, ps in prompts.items():
        gens = generate(engine, ps, max_new, stops, desc=f"greedy {name}", margins=True)
        # the speculative engines emit the stop token as part of the sequence they are compared on
        out[name] = [Generation(g.tokens + ([] if g.stop_token is None else [g.stop_token]), g.margins)
                     for g in gens]
    return out


class GreedyReferences(Mapping[str, list[Generation]]):
    """``greedy_references`` per dataset, on first use: read where an earlier eval of the same target, prompts and
    budget kept them (``cache_dir``, default ``eval.acceptance_store.target_outputs_dir()``), else generated and
    kept. They are the target's alone, so every candidate gated against that target after the first,
    and a resumed eval, reads them instead of paying a plain greedy decode of every prompt again."""

    def __init__(self, target: TargetModel, prompts: Mapping[str, Sequence[Sequence[int]]], max_new: int,
                 cache_dir: Path | None = None) -> None:
        self.target, self.prompts, self.max_new = target, prompts, max_new
        self.cache_dir = cache_dir or target_outputs_dir()
        self.done: dict[str, list[Generation]] = {}
        self._key: dict | None = None

    def __getitem__(self, name: str) -> list[Generation]:
        if name not in self.done:
            self.done[name] = self._kept(name)
        return self.done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def _kept(self, name: str) -> list[Generation]:
        if self._key is None:  # the target's part, hashed once
            self._key = {"version": REFERENCES_VERSION, "what": "greedy references", "max_new": self.max_new,
                         **target_key(self.target)}
        prompts = [list(p) for p in self.prompts[name]]
        rows, read = kept_entry(
            self.cache_dir, {**self._key, "prompts": prompts},
            lambda: [{"tokens": g.tokens, "margins": g.margins}
                     for g in greedy_references(self.target, {name: self.prompts[name]}, self.max_new)[name]],
            lambda v: isinstance(v, list) and len(v) == len(prompts) and all("tokens" in r for r in v),
            f"greedy references of {len(prompts)} prompts")
        if read:
            print(f"greedy references: {name} read from {self.cache_dir}", flush=True)
        return [Generation(r["tokens"], r["margins"]) for r in rows]


def acceptance(target: TargetModel, drafter: Eagle3Drafter | None, aux_ids: Sequence[int],
               prompts: Mapping[str, Sequence[Sequence[int]]], k: int, temperature: float, max_new: int,
               references: Mapping[str, Sequence[Generation]] | None = None, seed: int = 0,
               rule: str = "sglang", tie_epsilon: float = 1e-4) -> dict:
    """Per dataset: tau, histogram, alpha_k (conditional and not), tokens; at T=0 with references, the
    prompts whose speculative output differs from greedy (``lossless_mismatches``) and those that part at a
    top-1/top-2 margin below ``tie_epsilon`` (``lossless_near_ties``); a reduced-precision target is not checked
    (``lossless_unchecked`` says why: ``eval.lossless``). ``rule``: eval.acceptance at T > 0. ``drafter`` None: the
    oracle (``eval.batched_speculative.speculative_batch``)."""
    engine, stops = BatchedTarget(target.model, aux_ids), stop_token_ids(target.tokenizer)
    out: dict = {}
    for name, ps in prompts.items():
        rows = speculative_batch(engine, drafter, ps, k, max_new, stops, temperature, seed, desc=f"{name} k={k}",
                                 acceptance=rule)
        gens = [Generation(r.tokens, accepted=r.accepted) for r in rows]
        stats = dataset_stats(gens, k)
        unchecked = unchecked_reason(temperature, target.dtype)
        if unchecked is None and references is not None:
            found = divergences(references[name], gens, name, tie_epsilon)
            stats["lossless_mismatches"] = [m for m in found if not m["near_tie"]]
            stats["lossless_near_ties"] = [m for m in found if m["near_tie"]]
        elif temperature == 0 and references is not None:
            stats["lossless_unchecked"] = unchecked
        out[name] = stats
    return out

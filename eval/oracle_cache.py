"""The oracle's acceptance at T > 0, kept across evals (``eval.acceptance_store``). It depends on the target, the
prompts and the setting, never on the drafter, so every candidate measured after the first reads it instead of
paying for it again: the oracle runs k target steps ahead per cycle, and on a CPU its pass costs several times the
drafter's own.

An entry is keyed by the target's fingerprint, dtype and device type, the stop ids, the dataset's prompt ids, k, T,
the new-token budget, the acceptance rule and the seed (each row samples from its own seeded generator, so the
figures repeat on the same kind of device). ``ORACLE_VERSION`` changes when the measurement does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.wheels import cache_root
from eval.acceptance_store import kept_acceptance, target_key
from eval.batched_eval import acceptance
from target_model.hf_model import TargetModel

ORACLE_VERSION = 1


def default_cache_dir() -> Path:
    return cache_root() / "oracle"


def oracle_acceptance(target: TargetModel, aux_ids: Sequence[int], prompts: Mapping[str, Sequence[Sequence[int]]],
                      k: int, temperature: float, max_new: int, rule: str = "sglang", seed: int = 0,
                      cache_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """``eval.batched_eval.acceptance`` of the oracle, per dataset: read where an earlier eval stored it, measured
    (and stored) otherwise."""
    key = {"version": ORACLE_VERSION, **target_key(target), "k": k, "temperature": temperature,
           "max_new": max_new, "rule": rule, "seed": seed}

    def measure(name: str, ps: Sequence[Sequence[int]]) -> dict[str, Any]:
        return acceptance(target, None, aux_ids, {name: ps}, k, temperature, max_new, seed=seed, rule=rule)[name]

    return kept_acceptance(cache_dir or default_cache_dir(), key, prompts, measure, f"oracle k={k} T={temperature:g}")

"""The oracle's acceptance at T > 0, kept on disk. It depends on the target, the prompts and the setting, never on
the drafter, so every candidate measured after the first reads it instead of paying for it again: the oracle runs
k target steps ahead per cycle, and on a CPU its pass costs several times the drafter's own.

An entry is keyed by the target's fingerprint, dtype and device type, the stop ids, the dataset's prompt ids, k, T,
the new-token budget, the acceptance rule and the seed (each row samples from its own seeded generator, so the
figures repeat on the same kind of device). ``ORACLE_VERSION`` changes when the measurement does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from common.files import write_json_atomic
from common.wheels import cache_root
from eval.batched_eval import acceptance
from target_model.hf_model import TargetModel, stop_token_ids

ORACLE_VERSION = 1


def default_cache_dir() -> Path:
    return cache_root() / "oracle"


def entry_key(fingerprint: str, target: TargetModel, prompts: Sequence[Sequence[int]], k: int, temperature: float,
              max_new: int, rule: str, seed: int) -> str:
    spec = {"version": ORACLE_VERSION, "target": fingerprint, "dtype": str(target.dtype),
            "device": target.device.type, "stops": sorted(stop_token_ids(target.tokenizer)),
            "prompts": [list(p) for p in prompts], "k": k, "temperature": temperature, "max_new": max_new,
            "rule": rule, "seed": seed}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def read_entry(path: Path) -> dict[str, Any] | None:
    """The stored figures, or None when there are none; a damaged entry is said and measured again."""
    if not path.is_file():
        return None
    try:
        stats = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"oracle cache: {path} unreadable ({e}); measuring it again", flush=True)
        return None
    if not isinstance(stats, dict) or "per_prompt" not in stats:
        print(f"oracle cache: {path} holds no per-prompt figures; measuring it again", flush=True)
        return None
    return stats


def oracle_acceptance(target: TargetModel, aux_ids: Sequence[int], prompts: Mapping[str, Sequence[Sequence[int]]],
                      k: int, temperature: float, max_new: int, rule: str = "sglang", seed: int = 0,
                      cache_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """``eval.batched_eval.acceptance`` of the oracle, per dataset: read where an earlier eval stored it, measured
    (and stored) otherwise."""
    cache_dir = cache_dir or default_cache_dir()
    fingerprint = target.fingerprint()
    paths = {name: cache_dir / f"{entry_key(fingerprint, target, ps, k, temperature, max_new, rule, seed)}.json"
             for name, ps in prompts.items()}
    found = {name: read_entry(path) for name, path in paths.items()}
    missing = {name: prompts[name] for name, stats in found.items() if stats is None}
    if missing:
        measured = acceptance(target, None, aux_ids, missing, k, temperature, max_new, seed=seed, rule=rule)
        for name, stats in measured.items():
            write_json_atomic(paths[name], stats)
            found[name] = stats
    reused = [name for name in prompts if name not in missing]
    if reused:
        print(f"oracle k={k} T={temperature:g}: {', '.join(reused)} read from {cache_dir}", flush=True)
    return {name: found[name] for name in prompts}

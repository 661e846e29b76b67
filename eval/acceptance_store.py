"""Per-dataset acceptance figures kept on disk under a key that names everything they depend on, so that nothing
measured is measured again: the oracle's across evals (``eval.oracle_cache``: they depend on the target, the
prompts and the setting, never on a drafter) and an ``eval quality`` run's own (in its report folder: a run cut by a
kill or a device deadline resumes there, measuring only the datasets and settings it had not finished).

An entry is one dataset's ``eval.batched_eval.acceptance`` figures (JSON), written atomically as soon as that
dataset is measured; its name is the sha256 of the key's JSON. A damaged entry is said and measured again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from common.files import sha256_file, write_json_atomic
from drafter.sglang_checkpoint import fingerprint
from target_model.hf_model import TargetModel, stop_token_ids

Prompts = Sequence[Sequence[int]]


def target_key(target: TargetModel, target_fingerprint: str) -> dict[str, Any]:
    """What the target contributes to a key: its weights, dtype, device type and stop ids."""
    return {"target": target_fingerprint, "dtype": str(target.dtype), "device": target.device.type,
            "stops": sorted(stop_token_ids(target.tokenizer))}


def drafter_key(checkpoint: str | Path) -> dict[str, str]:
    """What a drafter contributes to a key: its weights and its config (the aux layers and vocab it is read with)."""
    return {"weights": fingerprint(checkpoint), "config": sha256_file(Path(checkpoint) / "config.json")}


def entry_name(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest() + ".json"


def read_entry(path: Path) -> dict[str, Any] | None:
    """The stored figures, or None when there are none; a damaged entry is said and measured again."""
    if not path.is_file():
        return None
    try:
        stats = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"acceptance store: {path} unreadable ({e}); measuring it again", flush=True)
        return None
    if not isinstance(stats, dict) or "per_prompt" not in stats:
        print(f"acceptance store: {path} holds no per-prompt figures; measuring it again", flush=True)
        return None
    return stats


def kept_acceptance(folder: Path, key: Mapping[str, Any], prompts: Mapping[str, Prompts],
                    measure: Callable[[str, Prompts], dict[str, Any]], what: str) -> dict[str, dict[str, Any]]:
    """Each dataset's figures: read from ``folder`` where an earlier run kept them under ``key`` (with the dataset's
    prompt ids), else ``measure(name, prompts)``, kept at once. ``what`` names them in the note on what was read."""
    out: dict[str, dict[str, Any]] = {}
    reused = []
    for name, ps in prompts.items():
        path = folder / entry_name({**key, "prompts": [list(p) for p in ps]})
        stats = read_entry(path)
        if stats is None:
            stats = measure(name, ps)
            write_json_atomic(path, stats)
        else:
            reused.append(name)
        out[name] = stats
    if reused:
        print(f"{what}: {', '.join(reused)} read from {folder}", flush=True)
    return out

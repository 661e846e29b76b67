"""Figures and target outputs kept on disk under a key that names everything they depend on, so that nothing
measured is measured again: the oracle's acceptance across evals (``eval.oracle_cache``: it depends on the target,
the prompts and the setting, never on a drafter), the target's greedy references and later turns' histories across
evals (``target_outputs_dir``: the target's alone, the same for every candidate gated against it), and each drafter's
figures in ``eval quality`` (``eval.quality.figures_store``: one store for every report of a run, so a run cut by a
kill or a device deadline resumes, measuring only the datasets and settings it had not finished, and a later gate
reads its incumbent's figures instead of measuring them again).

An entry is one dataset's value (JSON), written atomically as soon as it is computed; its name is the sha256 of the
key's JSON. A damaged entry is said and computed again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from common.files import sha256_file, sha256_json, write_json_atomic
from common.wheels import cache_root
from drafter.sglang_checkpoint import fingerprint
from target_model.hf_model import TargetModel, stop_token_ids

Prompts = Sequence[Sequence[int]]


def target_key(target: TargetModel) -> dict[str, Any]:
    """What the target contributes to a key: its weights (``TargetModel.fingerprint``), dtype, device type and stop
    ids."""
    return {"target": target.fingerprint(), "dtype": str(target.dtype), "device": target.device.type,
            "stops": sorted(stop_token_ids(target.tokenizer))}


def drafter_key(checkpoint: str | Path) -> dict[str, str]:
    """What a drafter contributes to a key: its weights and its config (the aux layers and vocab it is read with)."""
    return {"weights": fingerprint(checkpoint), "config": sha256_file(Path(checkpoint) / "config.json")}


def entry_name(key: Mapping[str, Any]) -> str:
    return sha256_json(key) + ".json"


def target_outputs_dir() -> Path:
    """Where the target's own eval outputs are kept across evals (greedy references, later turns' histories)."""
    return cache_root() / "target-outputs"


def holds_figures(value: Any) -> bool:
    """Whether a stored value is one dataset's acceptance figures (what ``kept_acceptance`` keeps)."""
    return isinstance(value, dict) and "per_prompt" in value


def read_entry(path: Path, valid: Callable[[Any], bool], holds: str) -> Any:
    """The stored value, or None when there is none; a damaged entry, or one that is not ``valid`` (it should hold
    ``holds``), is said and computed again."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"acceptance store: {path} unreadable ({e}); computing it again", flush=True)
        return None
    if not valid(value):
        print(f"acceptance store: {path} holds no {holds}; computing it again", flush=True)
        return None
    return value


def kept_entry(folder: Path, key: Mapping[str, Any], compute: Callable[[], Any], valid: Callable[[Any], bool],
               holds: str) -> tuple[Any, bool]:
    """The value kept in ``folder`` under ``key``, else ``compute()``, kept at once; and whether it was read."""
    path = folder / entry_name(key)
    value = read_entry(path, valid, holds)
    if value is not None:
        return value, True
    value = compute()
    write_json_atomic(path, value)
    return value, False


def kept_acceptance(folder: Path, key: Mapping[str, Any], prompts: Mapping[str, Prompts],
                    measure: Callable[[str, Prompts], dict[str, Any]], what: str) -> dict[str, dict[str, Any]]:
    """Each dataset's figures: read from ``folder`` where an earlier run kept them under ``key`` (with the dataset's
    prompt ids), else ``measure(name, prompts)``, kept at once. ``what`` names them in the note on what was read."""
    out: dict[str, dict[str, Any]] = {}
    reused = []
    for name, ps in prompts.items():
        out[name], read = kept_entry(folder, {**key, "prompts": [list(p) for p in ps]}, partial(measure, name, ps),
                                     holds_figures, "per-prompt figures")
        if read:
            reused.append(name)
    if reused:
        print(f"{what}: {', '.join(reused)} read from {folder}", flush=True)
    return out

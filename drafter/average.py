"""Weight averaging of drafters of one lineage (``python -m drafter average``): a warm-started stage and the drafter
it started from, or two stages of one chain. Each stage trained at a fresh learning-rate peak moves the drafter
towards its own data; the average of two such points keeps much of each one's gain and often beats both on the
sets neither was steered to (``bench/results.json`` → ``soup_vs_shipped``: the average of the shipped third stage
and the fourth, gated against the third).

Drafters average only when their layout, vocabulary map and aux layers are the same (warm starts keep the map), so
that every averaged tensor means the same thing in each; the result is a checkpoint like any other, to be gated.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from drafter.model import Eagle3Drafter
from drafter.sglang_checkpoint import (
    CheckpointError,
    expected_tensors,
    load_checkpoint,
    read_config,
    save_checkpoint,
)


def mixing_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """The weights normalised to sum to 1 (equal when none are given)."""
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise CheckpointError(f"--weights: {len(weights)} given for {n} checkpoints; give one per checkpoint")
    if any(not w > 0 for w in weights):  # also refuses NaN
        raise CheckpointError(f"--weights {list(weights)}: every weight must be positive")
    total = sum(weights)
    return [w / total for w in weights]


def lineage_problem(first: Path, other: Path, a: Eagle3Drafter, b: Eagle3Drafter) -> str | None:
    """Why ``other`` cannot be averaged with ``first`` (None: it can)."""
    if a.shape != b.shape:
        return f"{other}: its shape {b.shape} differs from {first}'s {a.shape}"
    if not (torch.equal(a.d2t, b.d2t) and torch.equal(a.t2d, b.t2d)):
        return (f"{other}: its vocabulary map (d2t/t2d) differs from {first}'s; only drafters of one lineage "
                "(warm-started from one another) average")
    aux = [m.hf_config_extra.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") for m in (a, b)]
    if aux[0] != aux[1]:
        return f"{other}: its aux layers {aux[1]} differ from {first}'s {aux[0]}"
    return None


@torch.no_grad()
def average_checkpoints(dirs: Sequence[str | Path], out_dir: str | Path,
                        weights: Sequence[float] | None = None) -> Path:
    """The weighted average of the drafters in ``dirs`` (float tensors, in fp32), saved to ``out_dir`` in the
    first one's dtype with its config and vocabulary map."""
    dirs, out_dir = [Path(d) for d in dirs], Path(out_dir)
    if len(dirs) < 2:
        raise CheckpointError("average: give at least two checkpoints")
    if any(out_dir.resolve() == d.resolve() for d in dirs):
        raise CheckpointError(f"--out {out_dir}: is one of the checkpoints averaged; write the average elsewhere")
    mix = mixing_weights(weights, len(dirs))
    models = [load_checkpoint(d) for d in dirs]
    for d, m in zip(dirs[1:], models[1:], strict=True):
        if problem := lineage_problem(dirs[0], d, models[0], m):
            raise CheckpointError(problem)
    first, params = models[0], [dict(m.named_parameters()) for m in models]
    for name, (_, kind) in expected_tensors(first.shape).items():
        if kind == "float":
            params[0][name].copy_(sum(w * p[name].float() for w, p in zip(mix, params, strict=True)))
    return save_checkpoint(first, out_dir, read_config(dirs[0]).get("torch_dtype", "bfloat16"))

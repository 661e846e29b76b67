"""The ship/no-ship decision (``decide``, pure) and what follows it: atomic promotion and the history.

A candidate ships iff, on every gate dataset, tau >= tau* (1 + margin) — speculation must beat plain
decoding — and tau >= incumbent tau + min_delta — it must beat what is serving now. A checkpoint
SGLang would serve wrongly (``check_checkpoint``: layout, vocab map, non-finite weights) or a T=0
output that differs from the target's own greedy output is rejected whatever its tau.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.files import append_jsonl, fresh_tmp_dir, swap_dir

SERVABLE_SKIP = ("training_state",)  # resume state stays with the run; SGLang needs the rest


@dataclass
class Decision:
    promote: bool
    reasons: list[str] = field(default_factory=list)


def decide(tau: Mapping[str, float], tau_star: float, margin: float,
           incumbent_tau: Mapping[str, float] | None = None, min_delta: float = 0.0,
           checkpoint_problems: Sequence[str] = (), lossless_mismatches: Sequence[str] = ()) -> Decision:
    """Every check is run and explained, so a rejection lists all its causes at once."""
    reasons = [f"checkpoint: {p}" for p in checkpoint_problems]
    reasons += [f"lossless: {m}" for m in lossless_mismatches]
    if not tau:
        reasons.append("no gate dataset was measured")
    need = tau_star * (1 + margin)
    ok = not reasons
    for name, t in tau.items():
        if not (math.isfinite(t) and t >= need):
            ok = False
            reasons.append(f"{name}: tau {t:.3f} < break-even {need:.3f} (tau* {tau_star:.3f} x (1 + {margin}))")
        else:
            reasons.append(f"{name}: tau {t:.3f} >= break-even {need:.3f}")
        if incumbent_tau is not None:
            inc = incumbent_tau.get(name, float("nan"))
            if not (math.isfinite(t) and t >= inc + min_delta):
                ok = False
                reasons.append(f"{name}: tau {t:.3f} < incumbent {inc:.3f} + min_delta {min_delta}")
            else:
                reasons.append(f"{name}: tau {t:.3f} >= incumbent {inc:.3f} + min_delta {min_delta}")
    return Decision(ok, reasons)


def promote(checkpoint: str | Path, promoted_dir: str | Path) -> Path:
    """Copy the servable files into ``promoted_dir`` via a temp dir and renames: a server reading it
    sees the old drafter or the new one, never a mix."""
    src, dst = Path(checkpoint), Path(promoted_dir)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = fresh_tmp_dir(dst)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns(*SERVABLE_SKIP), dirs_exist_ok=True)
    swap_dir(tmp, dst)
    return dst


def append_history(path: str | Path, record: dict) -> None:
    """One whole JSON line per decision, flushed to disk before returning."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        append_jsonl(f, {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **record}, sort_keys=True)

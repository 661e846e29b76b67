"""Checkpoints: every save is servable (SGLang layout) and also holds the state for an exact resume.

``checkpoints/step-000123/`` = config.json + model.safetensors (``drafter check`` passes) +
run_config.json + ``training_state/`` (accelerate's state: fp32 weights as safetensors, optimizer,
scheduler, per-process RNG of torch/python/numpy/cuda; plus ``trainer.json``: step, epoch, batch
position, counters). It is assembled in a temp dir and renamed, and ``trainer.json`` is written last,
so a directory with it is complete. ``best`` is a symlink to the step with the best held-out metric,
named with its value in ``best.json``; pruning keeps the last ``keep_last`` and the best. ``trainer.json``
also records the checkpoint's claim to best (``candidate``), so that a run resuming from it can finish the best
update and the pruning that a kill after the rename left undone (``finish_save``).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.files import (
    json_text,
    named_errors,
    read_json_object,
    remove_temps,
    replace_symlink,
    sha256_file,
    swap_dir,
    temp_path,
    write_text_atomic,
)
from drafter.model import Eagle3Drafter
from drafter.sglang_checkpoint import CheckpointError, save_checkpoint

STEP_RE = re.compile(r"^step-(\d{6,})$")
STATE_DIR = "training_state"
TRAINER_FILE = "trainer.json"
HOLDOUT_METRIC = "holdout/accept_length"
NO_HOLDOUT = "latest (no held-out split)"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of finished checkpoints, oldest first."""
    found = []
    for d in root.glob("step-*"):
        m = STEP_RE.match(d.name)
        if m and (d / STATE_DIR / TRAINER_FILE).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest(root: Path) -> Path | None:
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    fix = f"delete {ckpt} to resume from an older checkpoint, or pass --resume never"
    return read_json_object(ckpt / STATE_DIR / TRAINER_FILE, fix, CheckpointError)


def _state_digests(state_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(state_dir)): sha256_file(p) for p in sorted(state_dir.rglob("*"))
            if p.is_file() and p.name != TRAINER_FILE}


def verify_state(ckpt: Path) -> None:
    """accelerate restores optimizer/RNG states with pickle (``weights_only=False``), so only files this
    trainer wrote are loaded: their sha256 sums, recorded at save time, must match."""
    want = read_trainer_state(ckpt).get("state_sha256")
    got = _state_digests(ckpt / STATE_DIR)
    if want != got:
        bad = sorted(k for k in set(want or {}) | set(got) if (want or {}).get(k) != got.get(k))
        raise CheckpointError(f"{ckpt / STATE_DIR}: training state does not match the checksums recorded when it was "
                         f"saved ({', '.join(bad) or 'no checksums recorded'}); refusing to unpickle it. "
                         f"Delete {ckpt} to resume from an older checkpoint, or pass --resume never")


def save(accelerator: Any, model: Eagle3Drafter, root: Path, step: int, trainer: dict[str, Any],
         run_config: dict[str, Any], dtype: str) -> Path:
    """Collective (every process calls it): accelerate gathers sharded states itself."""
    final = step_dir(root, step)
    tmp = temp_path(final, shared=True)  # every process saves its part of the state into it
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        save_checkpoint(model, tmp, dtype=dtype,
                        extra_files={"run_config.json": json_text(run_config, indent=2) + "\n"})
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp / STATE_DIR))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        record = {**trainer, "state_sha256": _state_digests(tmp / STATE_DIR)}
        with named_errors(tmp / STATE_DIR / TRAINER_FILE):
            (tmp / STATE_DIR / TRAINER_FILE).write_text(json_text(record, indent=2) + "\n")
        swap_dir(tmp, final)
    accelerator.wait_for_everyone()
    return final


def best_record(root: Path) -> dict[str, Any] | None:
    path = root / "best.json"
    fix = "delete it; training then records the next checkpoint it saves as the best"
    return read_json_object(path, fix, CheckpointError) if path.is_file() else None


def candidate(last_eval: dict[str, float] | None) -> dict[str, Any] | None:
    """A save's claim to best, as ``update_best`` takes it: the held-out metric (None without a held-out split: the
    newest checkpoint is the best one); no claim (None) for a stop's save, made without a held-out pass."""
    if last_eval is None:
        return None
    value = last_eval.get(HOLDOUT_METRIC)
    return {"metric": HOLDOUT_METRIC if value is not None else NO_HOLDOUT, "value": value}


def recorded_candidate(trainer: dict[str, Any]) -> dict[str, Any] | None:
    """The claim to best a checkpoint's ``trainer.json`` records. One without ``candidate`` is read from its
    ``metrics``: a held-out metric is a claim; empty metrics cannot tell a stop's save, so they claim nothing."""
    if "candidate" in trainer:
        return trainer["candidate"]
    metrics = trainer.get("metrics") or {}
    return candidate(metrics) if metrics.get(HOLDOUT_METRIC) is not None else None


def finish_save(root: Path, ckpt: Path, keep_last: int, keep_steps: Sequence[int] = ()) -> bool:
    """Redo the best update and the pruning of the save of ``ckpt``, the newest checkpoint (rank 0, on resume): a
    kill between its rename and those leaves a checkpoint that never competed for best (and may have no ``best``
    at all), and the resumed run may save nothing more. Both are idempotent, so redoing a finished save changes
    nothing. Returns whether ``best`` moved."""
    trainer = read_trainer_state(ckpt)
    step, claim = int(trainer["position"]["step"]), recorded_candidate(trainer)
    old = best_record(root)
    stale = old is None or not (root / "best").exists() or int(old.get("step", -1)) < step
    moved = claim is not None and stale and update_best(root, ckpt, step, claim["metric"], claim["value"])
    prune(root, keep_last, keep_steps)
    return moved


def update_best(root: Path, ckpt: Path, step: int, metric: str, value: float | None) -> bool:
    """Point ``best`` at ``ckpt`` when its metric beats the record (higher is better; with no
    held-out metric, the newest checkpoint is the best one). Returns whether it moved."""
    old = best_record(root)
    if value is not None and old is not None and old.get("value") is not None and value <= old["value"]:
        return False
    replace_symlink(root / "best", ckpt.name)
    record = {"metric": metric, "value": value, "step": step, "checkpoint": ckpt.name}
    write_text_atomic(root / "best.json", json_text(record, indent=2) + "\n")
    return True


def prune(root: Path, keep_last: int, keep_steps: Sequence[int] = ()) -> list[Path]:
    """Delete complete checkpoints older than the last ``keep_last``, never the best nor those of
    ``keep_steps`` (train.save_at); and the temp dirs, links and files of killed saves
    (``common.files.remove_temps``). A checkpoint is renamed to a temp name before it is deleted, so what a kill
    leaves of it is a temp the next run removes, not a step dir that is no checkpoint."""
    best = (root / "best").resolve() if (root / "best").is_symlink() else None
    done = complete_checkpoints(root)
    removed = []
    for step, d in done[:-keep_last]:
        if step not in keep_steps and (best is None or d.resolve() != best):
            doomed = temp_path(d, tag="old")
            os.replace(d, doomed)
            shutil.rmtree(doomed)
            removed.append(d)
    remove_temps(root)  # every process has finished the save: what is left is a killed save's
    return removed

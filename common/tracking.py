"""Experiment trackers named in the run config's ``tracking:`` section, built with accelerate's own tracker
classes, so any tracker accelerate supports works by name (wandb, tensorboard, mlflow, ...).

Training hands the trackers to ``Accelerator(log_with=...)``; eval starts them itself for one report (it
has no Accelerator). Each job is one run: ``train`` and ``eval-<report name>``. Trackers that keep local
files write under ``tracking.logging_dir`` (default ``run_dir/tracking``): TensorBoard event files in
``<logging_dir>/<job>/<project>/``, wandb's run folder in ``<logging_dir>/wandb/``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# accelerate's names (accelerate.tracking.LOGGER_TYPE_TO_CLASS; a test keeps the two equal). Listed here so
# that validating a config does not import accelerate, and with it torch.
TRACKERS = ("aim", "clearml", "comet_ml", "dvclive", "mlflow", "swanlab", "tensorboard", "trackio", "wandb")


class TrackerError(ValueError):
    """A configured tracker that cannot run here; the message says what to install."""


def flat_config(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys and scalar values: every tracker takes these (TensorBoard's hparams take no nesting or
    lists; lists become JSON text)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, f"{name}."))
        elif isinstance(value, list | tuple):
            out[name] = json.dumps(value)
        else:
            out[name] = value
    return out


def make_trackers(tracking: Any, logging_dir: Path, job: str, name: str | None = None) -> list[Any]:
    """Unstarted accelerate trackers for ``tracking.report_to``: one run each, of ``job`` ("train" or
    "eval"), called ``name`` where the tracker takes a run name.

    accelerate silently drops a tracker whose package is missing; here that is an error naming the key."""
    if not tracking.report_to:
        return []
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers

    available = {str(t) for t in get_available_trackers()}
    missing = [name for name in tracking.report_to if name not in available]
    if missing:
        raise TrackerError(f"tracking.report_to: {', '.join(missing)} not installed here; "
                           f"pip install {' '.join(missing)}")
    run = f"{job}-{name}" if name else job
    logging_dir.mkdir(parents=True, exist_ok=True)
    trackers = []
    for tracker in tracking.report_to:
        cls = LOGGER_TYPE_TO_CLASS[tracker]
        kwargs = _defaults(tracker, logging_dir, job, name) | tracking.init_kwargs.get(tracker, {})
        if cls.requires_logging_directory:
            trackers.append(cls(tracking.project, str(logging_dir / run), **kwargs))
        else:
            trackers.append(cls(tracking.project, **kwargs))
    return trackers


def _defaults(tracker: str, logging_dir: Path, job: str, name: str | None) -> dict[str, Any]:
    """Run names and local folders where a tracker takes them; ``tracking.init_kwargs`` overrides these."""
    if tracker == "wandb":
        return {"dir": str(logging_dir), "job_type": job} | ({"name": name} if name else {})
    if tracker == "mlflow":
        return {"run_name": f"{job}-{name}" if name else job}
    return {}

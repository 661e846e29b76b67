"""The data_prep steps in order, each resuming where a killed run stopped; ``python -m data_prep`` calls
``run_steps``. Each step's closing summary is printed and merged into ``run_dir/data_prep_summary.json``
(one key per step).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunConfig, load_config
from common.files import write_json_atomic

ORDER = ("ingest", "regenerate", "capture")


def _runner(step: str) -> Callable[[RunConfig], Any]:
    # Imported per step: ingest needs neither torch nor the target.
    if step == "ingest":
        from data_prep.ingest import run_ingest

        return run_ingest
    if step == "regenerate":
        from data_prep.regenerate import run_regenerate

        return run_regenerate
    from data_prep.capture import run_capture

    return run_capture


def save_summary(cfg: RunConfig, step: str, summary: Any) -> None:
    path = cfg.root / "data_prep_summary.json"
    cfg.root.mkdir(parents=True, exist_ok=True)
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged[step] = summary.to_dict()
    write_json_atomic(path, merged)


def run_steps(step: str, config: str | Path, overrides: Sequence[str] = ()) -> int:
    """``step`` is one of ORDER or "all". Exit code: 0 done, 1 a step failed, 2 a bad config; the
    message is one line on stderr."""
    try:
        cfg = load_config(config, list(overrides))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    for name in ORDER if step == "all" else (step,):
        try:
            summary = _runner(name)(cfg)
        except (ValueError, OSError) as e:  # our errors are ValueErrors with a ready message
            print(f"data_prep {name}: error: {e}", file=sys.stderr)
            return 1
        print(summary)
        save_summary(cfg, name, summary)
    return 0

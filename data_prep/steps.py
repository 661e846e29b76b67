"""The data_prep steps in order, each resuming where a killed run stopped; ``python -m data_prep`` calls
``run_steps``. Each step's closing summary is printed and merged into ``run_dir/data_prep_summary.json``
(one key per step). The steps hold the run dir's lock (``common.locking``). When the config names an API
key variable, its value is a secret: it is redacted from stdout, stderr and the summary (``common.redact``).
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from common import redact
from common.cli import EXIT_ERROR, EXIT_OK, error_line, one_line_errors, trace_unnamed
from common.config import ConfigError, RunConfig, load_config
from common.files import write_json_atomic
from common.locking import run_lock
from common.wheels import MissingWheelError
from data_prep.ingest import run_ingest
from data_prep.step_failed import StepFailed

ORDER = ("synthesize", "ingest", "regenerate", "capture")  # "all" runs synthesize when data.synthesize is set


def _runner(step: str, profile: bool) -> Callable[[RunConfig], Any]:
    # The steps but ingest are imported when they run: ingest needs neither torch nor the target.
    if step == "ingest":
        return run_ingest
    if step == "synthesize":
        from data_prep.self_prompts import run_synthesize

        return run_synthesize
    if step == "regenerate":
        from data_prep.regenerate import run_regenerate

        return functools.partial(run_regenerate, profile=profile)
    if step == "symbol-runs":
        from data_prep.symbol_runs import run_symbol_runs

        return run_symbol_runs
    from data_prep.capture import run_capture

    return run_capture


def save_summary(cfg: RunConfig, step: str, summary: Any) -> None:
    path = cfg.root / "data_prep_summary.json"
    cfg.root.mkdir(parents=True, exist_ok=True)
    merged = json.loads(path.read_text()) if path.is_file() else {}
    merged[step] = redact.redact_tree(summary.to_dict())
    write_json_atomic(path, merged)


@one_line_errors(MissingWheelError, prefix="data_prep: error")
def run_steps(step: str, config: str | Path, overrides: Sequence[str] = (), profile: bool = False) -> int:
    """``step`` is one of ORDER, "symbol-runs" (not in "all": capture reads conversations.jsonl alone) or "all"
    (synthesize only when the config sets it). Exit code: 0 done, 2 an error
    (a bad config, a step that failed, the run dir in use, a crash before the steps start); the message is one line
    on stderr. ``profile``: regenerate's engine measured into its summary (``run_regenerate``'s; for
    bench/regenerate_profiled.py, never the command's)."""
    try:
        cfg = load_config(config, list(overrides))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return EXIT_ERROR
    redact.register_env(cfg.regenerate.api_key_env)
    with redact.redacting_streams():
        steps = [s for s in ORDER if s != "synthesize" or cfg.data.synthesize is not None] if step == "all" else [step]
        return _run_steps(cfg, steps, profile)


@one_line_errors(MissingWheelError, prefix="data_prep: error")
def _run_steps(cfg: RunConfig, steps: Sequence[str], profile: bool) -> int:
    with run_lock(cfg.root, f"data_prep {'+'.join(steps)}"):
        for name in steps:
            try:
                summary = _runner(name, profile)(cfg)
            except StepFailed as e:
                print(e.summary)
                save_summary(cfg, name, e.summary)
                print(f"data_prep {name}: error: {e}", file=sys.stderr)
                return EXIT_ERROR
            except (ValueError, OSError, MissingWheelError) as e:  # ours carry a ready message
                trace_unnamed(e)
                print(f"data_prep {name}: error: {error_line(e)}", file=sys.stderr)
                return EXIT_ERROR
            print(summary)
            save_summary(cfg, name, summary)
    return EXIT_OK

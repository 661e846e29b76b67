"""The regenerate step as ``python -m data_prep regenerate --config CONFIG`` runs it, its engine profiled: the child
process bench/regenerate_throughput.py times.

    python bench/regenerate_profiled.py CONFIG

The command's run-dir lock, summary (printed, and merged into run_dir/data_prep_summary.json) and exit codes; the
summary's ``engine`` (one per device when several) also holds where each process's seconds went
(``engine.profile.EngineProfile``: forwards, the engine's host work by phase, the caller's parts, the run second by
second) and the samples of its host's stack (``host_samples``). The command itself measures none of that.
"""

from __future__ import annotations

import sys

from common.cli import EXIT_ERROR, EXIT_OK
from common.config import load_config
from common.locking import run_lock
from data_prep.regenerate import run_regenerate
from data_prep.step_failed import StepFailed
from data_prep.steps import save_summary


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python bench/regenerate_profiled.py CONFIG", file=sys.stderr)
        return EXIT_ERROR
    cfg = load_config(args[0])
    with run_lock(cfg.root, "data_prep regenerate"):
        try:
            summary = run_regenerate(cfg, profile=True)
        except StepFailed as e:
            print(e.summary)
            save_summary(cfg, "regenerate", e.summary)
            print(f"data_prep regenerate: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        print(summary)
        save_summary(cfg, "regenerate", summary)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

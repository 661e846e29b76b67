"""The regenerate step as ``python -m data_prep regenerate --config CONFIG`` runs it, its engine profiled: the child
process bench/regenerate_throughput.py times.

    python bench/regenerate_profiled.py CONFIG

The command's own run (``data_prep.steps.run_steps``): its run-dir lock, summary (printed, and merged into
run_dir/data_prep_summary.json), one-line errors and exit codes; the summary's ``engine`` (one per device when
several) also holds where each process's seconds went (``engine.profile.EngineProfile``: forwards, the engine's host
work by phase, the caller's parts, the run second by second) and the samples of its host's stack (``host_samples``).
The command itself measures none of that.
"""

from __future__ import annotations

import argparse
import sys

from data_prep.steps import run_steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="run config YAML (bench/regenerate_throughput.py writes RUN/config.yaml)")
    args = ap.parse_args(argv)
    return run_steps("regenerate", args.config, profile=True)


if __name__ == "__main__":
    sys.exit(main())

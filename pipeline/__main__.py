"""The main job: prep → train → eval → gate, one round per invocation (pipeline/rounds.py).

    python -m pipeline --config configs/smollm2-135m.yaml        # what `make demo` runs
"""

from __future__ import annotations

import argparse
import sys

from pipeline import rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline", description=rounds.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = ap.parse_args(argv)
    return rounds.run_round(args.config, args.set)


if __name__ == "__main__":
    sys.exit(main())

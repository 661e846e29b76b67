"""`accelerate launch -m train --config FILE` (or `python -m train --config FILE [--set key=value ...]`).

Training-time-test fine-tuning of the EAGLE-3 drafter on the capture store; the loop is train/loop.py.
"""

from __future__ import annotations

import argparse
import sys

from common.cli import stacks_on_signal
from train.loop import run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--resume", choices=("auto", "never"), default="auto",
                    help="auto: continue from the newest complete checkpoint in run_dir/checkpoints")
    args = ap.parse_args(argv)
    stacks_on_signal()  # a watchdog about to kill a hung run asks where it stands
    return run(args.config, args.set, args.resume)


if __name__ == "__main__":
    sys.exit(main())

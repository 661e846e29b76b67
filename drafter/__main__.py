"""`python -m drafter check DIR [DIR ...]`: validate checkpoint dirs against SGLang's layout.
`python -m drafter average DIR DIR [...] --out DIR [--weights W W ...]`: the weighted average of drafters of one
lineage (``drafter.average``), saved as a checkpoint to gate like any other.

Exit 0: every dir is servable; 1: some are readable drafters SGLang would serve wrongly (every reason printed);
2: a dir is not a readable, finite drafter checkpoint at all (missing, no config.json, damaged or non-finite
weights, tensors missing or unknown: ``CheckpointError``), one line on stderr naming the file, as every command
exits on an error (``common.cli``).
"""

from __future__ import annotations

import argparse
import sys

from common.cli import EXIT_OK, EXIT_REJECTED, one_line_errors
from drafter.average import average_checkpoints
from drafter.sglang_checkpoint import CheckpointError, check_checkpoint


@one_line_errors(CheckpointError)
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafter", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    check = sub.add_parser("check", help="validate SGLang-layout drafter checkpoint directories")
    check.add_argument("dirs", nargs="+")
    check.add_argument("--no-finite", action="store_true", help="skip the non-finite weight scan")
    average = sub.add_parser("average", help="average drafters of one lineage (same layout, vocab map, aux layers)")
    average.add_argument("dirs", nargs="+")
    average.add_argument("--out", required=True, help="where the averaged checkpoint is written")
    average.add_argument("--weights", nargs="+", type=float, help="one per checkpoint (normalised; default equal)")
    args = ap.parse_args(argv)
    if args.cmd == "average":
        print(f"averaged: {average_checkpoints(args.dirs, args.out, args.weights)}")
        return EXIT_OK
    failed = False
    for d in args.dirs:
        problems = check_checkpoint(d, check_finite=not args.no_finite)
        if problems:
            failed = True
            print(f"FAIL {d}")
            for p in problems:
                print(f"  - {p}")
        else:
            print(f"OK   {d}")
    return EXIT_REJECTED if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

"""`python -m drafter check DIR [DIR ...]`: validate checkpoint dirs against SGLang's layout (exit 0/1)."""

from __future__ import annotations

import argparse
import sys

from drafter.checkpoint import check_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m drafter", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    check = sub.add_parser("check", help="validate SGLang-layout drafter checkpoint directories")
    check.add_argument("dirs", nargs="+")
    check.add_argument("--no-finite", action="store_true", help="skip the non-finite weight scan")
    args = ap.parse_args(argv)
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

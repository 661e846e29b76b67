"""What a device call sends back, chosen under the transfer's limits: at most 8 files, 64 MiB together, 16 MiB each.

The GPU machine returns the files a command leaves in $OUT and silently drops what is over a limit, whichever file
that is, results.json included. Here the files come in groups, in priority order,
and a group goes back whole or not at all (half a split checkpoint is of no use): each group that still fits is
moved into $OUT, and each that does not is named on stdout.

    python3 bench/device_out.py --out "$OUT" --group results.json --group logs.tar.gz \
        --group best-config.json best-model.part-aa best-model.part-ab --group learning_curve.png
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

MAX_FILES = 8
MAX_TOTAL = 64 * 2**20
MAX_FILE = 16 * 2**20


def choose(groups: list[list[Path]], max_files: int = MAX_FILES, max_total: int = MAX_TOTAL,
           max_file: int = MAX_FILE) -> tuple[list[list[Path]], list[tuple[list[Path], str]]]:
    """(the groups that go back, the groups left out with why), taking groups in order while they fit."""
    kept: list[list[Path]] = []
    left: list[tuple[list[Path], str]] = []
    files = total = 0
    for group in groups:
        present = [p for p in group if p.is_file()]
        if not present:
            continue
        size = sum(p.stat().st_size for p in present)
        if big := [p.name for p in present if p.stat().st_size > max_file]:
            left.append((present, f"{', '.join(big)} over {max_file / 2**20:g} MiB"))
        elif files + len(present) > max_files:
            left.append((present, f"{files + len(present)} files would pass the {max_files} a call returns"))
        elif total + size > max_total:
            left.append((present, f"{(total + size) / 2**20:.1f} MiB would pass the {max_total / 2**20:g} MiB a "
                                  "call returns"))
        else:
            kept.append(present)
            files, total = files + len(present), total + size
    return kept, left


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the folder the call returns ($OUT)")
    ap.add_argument("--group", nargs="+", type=Path, action="append", default=[], metavar="FILE",
                    help="files that go back together; groups in priority order (missing files are skipped)")
    args = ap.parse_args(argv)
    kept, left = choose(args.group)
    args.out.mkdir(parents=True, exist_ok=True)
    for group in kept:
        for path in group:
            shutil.move(str(path), str(args.out / path.name))
    for group, why in left:
        print(f"out: left behind {' '.join(p.name for p in group)}: {why}", flush=True)
    print(f"out: returning {sum(len(g) for g in kept)} files", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

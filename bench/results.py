"""bench/results.json: each benchmark writes its own figures there, never a person.

One object per benchmark: ``command`` (how to reproduce it), ``device``, ``date`` and the figures as
plain fields. A benchmark that runs again replaces its object; the others stay. Where two benchmarks fill
one object (``ddp_scaling``: regeneration from bench/regenerate_throughput.py, training from
bench/ddp_scaling.py), each writes with ``merge=True`` and names its own fields and provenance
(``regenerate_command``, ...), so neither erases the other's. Writers take a file lock, so benchmarks
running side by side (one per GPU) do not lose each other's objects.

Figures measured where this file is not (a GPU machine's returned results, a scratch BENCH_RESULTS file) come in
whole, as their benchmark wrote them:

    python bench/results.py import runs/from-device/results.json stage6_vs_shipped quality
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.cli import one_line_errors
from common.files import json_text, read_json_object, write_text_atomic
from common.locking import flock

RESULTS = Path(__file__).resolve().with_name("results.json")
# Smoke runs (CI, a CPU dry run) point this elsewhere so that only real measurements land in the file.
RESULTS_ENV = "BENCH_RESULTS"
# What every object carries besides its figures: how, where and when it was measured.
PROVENANCE = ("command", "device", "date")


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n}x {torch.cuda.get_device_name(0)}" if n > 1 else torch.cuda.get_device_name(0)
    return f"cpu ({os.cpu_count()} cores)"


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in ["python", *sys.argv])


def results_path() -> Path:
    """bench/results.json, or where BENCH_RESULTS points (plots are written beside it)."""
    return Path(os.environ.get(RESULTS_ENV, RESULTS))


def recorded(name: str) -> dict[str, Any]:
    """``name``'s object as the results file holds it now (empty when none): for a benchmark that keeps part of
    what an earlier call of its own measured."""
    path = results_path()
    return json.loads(path.read_text()).get(name, {}) if path.is_file() else {}


def measured_here() -> dict[str, str]:
    """``device`` and ``date`` of a measurement made now: an object's, or a part of one measured on another day
    or machine than the rest (an ablation row), which the results table then shows as its own."""
    return {"device": device_name(), "date": time.strftime("%Y-%m-%d")}


@contextmanager
def updating(path: Path) -> Iterator[dict[str, Any]]:
    """The results file's objects, to change in place: read and written back (atomically, in its one layout) under
    its lock, so that writers side by side do not lose each other's objects; nothing is written if the body raises."""
    with flock(path.with_name(path.name + ".lock")):
        data = json.loads(path.read_text()) if path.is_file() else {}
        yield data
        write_text_atomic(path, json_text(data, indent=2, sort_keys=True) + "\n")


def record(name: str, figures: dict[str, Any], command: str | None = None, merge: bool = False) -> None:
    """Replace ``name``'s object in the results file with these figures; ``merge``: keep the object's other
    fields (the figures and the command, device and date replace theirs)."""
    path = results_path()
    entry = {"command": command or command_line(), **measured_here(), **figures}
    with updating(path) as data:
        data[name] = (data.get(name, {}) | entry) if merge else entry
    print(f"{path}: {name} = {json_text(figures)}")


def import_objects(source: Path, names: list[str], target: Path | None = None) -> list[str]:
    """Copy the named objects from another results file into this one, unchanged (each still says which command,
    device and date measured it); an object missing from ``source`` or lacking its provenance is an error naming it,
    and nothing is written then. Returns one line per object: added, or replaced with its earlier date."""
    target = target or results_path()
    src = read_json_object(source, "name the results file a benchmark wrote")
    for name in names:
        obj = src.get(name)
        if not isinstance(obj, dict):
            raise ValueError(f"{source}: no object {name!r} (it holds: {', '.join(sorted(src)) or 'none'})")
        missing = [k for k in PROVENANCE if k not in obj]
        if missing:
            raise ValueError(f"{source}: {name!r} lacks {', '.join(missing)}: not written by a benchmark")
    lines = []
    with updating(target) as data:
        for name in names:
            old = data.get(name)
            lines.append(f"{name}: " + (f"replaced (was {old.get('date')}, now {src[name]['date']})"
                                        if isinstance(old, dict) else f"added ({src[name]['date']})"))
            data[name] = src[name]
    return lines


@one_line_errors()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="copy named objects from another results file into this one")
    imp.add_argument("source", type=Path, help="the results file the objects were measured into")
    imp.add_argument("names", nargs="+", help="the objects to copy")
    args = ap.parse_args()
    lines = import_objects(args.source, args.names)
    print(f"{results_path()}:", *lines, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())

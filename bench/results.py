"""bench/results.json: each benchmark writes its own figures there, never a person.

One object per benchmark: ``command`` (how to reproduce it), ``device``, ``date`` and the figures as
plain fields. A benchmark that runs again replaces its object; the others stay. Where two benchmarks fill
one object (``ddp_scaling``: regeneration from bench/regenerate_throughput.py, training from
bench/ddp_scaling.py), each writes with ``merge=True`` and names its own fields and provenance
(``regenerate_command``, ...), so neither erases the other's. Writers take a file lock, so benchmarks
running side by side (one per GPU) do not lose each other's objects.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from common.files import json_text, write_text_atomic
from common.locking import flock

RESULTS = Path(__file__).resolve().with_name("results.json")
# Smoke runs (CI, a CPU dry run) point this elsewhere so that only real measurements land in the file.
RESULTS_ENV = "BENCH_RESULTS"


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


def record(name: str, figures: dict[str, Any], command: str | None = None, merge: bool = False) -> None:
    """Replace ``name``'s object in the results file with these figures; ``merge``: keep the object's other
    fields (the figures and the command, device and date replace theirs)."""
    path = results_path()
    entry = {"command": command or command_line(), **measured_here(), **figures}
    with flock(path.with_name(path.name + ".lock")):
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[name] = (data.get(name, {}) | entry) if merge else entry
        write_text_atomic(path, json_text(data, indent=2, sort_keys=True) + "\n")
    print(f"{path}: {name} = {json_text(figures)}")

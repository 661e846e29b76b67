"""bench/regenerate_profiled.py, run by its path as bench/regenerate_throughput.py runs it: --help is its usage,
exit 0; a config it cannot load is the regenerate command's one-line error naming the file, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def profiled(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/regenerate_profiled.py", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_help_is_the_usage() -> None:
    r = profiled("--help")
    assert r.returncode == 0 and r.stdout.startswith("usage: regenerate_profiled.py [-h] config"), r.stderr


def test_a_missing_config_is_one_line_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "run.yaml"
    r = profiled(str(missing))
    assert r.returncode == 2 and r.stderr == f"{missing}: no such config file (the shipped ones are in configs/)\n"

"""bench/loop_check.py (plumbing, a few calls a case): its windows' runs are what each case names (a forming loop is
not found, one whose run reaches min_repeat_tokens is), and the object holds every case's timings."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import loop_check  # noqa: E402
from engine.loops import trailing_runs  # noqa: E402


def test_each_window_has_the_run_its_case_names() -> None:
    rng = random.Random(4)
    for period in loop_check.PERIODS:
        for run in loop_check.RUNS:
            tokens = loop_check.window(rng, period, run)
            assert trailing_runs(tokens, loop_check.MAX_PERIOD)[period - 1] == run, (period, run)


def test_the_object_holds_every_case(bench_results: Path) -> None:
    assert loop_check.main(["--calls", "3", "--repeats", "1"]) == 0
    obj = json.loads(bench_results.read_text())["loop_check"]
    cases = obj["cases"]
    assert len(cases) == len(loop_check.PERIODS) * len(loop_check.RUNS)
    assert {(c["period"], c["run"]) for c in cases if c["loop_found"]} == \
        {(p, r) for p in loop_check.PERIODS for r in loop_check.RUNS if r >= max(loop_check.MIN_REPEAT, p)}
    assert all(c["engine_us"] > 0 and c["loop_start_us"] > 0 for c in cases) and obj["forming_speedup"] > 0

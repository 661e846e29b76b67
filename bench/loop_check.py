"""The engine's loop check on one row, as ``Stream._take`` runs it every ``every`` tokens (engine/loops.py).

    python bench/loop_check.py                                   # -> "loop_check" (CPU: pure Python and numpy)

Each case is an answer window of ``check_window`` tokens (random tokens, then a tail loop of period p whose run
is r tokens): runs under ``min_repeat_tokens`` are loops still forming, which the check must rule out, the rest
loops found. Figures, per case, microseconds a check (median of --repeats passes of --calls checks):
``engine_us``: ``may_loop`` and, when it says True, ``loop_start``, as the engine does; ``loop_start_us``:
``loop_start`` alone, which is what a check cost whenever a k-gram pre-check passed (before ``may_loop`` was
exact, on most checks of a forming loop). Why a benchmark: the loop checks were 12 % of an H200 full
regeneration's host samples (bench/RESULTS.md, thirteenth session).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import record  # noqa: E402
from engine.loops import check_window, loop_start, may_loop  # noqa: E402

MIN_REPEAT, MAX_PERIOD, EVERY = 64, 256, 16  # the shipped configs' loop_min_repeat_tokens, loop_max_period
PERIODS = (1, 5, 17, 60, 200)
RUNS = (16, 40, 63, 80)


def window(rng: random.Random, period: int, run: int, vocab: int = 2000) -> list[int]:
    """``check_window`` tokens ending in a loop of ``period`` whose run (positions equal to the one a period
    earlier) is ``run`` tokens long, random tokens before it."""
    size = check_window(MIN_REPEAT, MAX_PERIOD, EVERY)
    block = [rng.randrange(vocab) for _ in range(period)]
    tail = (block * (run // period + 2))[: run + period]
    before = [rng.randrange(vocab) for _ in range(size)]
    before[-1] = (block[-1] + 1) % vocab  # the run starts exactly where asked: the token before it breaks it
    return (before + tail)[-size:]


def engine_check(tokens: list[int]) -> int | None:
    return loop_start(tokens, MIN_REPEAT, MAX_PERIOD) if may_loop(tokens, MIN_REPEAT, MAX_PERIOD) else None


def per_call_us(fn: Callable[[list[int]], object], tokens: list[int], calls: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(tokens)
        times.append((time.perf_counter() - start) / calls * 1e6)
    return round(statistics.median(times), 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000, help="checks a timed pass")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes a case (the median is kept)")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    cases = []
    for period in PERIODS:
        for run in RUNS:
            tokens = window(rng, period, run)
            found = loop_start(tokens, MIN_REPEAT, MAX_PERIOD) is not None
            if may_loop(tokens, MIN_REPEAT, MAX_PERIOD) != found:
                raise AssertionError(f"may_loop disagrees with loop_start at period {period}, run {run}")
            cases.append({"period": period, "run": run, "loop_found": found,
                          "engine_us": per_call_us(engine_check, tokens, args.calls, args.repeats),
                          "loop_start_us": per_call_us(lambda t: loop_start(t, MIN_REPEAT, MAX_PERIOD), tokens,
                                                       args.calls, args.repeats)})
            print(cases[-1])
    forming = [c for c in cases if not c["loop_found"]]
    record("loop_check", {
        "min_repeat_tokens": MIN_REPEAT, "max_period": MAX_PERIOD,
        "window": check_window(MIN_REPEAT, MAX_PERIOD, EVERY),
        "cases": cases,
        "forming_engine_us_median": statistics.median(c["engine_us"] for c in forming),
        "forming_loop_start_us_median": statistics.median(c["loop_start_us"] for c in forming),
        "forming_speedup": round(statistics.median(c["loop_start_us"] / c["engine_us"] for c in forming), 2),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())

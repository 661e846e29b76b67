"""common.stack_sampler: samples of the entering thread's stack name where it spent its time.

A thread spins in one function for 0.3 s (holding the GIL, so the sampler wakes late), then sleeps in another for
0.2 s: both show up as own time in about those proportions (credited by time, not counted). Every function on the
stack counts as inclusive time (their caller on near every sample). The summary is shares of the sampled time,
ranked."""

from __future__ import annotations

import time

from common.stack_sampler import StackSampler


def spin(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def nap(seconds: float) -> None:
    time.sleep(seconds)


def work() -> None:
    spin(0.3)
    nap(0.2)


def test_samples_name_the_functions_the_thread_spent_its_time_in() -> None:
    with StackSampler(interval_s=0.002) as s:
        work()
    out = s.summary(top=100)  # (pytest's own frames are on every sample too)
    assert out["samples"] >= 50 and out["interval_s"] == 0.002 and 0.45 <= out["seconds"] < 2
    own = {w["where"].split()[-1]: w["share"] for w in out["own"]}
    inclusive = {w["where"].split()[-1]: w["share"] for w in out["inclusive"]}
    assert 0.45 < own.get("spin", 0) < 0.75 and 0.25 < own.get("nap", 0) < 0.55, own
    assert inclusive["work"] > 0.9 and inclusive["work"] >= inclusive["spin"] + inclusive["nap"] - 0.05
    assert all(w["where"].startswith("tests/test_common_stack_sampler.py") for w in out["own"][:2])
    shares = [w["share"] for w in out["own"]]
    assert shares == sorted(shares, reverse=True)


def test_an_unsampled_run_summarises_to_nothing() -> None:
    with StackSampler(interval_s=5.0) as s:
        pass
    out = s.summary()
    assert out["samples"] == 0 and out["own"] == [] and out["inclusive"] == []

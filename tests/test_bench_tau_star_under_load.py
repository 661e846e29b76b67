"""bench/tau_star_under_load.py's plumbing on the real SmolLM2, a pass or two of one short prompt: one
"tau_star_under_load" object with both reads of tau* per pass, quiet and under a light load, and their summary."""

from __future__ import annotations

import json
import math

import pytest

from bench import tau_star_under_load


@pytest.mark.real
def test_one_object_with_both_reads_per_pass_quiet_and_loaded(bench_results) -> None:
    assert tau_star_under_load.main(["--repeats", "2", "--prompts", "1", "--max-new-tokens", "8", "--load-procs", "1",
                                     "--burst-s", "0.05", "--idle-s", "0.2"]) == 0
    obj = json.loads(bench_results.read_text())["tau_star_under_load"]
    assert obj["command"].startswith("python") and obj["load"] == {"procs": 1, "burst_s": 0.05, "idle_s": 0.2}
    for condition in ("quiet", "loaded"):
        passes = obj["passes"][condition]
        assert len(passes) == 2
        for p in passes:
            assert 0 <= p["stalled_steps"] <= p["steps"] and p["steps"] > 0
            for read in ("with_stalls", "stall_free"):
                assert math.isfinite(p[read]["point"]) and p[read]["point"] > 0
        assert set(obj["summary"][condition]) == {"with_stalls", "stall_free"}
        assert obj["summary"][condition]["stall_free"]["points_spread"] >= 0


def test_bad_arguments_are_one_line_errors(capsys) -> None:
    with pytest.raises(SystemExit):
        tau_star_under_load.main(["--repeats", "0"])
    assert "--repeats 0: must be at least 1" in capsys.readouterr().err

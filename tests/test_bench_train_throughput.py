"""bench/train_throughput.py writes its own figures: the CPU dry run lands in the BENCH_RESULTS file as one
"train_throughput" object, a row per shape with the shape's numbers, marked as a CPU measurement."""

from __future__ import annotations

import json

from bench import train_throughput


def test_the_cpu_dry_run_records_its_row(bench_results) -> None:
    assert train_throughput.main(["--shape", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                                  "--seq", "16"]) == 0
    obj = json.loads(bench_results.read_text())["train_throughput"]
    assert obj["device"].startswith("cpu") and obj["date"] and obj["command"]
    [row] = obj["runs"]
    assert row["name"] == "tiny" and row["shape"] == train_throughput.SHAPES["tiny"]
    assert (row["batch"], row["seq"], row["ttt_length"], row["steps_timed"]) == (1, 16, 7, 2)
    assert row["median_ms"] > 0 and abs(row["tokens_per_s"] / (16 / row["median_ms"] * 1e3) - 1) < 1e-3

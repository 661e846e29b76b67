"""bench/decode_step.py's CPU plumbing on a one-layer target: one "decode_step" object with a run per rows,
context and block-mask setting (full pages unmasked, then masked), the KV bytes a step reads as the bench counts
them (rows x (context + 1) positions; 130 crosses the first 128-position page's end), an eager time, and no graph
time (CUDA graphs need CUDA) nor kernel profile on a CPU; the engine's own step (``stream``) beside the first, its
wall ms split into the host's decode (launch and wait), the device's and the engine's own host work."""

from __future__ import annotations

import json

from bench import decode_step


def test_the_cpu_plumbing_records_a_run_per_configuration(bench_results) -> None:
    assert decode_step.main(["--device", "cpu", "--rows", "3", "--context", "130", "--layers", "1",
                             "--steps", "1"]) == 0
    obj = json.loads(bench_results.read_text())["decode_step"]
    assert obj["device"].startswith("cpu") and obj["date"] and obj["command"] and obj["layers"] == 1
    per_token = obj["kv_bytes_per_token"]
    assert per_token == 2 * 1 * 3 * 64 * 4  # K and V, one layer, 3 heads of 64, float32 on a CPU
    assert [(r["rows"], r["context"], r["full_blocks"]) for r in obj["runs"]] == [(3, 130, True), (3, 130, False)]
    for r in obj["runs"]:
        assert r["kv_gb_per_step"] == round(3 * 131 * per_token / 1e9, 3)
        assert r["graph_ms"] is None and r["tokens_per_s_graph"] is None and r["graph_fallback"] is None
        assert r["eager_ms"] > 0
        assert r["profiled"] is False and r["kv_gb_per_s"] is None
    stream = obj["runs"][0]["stream"]
    assert "stream" not in obj["runs"][1] and stream["ms"] > 0 and stream["tokens_per_s"] > 0
    assert stream["device_ms"] > 0 and stream["host_decode_ms"] >= stream["device_ms"]  # launch + wait >= launch
    assert stream["graph_steps"] == 0

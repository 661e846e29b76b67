"""bench/prefill_step.py's CPU plumbing on a one-layer target: one "prefill_step" object with a run per shape, a
fresh prefill (SDPA) or a continuation (the suffix kernel) at the shape the engine pads to on CUDA
(``prefill_shape``: at least 2 rows and one query block plus one); the first call's time, the median again and the
time to return; no kernel profile on a CPU. A malformed shape is refused by name."""

from __future__ import annotations

import argparse
import json

import pytest

from bench import prefill_step


def test_the_cpu_plumbing_records_a_run_per_shape(bench_results) -> None:
    assert prefill_step.main(["--device", "cpu", "--layers", "1", "--shapes", "2x8+0", "1x5+130",
                              "--repeats", "1"]) == 0
    obj = json.loads(bench_results.read_text())["prefill_step"]
    assert obj["device"].startswith("cpu") and obj["date"] and obj["command"] and obj["layers"] == 1
    runs = obj["runs"]
    assert [(r["shape"], r["kernel"]) for r in runs] == [("2x8+0", "suffix (flex)"), ("1x5+130", "suffix (flex)")]
    assert runs[0]["padded"] == [2, 129] and runs[1]["padded"] == [2, 129]
    for r in runs:
        assert r["first_ms"] > 0 and r["again_ms"] >= r["host_ms"] > 0 and r["tokens_per_s"] > 0
        assert r["profiled"] is False and r["kernel_ms"] == 0


def test_a_malformed_shape_is_refused_by_name() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="26x129"):
        prefill_step.parse_shape("26x129")


def test_an_inductor_setting_is_applied_and_recorded_beside_the_default_object(bench_results) -> None:
    import torch._inductor.config as inductor_config

    before = inductor_config.cpp_wrapper  # (a config module: pytest's monkeypatch deletes its settings on undo)
    try:
        assert prefill_step.main(["--device", "cpu", "--layers", "1", "--shapes", "2x8+0", "--repeats", "1",
                                  "--inductor", "cpp_wrapper=True"]) == 0
        assert inductor_config.cpp_wrapper is True
    finally:
        inductor_config.cpp_wrapper = before
    data = json.loads(bench_results.read_text())
    assert "prefill_step" not in data  # the default run's object is not replaced by this one
    assert data["prefill_step_inductor"]["inductor_config"] == {"cpp_wrapper": True}
    assert [r["shape"] for r in data["prefill_step_inductor"]["runs"]] == ["2x8+0"]


@pytest.mark.parametrize(("text", "want"), [("cpp_wrapper=True", ("cpp_wrapper", True)),
                                             ("cpp_wrapper=false", ("cpp_wrapper", False)),
                                             ("compile_threads=4", ("compile_threads", 4))])
def test_inductor_settings_parse_as_values(text: str, want: tuple) -> None:
    assert prefill_step.parse_inductor_setting(text) == want


@pytest.mark.parametrize("text", ["no_such_setting=1", "cpp_wrapper"])
def test_an_unknown_or_valueless_inductor_setting_is_refused_by_name(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=text):
        prefill_step.parse_inductor_setting(text)

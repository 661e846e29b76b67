"""bench/train_k25.py: a missing SpecForge benchmark or module is one line naming the fix, before any GPU work;
the figures (speed-up over our faster step, medians over rounds, alternating order) come from SpecForge's own
results rows, here written by a stand-in script in the real one's format; its error rows and a shape that is not
ours fail loudly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from bench import train_k25

FAKE = Path(__file__).with_name("fake_bench_specforge.py")


def test_a_missing_benchmark_is_one_line_naming_the_flag(tmp_path, capsys) -> None:
    missing = tmp_path / "bench_specforge.py"
    assert train_k25.main(["--specforge-bench", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err and "--specforge-bench" in err and "specforge==0.2.0" in err


def test_a_missing_specforge_module_is_one_line_naming_the_wheel(tmp_path, capsys, monkeypatch) -> None:
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "specforge" else find(name, *a))
    assert train_k25.main(["--specforge-bench", str(FAKE)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(FAKE) in err and "--no-deps specforge==0.2.0" in err


@pytest.fixture
def ours(monkeypatch) -> list[tuple[bool, int]]:
    """Our step stubbed (the K2.5 shape does not fit a CPU): eager 220 then 230 ms, compiled 200 then 210 ms."""
    calls: list[tuple[bool, int]] = []
    times = {False: [220.0, 230.0], True: [200.0, 210.0]}

    def bench(shape, batch, seq, ttt, steps, warmup, device, compile_step):
        calls.append((compile_step, seq))
        return {"median_ms": times[compile_step][sum(c == compile_step for c, _ in calls) - 1],
                "compile": compile_step, "hidden_size": shape.hidden_size}

    monkeypatch.setattr(train_k25, "bench", bench)
    return calls


def test_speedup_is_specforge_over_our_faster_step_over_alternating_rounds(tmp_path, ours, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_STEP_S", "0.2337")
    fig = train_k25.compare(FAKE, 2, 1, 2048, 7, 12, 3, torch.device("cpu"), tmp_path / "out")
    assert ours == [(False, 2048), (True, 2048)] * 2
    assert fig["ours_ms"] == {"eager": 225.0, "compiled": 205.0} and fig["best"] == "compiled"
    assert fig["specforge_ms"] == 233.7 and fig["speedup"] == round(233.7 / 205.0, 3) == 1.14
    assert fig["order"] == [["specforge", "ours"], ["ours", "specforge"]]
    assert fig["shape"] == {"hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
                            "num_key_value_heads": 64, "head_dim": 128, "vocab_size": 163840,
                            "draft_vocab_size": 32000}
    assert (fig["batch"], fig["seq"], fig["ttt"], fig["steps"], fig["warmup"], fig["rounds"]) == (1, 2048, 7, 12, 3, 2)
    assert len(fig["ours_raw"]) == 2 and fig["ours_raw"][0]["compiled"]["median_ms"] == 200.0
    [a, b] = fig["specforge_raw"]
    assert a["backend"] == "flex_attention" and a["timed_steps"] == 12 and a["seq_len"] == 2048
    assert a["env"]["specforge"] == fig["specforge_version"] == "0.2.0"
    assert (tmp_path / "out" / "specforge-1" / "specforge.log").read_text().count("SUMMARY") == 1


def test_a_failed_or_different_peer_step_is_an_error(tmp_path, ours, monkeypatch) -> None:
    monkeypatch.setenv("FAKE_ERROR", "OutOfMemoryError('CUDA out of memory')")
    with pytest.raises(RuntimeError, match="OutOfMemoryError"):
        train_k25.compare(FAKE, 1, 1, 2048, 7, 12, 3, torch.device("cpu"), tmp_path / "out")
    monkeypatch.delenv("FAKE_ERROR")
    monkeypatch.setenv("FAKE_HIDDEN", "4096")
    with pytest.raises(RuntimeError, match="not the same step"):
        train_k25.compare(FAKE, 1, 1, 2048, 7, 12, 3, torch.device("cpu"), tmp_path / "out")

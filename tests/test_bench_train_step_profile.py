"""bench/train_step_profile.py's CPU plumbing: one "train_step_profile" object in the BENCH_RESULTS file, an entry
per configuration (a second run adds its own beside the first's), whose
phases (forward with the loss, backward, clip and optimizer) each took time and add up to the step, marked
uncompiled, with no MFU and no kernel profile (a CPU has neither a peak to weigh against nor CUDA kernels); and a
drafter shape other than tiny on a CPU is a usage error before anything is built."""

from __future__ import annotations

import json

import pytest

from bench import train_step_profile


def test_the_cpu_plumbing_records_its_phases(bench_results) -> None:
    assert train_step_profile.main(["--shape", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1",
                                    "--profile-steps", "1"]) == 0
    assert train_step_profile.main(["--shape", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0",
                                    "--profile-steps", "1", "--batch", "2"]) == 0
    top = json.loads(bench_results.read_text())["train_step_profile"]
    assert top["device"].startswith("cpu") and top["date"] and set(top) >= {"tiny_b1_eager", "tiny_b2_eager"}
    obj = top["tiny_b1_eager"]  # the first run's entry stays beside the second's
    assert obj["command"] and top["tiny_b2_eager"]["command"] and top["tiny_b2_eager"]["batch"] == 2
    assert obj["shape_name"] == "tiny" and (obj["steps_timed"], obj["profile_steps"]) == (2, 1)
    phases = obj["phase_ms"]
    assert set(phases) == {"forward_loss", "backward", "clip_optimizer"}  # (the file sorts its keys)
    assert all(ms > 0 for ms in phases.values())
    assert obj["step_ms"] == pytest.approx(sum(phases.values()), rel=0.03)
    assert obj["compile"] is False and obj["mfu"] is None and obj["model_ms_at_peak"] >= 0
    assert obj["profiled"] is False and obj["kernels"] == 0 and obj["top_kernels"] == []


def test_a_real_shape_on_a_cpu_is_a_usage_error(bench_results, monkeypatch) -> None:

    def built(*args, **kwargs):
        raise AssertionError("built a step for a shape a CPU does not run")

    monkeypatch.setattr(train_step_profile, "step_setup", built)
    monkeypatch.setattr(train_step_profile, "profile_step", built)
    with pytest.raises(SystemExit) as e:
        train_step_profile.main(["--shape", "k25", "--device", "cpu"])
    assert e.value.code == 2 and not bench_results.exists()

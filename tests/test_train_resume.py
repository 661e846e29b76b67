"""kill -9 mid-run, then resume: the per-step losses equal an uninterrupted run's, bit for bit (CPU)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_fixtures import make_config, make_store

ENV = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}


def _run(cfg: Path, *extra: str) -> subprocess.Popen:
    # a session of its own: a test may signal the whole process group, as `timeout` does
    return subprocess.Popen([sys.executable, "-m", "train", "--config", str(cfg), *extra], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _losses(root: Path) -> list[tuple[int, float]]:
    lines = (root / "run" / "train_log.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.mark.parametrize("aux_scale", ["none", "per_state"])
def test_kill9_then_resume_matches_uninterrupted(tmp_path, aux_scale: str):
    # A 2-window accumulation and more steps than one epoch: the resume must restore the epoch,
    # the batch position, the optimizer, the schedule and every RNG (and, with per_state, fc's input scale).
    train = dict(max_steps=14, epochs=10, save_every=4, grad_accum=2, batch_tokens=60, log_every=2)
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        make_store(root / "run" / "store", n_samples=20, length=16)
    drafter = {"aux_scale": aux_scale}
    cfg_a, cfg_b = make_config(a, drafter=drafter, **train), make_config(b, drafter=drafter, **train)
    proc = _run(cfg_a)
    assert proc.communicate(timeout=120) and proc.returncode == 0
    want = _losses(a)
    assert len(want) == 14

    proc = _run(cfg_b)
    ckpt = b / "run" / "checkpoints" / "step-000008" / "training_state" / "trainer.json"
    deadline = time.time() + 120
    while not ckpt.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _losses(b)
    assert ckpt.is_file() and len(done) < 14, f"run finished before the kill ({len(done)} steps)"
    proc = _run(cfg_b)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "drafter: resume from" in out and "step-0000" in out, out  # it continued, not restarted
    assert ("fc reads the aux states scaled by" in out) is (aux_scale == "per_state"), out
    got = _losses(b)
    assert got == want  # exact float equality, step by step: the same kernels on the same data, on one CPU


def test_sigterm_saves_the_step_it_ends_and_the_resume_matches_uninterrupted(tmp_path):
    # A cut device call (`timeout` sends SIGTERM to the process group) must cost no steps: the run finishes its
    # step, saves it (between the periodic saves, which are off here; not as best: it had no held-out pass),
    # exits 143, and the rerun continues from that step.
    train = dict(max_steps=200, epochs=1000, save_every=1000, grad_accum=1, batch_tokens=60, log_every=1)
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        make_store(root / "run" / "store", n_samples=20, length=16)
    cfg_a, cfg_b = make_config(a, **train), make_config(b, **train)
    proc = _run(cfg_a)
    assert proc.communicate(timeout=120) and proc.returncode == 0
    want = _losses(a)
    assert len(want) == 200

    proc = _run(cfg_b)
    log = b / "run" / "train_log.jsonl"
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline and len(_losses(b) if log.is_file() else []) < 3:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGTERM)  # the process group, as `timeout` signals it
    out, err = proc.communicate(timeout=120)
    done = _losses(b)
    assert proc.returncode == 143, err
    assert 3 <= len(done) < 200, f"stopped after {len(done)} steps"
    step = done[-1][0]
    assert f"stopped on SIGTERM at step {step} of 200" in out, out
    assert (b / "run" / "checkpoints" / f"step-{step:06d}" / "training_state" / "trainer.json").is_file()
    assert not (b / "run" / "checkpoints" / "best").exists()  # saved without a held-out pass: no candidate

    proc = _run(cfg_b)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"drafter: resume from {b / 'run' / 'checkpoints' / f'step-{step:06d}'}" in out, out
    assert _losses(b) == want

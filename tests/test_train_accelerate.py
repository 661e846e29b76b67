"""Two CPU processes (gloo DDP under torchrun; accelerate's own launcher runs CPU multi-process jobs only
through mpirun, and otherwise silently starts one process): training works, its checkpoint passes
`drafter check`, and the per-step losses equal one process accumulating the same global batch."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from train_fixtures import make_config, make_store

REPO = Path(__file__).resolve().parents[1]


ENV = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}


def two_processes(port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
            "-m", "train"]


def run_launch(cmd: Sequence[str], timeout: float = 240) -> subprocess.CompletedProcess:
    """``cmd`` run to its end; past ``timeout`` every worker is asked for its Python stacks (SIGUSR1, which
    ``python -m train`` answers through ``common.cli.stacks_on_signal``), then killed with the launcher, and the test
    fails with the stacks: a hang then says where each rank stood instead of only that it hung."""
    proc = subprocess.Popen(list(cmd), env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        workers = {rank: _rank_pid(proc.pid, rank) for rank in (0, 1)}
        pids = [pid for pid in workers.values() if pid] or [proc.pid]  # none: cmd is the trainer itself
        for pid in pids:  # one at a time, so that the ranks' stacks do not interleave
            with contextlib.suppress(ProcessLookupError):  # (it may have ended since)
                os.kill(pid, signal.SIGUSR1)
            time.sleep(1.5)
        native = "\n".join(f"pid {pid}:\n{native_stacks(pid)[-6000:]}" for pid in pids)  # main thread last
        for pid in {*pids, proc.pid}:  # torchrun's workers hold the pipes: the launcher's death alone leaves them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        lines = err[max(0, err.find("most recent call first") - 200):].replace("\r", "\n").splitlines()
        stacks = "\n".join(x for x in lines if "step/s" not in x and "s/step" not in x)  # no progress bars
        pytest.fail(f"{' '.join(cmd[-4:])} still running after {timeout:.0f} s; worker pids by rank {workers}; "
                    f"their stacks:\n{stacks[-8000:]}\nnative stacks:\n{native}\nstdout's tail:\n{out[-2000:]}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)


def native_stacks(pid: int) -> str:
    """Every thread's C stack of ``pid`` (gdb, where the machine has it): a hang inside a destructor or a collective
    shows no Python frame below the line that called it."""
    if shutil.which("gdb") is None:
        return "no gdb on this machine"
    try:
        done = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"], capture_output=True,
                              text=True, timeout=90)
    except subprocess.TimeoutExpired:
        return "gdb did not answer within 90 s"
    return "\n".join(x[:160] for x in done.stdout.splitlines() if x.startswith(("#", "Thread")))


def test_two_cpu_processes_train_and_checkpoint(tmp_path):
    cfg = make_config(tmp_path, max_steps=4, epochs=2, save_every=2, eval_every=2, batch_tokens=48,
                      holdout_fraction=0.2)
    make_store(tmp_path / "run" / "store", n_samples=24, length=16)
    proc = run_launch([*two_processes(29561), "--config", str(cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("drafter: from scratch") == 1  # printed by the main process only
    assert "2 processes" in proc.stdout
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4]
    ckpts = tmp_path / "run" / "checkpoints"
    check = subprocess.run([sys.executable, "-m", "drafter", "check", str(ckpts / "step-000004"), str(ckpts / "best")],
                           capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 0, check.stdout


def test_two_processes_match_one_process_with_the_same_global_batch(tmp_path):
    """DDP over 2 processes equals 1 process accumulating 2 batches: the same batches (rank r takes every
    2nd), the same averaged gradient, so the same per-step losses."""
    losses = {}
    for name, launch in (("ddp", two_processes(29562)),
                         ("single", [sys.executable, "-m", "train", "--set", "train.grad_accum=2"])):
        root = tmp_path / name
        cfg = make_config(root, max_steps=6, epochs=5, save_every=100, eval_every=100, batch_tokens=48,
                          holdout_fraction=0.0, log_every=100)
        make_store(root / "run" / "store", n_samples=32, length=16)
        proc = run_launch([*launch, "--config", str(cfg)])
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = [json.loads(x) for x in (root / "run" / "train_log.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in log if "loss" in r]
    assert len(losses["ddp"]) == len(losses["single"]) == 6
    for a, b in zip(losses["ddp"], losses["single"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(b), losses


def _rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the worker of ``rank`` under the launcher (read from /proc: its parent and environment)."""
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(d)
    return None


def test_sigterm_to_one_process_stops_every_process_at_the_same_saved_step(tmp_path):
    """A scheduler may signal one worker only: the others learn it in the step's reduction, all save that step
    together, and the main process reports the stop (not "done") for every rank."""
    cfg = make_config(tmp_path, max_steps=400, epochs=1000, save_every=1000, eval_every=1000, batch_tokens=48,
                      holdout_fraction=0.0, log_every=1)
    make_store(tmp_path / "run" / "store", n_samples=24, length=16)
    proc = subprocess.Popen([*two_processes(29563), "--config", str(cfg)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    log = tmp_path / "run" / "train_log.jsonl"
    deadline = time.time() + 180
    while proc.poll() is None and time.time() < deadline and (
            not log.is_file() or sum('"loss"' in line for line in log.read_text().splitlines()) < 3):
        time.sleep(0.05)
    worker = _rank_pid(proc.pid, 1)
    assert worker is not None, "rank 1 not found"
    os.kill(worker, signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    steps = [json.loads(x)["step"] for x in log.read_text().splitlines() if '"loss"' in x]
    assert 3 <= len(steps) < 400, err[-3000:]
    assert f"stopped on SIGTERM at step {steps[-1]} of 400" in out and "done:" not in out, out + err[-3000:]
    assert (tmp_path / "run" / "checkpoints" / f"step-{steps[-1]:06d}" / "training_state" / "trainer.json").is_file()

"""Training runs for the benchmarks: a run dir per variant over shared regenerated conversations, the
command that trains it (one GPU, or several through ``accelerate launch``), and its log read back."""

from __future__ import annotations

import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import parent_death
from common.cli import exit_reason
from common.config import load_config, write_config
from train.holdout_curve import read_train_log

REPO = Path(__file__).resolve().parents[1]


def make_run(base_config: str | Path, run_dir: Path, conversations: Path, overrides: list[str]) -> Path:
    """``run_dir/config.yaml``: the base config with ``run_dir`` and ``key=value`` overrides applied, over a
    link to ``conversations`` (validated now, so a bad override fails before any GPU work)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    link = run_dir / "conversations.jsonl"
    if not link.exists():
        link.symlink_to(Path(conversations).resolve())
    return write_config(load_config(base_config, [f"run_dir={run_dir}", *overrides]), run_dir / "config.yaml")


def train_command(config: Path, gpus: int = 1, precision: str | None = None) -> list[str]:
    if gpus == 1:
        return [sys.executable, "-m", "train", "--config", str(config)]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(gpus),
              "--num_machines", "1", "--dynamo_backend", "no", "--mixed_precision", precision or "bf16"]
    return [*launch, "-m", "train", "--config", str(config)]


class Stalled(RuntimeError):
    """A run that printed nothing for longer than its silence limit, killed."""


STACK_WAIT_S = 3.0  # for a stalled run's stack dump to reach its log before the kill


def process_table() -> str:
    """Every process's state, CPU share, memory and command: whether a stalled run's helpers (its render pool,
    compile workers) were busy or all asleep, which tells a slow start from a deadlock."""
    try:
        return subprocess.run(["ps", "-eo", "pid,ppid,stat,pcpu,rss,etime,args", "--sort=ppid"], capture_output=True,
                              text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"(ps failed: {e})\n"


def record_stall(proc: subprocess.Popen, log: Path) -> None:
    """Before a stalled run is killed: its Python stacks (entry points register ``common.cli.stacks_on_signal``
    for SIGUSR1) and the process table, appended to its log, so the next look at a stall starts from where it
    stood instead of from a guess."""
    proc.send_signal(signal.SIGUSR1)
    time.sleep(STACK_WAIT_S)
    with open(log, "a") as f:
        f.write("\n--- stalled: process table ---\n" + process_table())


def run(cmd: list[str], env: dict[str, str] | None = None, log: Path | None = None,
        silent_limit_s: float | None = None) -> None:
    """Run ``cmd`` from the repo root (its output to ``log``); a failure raises with the log's tail.
    ``silent_limit_s`` (with ``log``): kill it once the log has not grown for that long, so one hung run cannot
    hold its GPU slot until the device call ends (training prints every step)."""
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    with open(log, "w") if log else open(os.devnull, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=sink if log else None,
                                stderr=subprocess.STDOUT if log else None,
                                **parent_death.stage_kwargs())  # dies with us
        size, quiet_since = -1, time.monotonic()
        while True:
            try:
                proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if log is None or silent_limit_s is None:
                    continue
            if (now_size := log.stat().st_size) != size:
                size, quiet_since = now_size, time.monotonic()
            elif time.monotonic() - quiet_since > silent_limit_s:
                record_stall(proc, log)
                proc.kill()
                proc.wait()
                raise Stalled(f"no output for {silent_limit_s:g} s, killed: {' '.join(cmd)} (log: {log}, with its "
                              "stacks and the process table at the kill)")
    if proc.returncode != 0:
        tail = log.read_text()[-3000:] if log else ""
        raise RuntimeError(f"{exit_reason(proc.returncode)}: {' '.join(cmd)}\n{tail}")


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_train_log(run_dir) if "tokens_per_s" in r]


def median_tokens_per_s(run_dir: Path, skip: int = 5) -> float:
    """Median over steps after the first ``skip`` (compilation and warm-up; fewer for short smoke runs)."""
    recs = step_records(run_dir)
    return statistics.median(r["tokens_per_s"] for r in recs[min(skip, len(recs) - 1):])


def holdout_at(run_dir: Path, step: int) -> dict[str, float]:
    return next((r for r in read_train_log(run_dir) if r.get("step") == step and "holdout/acc_0" in r), {})

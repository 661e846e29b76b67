"""`accelerate launch` with 2 CPU processes (gloo DDP): trains, and its checkpoint passes `drafter check`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from train_fixtures import make_config, make_store

REPO = Path(__file__).resolve().parents[1]


def test_accelerate_launch_two_cpu_processes(tmp_path):
    cfg = make_config(tmp_path, max_steps=4, save_every=2, eval_every=2, batch_tokens=48, holdout_fraction=0.2)
    make_store(tmp_path / "run" / "store", n_samples=24, length=16)
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO / "configs" / "accelerate" / "cpu_ddp_2proc.yaml"), "-m", "train", "--config", str(cfg)]
    proc = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("drafter: from scratch") == 1  # printed by the main process only
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4]
    ckpts = tmp_path / "run" / "checkpoints"
    check = subprocess.run([sys.executable, "-m", "drafter", "check", str(ckpts / "step-000004"), str(ckpts / "best")],
                           capture_output=True, text=True, cwd=REPO)
    assert check.returncode == 0, check.stdout

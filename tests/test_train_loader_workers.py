"""The training loader's worker processes (train/data.py): a SIGTERM to the trainer's process group (``timeout``'s,
at a device call's deadline) must leave them reading while the trainer finishes its step, and a loader iterator
still open when the trainer exits must not hang that exit. Real DataLoader workers on the CPU, each scenario in a
process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A trainer in miniature: reads batches from two workers set up as train/data.py sets them up; on SIGTERM it reads
# 20 more (its "step"), then returns with the iterator still open (held by a module global until the exit).
TRAINER = """
import signal, sys, time
from torch.utils.data import DataLoader
from common.cli import own_process_group
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
def batches():
    yield from DataLoader(list(range(10**6)), batch_size=4, num_workers=2, prefetch_factor=4,
                          worker_init_fn=own_process_group)
OPEN = batches()
last = 300 if sys.argv[1] == "exit" else None  # the batch it stops after
for i, _ in enumerate(OPEN):
    if i == 5:
        print("reading", flush=True)
    if stop and last is None:
        last = i + 20
    if i == last:
        break
    time.sleep(0.01)
print("finished its step at batch", i, flush=True)
"""


def start(mode: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", TRAINER, mode], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})


def finish(proc: subprocess.Popen, within_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=within_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers are in groups of their own: they end by torch's watchdog
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {within_s} s (its exit hung):\n{out}") from None
    assert proc.returncode == 0, out
    return out


def test_an_iterator_left_open_at_exit_does_not_hang_the_exit():
    assert "finished its step at batch 300" in finish(start("exit"), within_s=60)


def test_a_sigterm_to_the_process_group_leaves_the_workers_reading_through_the_step():
    proc = start("signal")
    assert proc.stdout is not None and proc.stdout.readline().strip() == "reading"
    os.killpg(proc.pid, signal.SIGTERM)  # what `timeout` does at the deadline
    t0 = time.monotonic()
    out = finish(proc, within_s=60)
    assert "finished its step at batch" in out and "DataLoader worker" not in out, out
    assert time.monotonic() - t0 < 60

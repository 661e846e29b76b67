"""The run-dir lock: one writer at a time, the holder named, no stale lock after a kill, and stages of a
holder run under its lock only when the holder is really their ancestor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.locking import HELD_ENV, HOLDER_ENV, LockBusy, inherit_env, lock_path, run_lock

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time; from common.locking import run_lock\n"
        "with run_lock(sys.argv[1], 'holder'):\n    print('held', flush=True); time.sleep(600)\n")


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_fails_at_once_naming_the_holder_and_the_lock_dies_with_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        started = time.monotonic()
        with pytest.raises(LockBusy, match=rf"{run_dir} is in use by pid {proc.pid} \(lock {lock_path(run_dir)}\)"):
            with run_lock(run_dir, "second"):
                pass
        assert time.monotonic() - started < 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with run_lock(run_dir, "third"):  # kill -9 leaves no stale lock
        assert lock_path(run_dir).read_text().split()[0] == str(os.getpid())


def test_held_locks_are_inherited_only_from_an_ancestor(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        # Variables naming a live holder that is not our ancestor (a stray copy in another shell): refused.
        monkeypatch.setenv(HOLDER_ENV, str(proc.pid))
        monkeypatch.setenv(HELD_ENV, str(lock_path(run_dir)))
        with pytest.raises(LockBusy):
            with run_lock(run_dir, "stray"):
                pass
        # A child of ours, told that we hold the lock, runs under it (we hold it for real here).
        monkeypatch.delenv(HOLDER_ENV)
        monkeypatch.delenv(HELD_ENV)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with run_lock(run_dir, "parent") as held:
        child = subprocess.run([sys.executable, "-c", "import sys; from common.locking import run_lock\n"
                                "with run_lock(sys.argv[1], 'child'): print('ok')", str(run_dir)],
                               cwd=ROOT, capture_output=True, text=True,
                               env=os.environ | inherit_env([held]))
        assert child.returncode == 0 and child.stdout.strip() == "ok", child.stderr
        alone = subprocess.run([sys.executable, "-c", "import sys; from common.locking import run_lock\n"
                                "with run_lock(sys.argv[1], 'child'): print('ok')", str(run_dir)],
                               cwd=ROOT, capture_output=True, text=True)
        assert alone.returncode != 0 and f"in use by pid {os.getpid()}" in alone.stderr


def test_an_unusable_run_dir_is_an_os_error_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError) as e:
        with run_lock(blocker / "run", "x"):
            pass
    assert str(blocker) in str(e.value)

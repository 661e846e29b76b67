"""Promotion under kills: ``promoted`` serves the old drafter or the new one after a kill before any
filesystem step of a promotion, and the next gate (``reconcile``, then promoting again) ends with the
history and ``promoted`` in agreement, with no temp left behind.

A kill is faithful here: the promotion runs in a forked child whose N-th filesystem call (open for write,
fsync, rename, replace, symlink, mkdir, unlink, chmod, rmtree, exchange) calls ``os._exit`` first, so no
``finally`` or ``except`` of ours runs, as with ``kill -9``.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import eval.gate as gate_mod
from drafter.sglang_checkpoint import fingerprint, save_checkpoint
from eval.gate import (
    FP_CHARS,
    append_history,
    promote,
    promotions_dir,
    read_history,
    reconcile,
    serving_id,
    serving_record,
)

KILLED = 77
FS_CALLS = [(os, "replace"), (os, "rename"), (os, "fsync"), (os, "symlink"), (os, "mkdir"), (os, "unlink"),
            (os, "rmdir"), (os, "chmod"), (shutil, "rmtree"), (gate_mod, "exchange")]


def _install_faults(kill_at: int, counter: list[int]) -> None:
    """Count filesystem calls; the ``kill_at``-th one exits the process before it runs (0: never)."""

    def step() -> None:
        counter[0] += 1
        if counter[0] == kill_at:
            os._exit(KILLED)

    def wrap(fn):
        def counted(*args, **kwargs):
            step()
            return fn(*args, **kwargs)
        return counted

    for mod, name in FS_CALLS:
        setattr(mod, name, wrap(getattr(mod, name)))
    real_open = builtins.open

    def open_(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            step()
        return real_open(file, mode, *args, **kwargs)

    builtins.open = open_


def _gate_promotes(ckpt: Path, fp: str, promoted: Path, history: Path) -> None:
    """What a promoting gate does to the filesystem: reconcile, then promote (the measuring is elsewhere)."""
    reconcile(promoted, history)
    promote(ckpt, fp, promoted, history, {"checkpoint": str(ckpt)})


def _run_killed(kill_at: int, *args) -> int:
    """Run ``_gate_promotes(*args)`` in a forked child killed at filesystem call ``kill_at``; its exit code."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            counter = [0]
            _install_faults(kill_at, counter)
            _gate_promotes(*args)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _count_calls(*args) -> int:
    pid = os.fork()
    if pid == 0:
        counter = [0]
        try:
            _install_faults(0, counter)
            _gate_promotes(*args)
        finally:
            os._exit(min(counter[0], 250))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _weights(promoted: Path) -> bytes | None:
    f = promoted / "model.safetensors"
    return f.read_bytes() if f.is_file() else None


def _agree(promoted: Path, history: Path) -> bool:
    rec = serving_record(history)
    want = rec["fingerprint"][:FP_CHARS] if rec and rec.get("fingerprint") else None
    return want == serving_id(promoted)


def _temps(*dirs: Path) -> list[str]:
    return [p.name for d in dirs if d.is_dir() for p in d.iterdir() if ".tmp" in p.name or ".old" in p.name]


@pytest.fixture
def drafters(tmp_path, tiny_drafter):
    old = save_checkpoint(tiny_drafter, tmp_path / "ckpts" / "old", dtype="float32")
    with torch.no_grad():
        tiny_drafter.fc.weight.add_(1.0)
    new = save_checkpoint(tiny_drafter, tmp_path / "ckpts" / "new", dtype="float32")
    (new / "training_state").mkdir()
    (new / "training_state" / "trainer.json").write_text("{}")
    return old, new


def _setup(root: Path, scenario: str, old: Path) -> tuple[Path, Path]:
    """A serving dir in the given state: nothing yet, our layout, or an older version's real directory."""
    promoted, history = root / "promoted", root / "promotions.jsonl"
    root.mkdir(parents=True)
    if scenario == "link":
        reconcile(promoted, history)
        promote(old, fingerprint(old), promoted, history, {"checkpoint": str(old)})
    elif scenario.startswith("legacy"):
        shutil.copytree(old, promoted)  # the legacy layout: a real directory at promoted
        with open(history, "w") as f:  # a legacy record: no "previous", no promotions/
            f.write(json.dumps({"decision": "promoted", "fingerprint": fingerprint(old), "time": "then"}) + "\n")
    return promoted, history


@pytest.mark.parametrize("scenario", ["fresh", "link", "legacy", "legacy-fallback"])
def test_kill_before_every_filesystem_step_leaves_old_or_new_and_a_rerun_agrees(tmp_path, drafters, scenario,
                                                                                monkeypatch):
    old, new = drafters
    if scenario == "legacy-fallback":  # a file system without renameat2's exchange: two renames instead
        monkeypatch.setattr(gate_mod, "exchange", lambda a, b: False)
    old_w, new_w, new_fp = (old / "model.safetensors").read_bytes(), (new / "model.safetensors").read_bytes(), \
        fingerprint(new)
    promoted, history = _setup(tmp_path / "dry", scenario, old)
    total = _count_calls(new, new_fp, promoted, history)
    assert 8 <= total < 250, total
    assert _weights(promoted) == new_w and _agree(promoted, history)
    for n in range(1, total + 2):  # total + 1: the kill never comes, the promotion completes
        root = tmp_path / f"kill-{n}"
        promoted, history = _setup(root, scenario, old)
        code = _run_killed(n, new, new_fp, promoted, history)
        assert code == (KILLED if n <= total else 0), (n, code)
        held = _weights(promoted)
        allowed = {new_w} | ({None} if scenario == "fresh" else {old_w})
        if scenario == "legacy-fallback":
            allowed.add(None)  # between its two renames; the next gate restores the link (below)
        assert held in allowed, f"kill before step {n}/{total}: promoted holds neither drafter"
        if held is None and scenario == "legacy-fallback":
            assert any(r.get("fingerprint") == new_fp for r in read_history(history)), n
        # The rerun: the next gate reconciles, then promotes the candidate unless it already serves.
        reconcile(promoted, history)
        assert _agree(promoted, history), f"kill before step {n}: history and promoted disagree after reconcile"
        if (serving_record(history) or {}).get("fingerprint") != new_fp:
            promote(new, new_fp, promoted, history, {"checkpoint": str(new)})
        assert _weights(promoted) == new_w and _agree(promoted, history), n
        assert serving_id(promoted) == new_fp[:FP_CHARS] and promoted.is_symlink()
        assert not _temps(root, promotions_dir(promoted)), (n, _temps(root, promotions_dir(promoted)))
        copy = promotions_dir(promoted) / new_fp[:FP_CHARS]
        assert sorted(p.name for p in copy.iterdir()) == ["config.json", "model.safetensors"]  # no training_state
        decisions = [r["decision"] for r in read_history(history)]
        assert decisions.count("promoted") - (scenario in ("link", "legacy", "legacy-fallback")) == 1, decisions
        if scenario.startswith("legacy"):  # the older version's copy is kept for a rollback
            assert (promotions_dir(promoted) / fingerprint(old)[:FP_CHARS]).is_dir()


def test_reconcile_records_a_drafter_nobody_recorded(tmp_path, drafters):
    old, _ = drafters
    promoted, history = tmp_path / "promoted", tmp_path / "promotions.jsonl"
    shutil.copytree(old, promoted)  # an older version promoted it; its history is gone
    notes = reconcile(promoted, history)
    assert notes and "which no promotion record names" in notes[0]
    rec = serving_record(history)
    assert rec["decision"] == "reconciled" and rec["fingerprint"] == fingerprint(old)
    assert reconcile(promoted, history) == []  # now they agree


def test_torn_history_tail_is_cut_before_the_next_record(tmp_path):
    history = tmp_path / "promotions.jsonl"
    append_history(history, {"decision": "rejected"})
    with open(history, "ab") as f:
        f.write(b'{"decision": "prom')  # a kill mid-append
    assert [r["decision"] for r in read_history(history)] == ["rejected"]
    append_history(history, {"decision": "passed"})
    assert [r["decision"] for r in read_history(history)] == ["rejected", "passed"]

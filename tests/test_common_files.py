"""The JSONL appender of long streams: every record readable at once, fsyncs bounded by time."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from common import files
from common.files import JsonlAppender


def test_records_are_flushed_at_once_and_synced_at_most_every_interval(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    monkeypatch.setattr(files.os, "fsync", lambda fd: synced.append(fd))
    now = [0.0]
    path = tmp_path / "out.jsonl"
    with open(path, "ab") as f:
        out = JsonlAppender(f, sync_every_s=1.0, clock=lambda: now[0])
        for i in range(5):  # five records inside one second: each readable at once, none synced yet
            out.append({"id": i, "text": "a\nb"})
            assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == list(range(i + 1))
            now[0] += 0.1
        assert synced == []
        now[0] = 1.0
        out.append({"id": 5})  # a second since the last sync: this one syncs
        assert synced == [f.fileno()]
        out.append({"id": 6})
        out.sync()  # the end of the run syncs what is left ...
        out.sync()  # ... once
        assert synced == [f.fileno()] * 2
    assert len(path.read_text().splitlines()) == 7


def test_a_real_fsync_runs(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    with open(path, "ab") as f:
        out = JsonlAppender(f, sync_every_s=0.0)
        out.append({"id": 1})
        assert out.unsynced == 0 and os.path.getsize(path) > 0

"""The file helpers: the JSONL appender of long streams (every record readable at once, fsyncs bounded by time),
errors on a full disk that name their file and leave no temp behind, strict JSON for machines."""

from __future__ import annotations

import builtins
import errno
import json
import os
from pathlib import Path

import pytest

from common import files
from common.cli import one_line_errors
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


class _FullDisk:
    """A file whose writes fail as on a full disk: the kernel's ENOSPC names no file."""

    def __init__(self, f):
        self.f = f

    def write(self, _data) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name: str):
        return getattr(self.f, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *_exc) -> None:
        self.f.close()


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(files, "open", lambda *a, **k: _FullDisk(builtins.open(*a, **k)), raising=False)


def test_a_full_disk_names_the_file_and_leaves_no_temp_file(tmp_path: Path, full_disk: None, capsys) -> None:
    """The error line names the file (never ``?``), and the half-written temp file is gone: on a full disk it
    would hold the very space the rerun needs."""
    path = tmp_path / "store" / "target_head.safetensors"

    @one_line_errors()
    def command() -> int:
        files.write_bytes_atomic(path, b"x" * 1000)
        return 0

    assert command() == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {path}: no space left on the device: free some, or point run_dir at a bigger disk "
        "(--set run_dir=/big/disk/run), then rerun (stages resume)"]
    assert os.listdir(path.parent) == []


def test_a_full_disk_during_an_append_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "promotions.jsonl"
    with open(path, "ab") as f:
        with pytest.raises(OSError) as e:
            files.append_jsonl(_FullDisk(f), {"decision": "rejected"})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_machine_json_holds_null_for_a_non_finite_float(tmp_path: Path, value: float) -> None:
    """json.dumps writes bare NaN and Infinity, which strict readers (jq, JSON.parse) reject."""
    record = {"alpha": {"mtbench": [0.5, value]}, "tau": (value, 2.0)}
    text = files.json_line(record)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=pytest.fail) == {"alpha": {"mtbench": [0.5, None]}, "tau": [None, 2.0]}
    files.write_json_atomic(tmp_path / "m.json", record)
    assert json.loads((tmp_path / "m.json").read_text(), parse_constant=pytest.fail)["tau"] == [None, 2.0]


class _Damaged(Exception):
    pass


@pytest.mark.parametrize(("line", "problem"), [
    (b'{"id": "caf\xe9"}', "invalid UTF-8 at byte 11 of the line"),
    (b'{"id": "c2", "mess', "not JSON (Unterminated string starting at)"),
    (b'["c2"]', "a JSON list, not an object"),
])
def test_a_bad_jsonl_line_is_one_line_naming_file_and_line(tmp_path: Path, line: bytes, problem: str) -> None:
    """Blank lines are skipped but counted, so the number is the line an editor shows."""
    path = tmp_path / "records.jsonl"
    path.write_bytes(b'{"id": "c0"}\n\n' + line + b"\n")
    with pytest.raises(_Damaged) as e:
        list(files.iter_jsonl(path, _Damaged, fix="rerun it"))
    assert str(e.value) == f"{path}:3: {problem}; rerun it"


def test_jsonl_records_come_with_their_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    files.write_jsonl_atomic(path, [{"id": "a\u2028b"}, {"id": "c"}])  # a line break str.splitlines() would split
    with open(path, "ab") as f:
        f.write(b"\n")
        files.append_jsonl(f, {"id": "d"})
    assert list(files.iter_jsonl(path)) == [(1, {"id": "a\u2028b"}), (2, {"id": "c"}), (4, {"id": "d"})]
    path.write_bytes(b'{"id": "e"}\n{"id": "f"')  # a torn tail is an error unless cut first
    with pytest.raises(ValueError, match=r":2: not JSON \("):
        list(files.iter_jsonl(path))
    files.cut_torn_tail(path)
    assert list(files.iter_jsonl(path)) == [(1, {"id": "e"})]

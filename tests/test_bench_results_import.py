"""bench/results.py import: objects measured on another machine come into results.json whole, or not at all."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.results import import_objects

ROOT = Path(__file__).resolve().parents[1]


def _obj(date: str, tau: float) -> dict:
    return {"command": "python bench/x.py", "device": "NVIDIA H200", "date": date, "tau": tau}


def test_named_objects_are_copied_unchanged_and_the_others_stay(tmp_path: Path) -> None:
    src, dst = tmp_path / "device.json", tmp_path / "results.json"
    src.write_text(json.dumps({"a": _obj("2030-01-02", 2.5), "b": _obj("2030-01-02", 9.0)}))
    dst.write_text(json.dumps({"a": _obj("2030-01-01", 2.0), "c": _obj("2030-01-01", 1.0)}))
    lines = import_objects(src, ["a"], dst)
    data = json.loads(dst.read_text())
    assert data == {"a": _obj("2030-01-02", 2.5), "c": _obj("2030-01-01", 1.0)}
    assert lines == ["a: replaced (was 2030-01-01, now 2030-01-02)"]
    assert import_objects(src, ["b"], dst) == ["b: added (2030-01-02)"]


@pytest.mark.parametrize("source, match", [({"a": _obj("2030-01-02", 1.0)}, r"no object 'zz' \(it holds: a\)"),
                                           ({"zz": {"tau": 1.0}}, "'zz' lacks command, device, date")])
def test_a_missing_or_unprovenanced_object_is_an_error_and_nothing_is_written(tmp_path: Path, source, match) -> None:
    src, dst = tmp_path / "device.json", tmp_path / "results.json"
    src.write_text(json.dumps(source))
    dst.write_text(json.dumps({"a": _obj("2030-01-01", 2.0)}))
    before = dst.read_text()
    with pytest.raises(ValueError, match=match):
        import_objects(src, ["a", "zz"] if "a" in source else ["zz"], dst)
    assert dst.read_text() == before


@pytest.mark.parametrize("text, after_path", [
    ("{}", ": no object 'zz' (it holds: none)"),
    ('{"a": 1,', ":1: invalid JSON (Expecting property name enclosed in double quotes); name the results file a "
                 "benchmark wrote")])
def test_the_command_line_names_the_bad_file_or_object_in_one_line(tmp_path: Path, text: str, after_path: str) -> None:
    src = tmp_path / "device.json"
    src.write_text(text)
    env = {"BENCH_RESULTS": str(tmp_path / "results.json"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "bench/results.py"), "import", str(src), "zz"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [f"error: {src}{after_path}"]
    assert not (tmp_path / "results.json").exists()

"""File helpers every stage writes through, so that a kill at any point leaves a file a resuming job can
trust: atomic writes (a reader sees the old file or directory or the new one, never a torn mix), the
durable JSONL append (a kill leaves at most a torn last line), one temp-file naming scheme, checksums.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import IO, Any

# Legal in JSON strings but line breaks to str.splitlines() and some editors: escape them.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def temp_path(path: Path, tag: str = "tmp", shared: bool = False) -> Path:
    """The one temp name: a hidden sibling ``.{name}.{tag}-{pid}``, renamed into place when complete.
    ``shared`` drops the pid, for a directory that every process of one run builds together (a training
    checkpoint: each rank saves its own part of the state into it)."""
    return path.with_name(f".{path.name}.{tag}" + ("" if shared else f"-{os.getpid()}"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file beside ``path``, fsync, rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: Path, obj: Any) -> None:
    """Indented, sorted keys: the same object always gives the same bytes (a resumed capture's manifest
    is byte-identical to an uninterrupted one's)."""
    write_bytes_atomic(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def json_line(record: dict[str, Any], sort_keys: bool = False) -> str:
    """One JSONL line (UTF-8 text kept readable) that every line splitter sees as exactly one line."""
    return json.dumps(record, ensure_ascii=False, sort_keys=sort_keys).translate(_LINE_BREAKS) + "\n"


def write_jsonl_atomic(path: Path, records: list[dict[str, Any]]) -> None:
    write_text_atomic(path, "".join(json_line(r) for r in records))


def append_jsonl(f: IO[bytes], record: dict[str, Any], sort_keys: bool = False) -> None:
    """Append ``record`` as one whole line and put it on disk before returning (``f`` is opened "ab"):
    a kill leaves at most a torn last line, which readers drop, never a lost or half-written record
    before it."""
    f.write(json_line(record, sort_keys).encode("utf-8"))
    f.flush()
    os.fsync(f.fileno())


def fresh_tmp_dir(dst: Path) -> Path:
    """An empty temp directory beside ``dst`` to build its replacement in."""
    tmp = temp_path(dst)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def swap_dir(tmp: Path, dst: Path) -> None:
    """Move the finished ``tmp`` into place as ``dst``, replacing any old ``dst``."""
    old = temp_path(dst, tag="old")
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()

"""Atomic writes: a reader (a resuming job, a server loading a drafter) sees the old file or directory
or the new one, never a torn mix. Every stage writes through these."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file beside ``path``, fsync, rename over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def fresh_tmp_dir(dst: Path) -> Path:
    """An empty temp directory beside ``dst`` to build its replacement in."""
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def swap_dir(tmp: Path, dst: Path) -> None:
    """Move the finished ``tmp`` into place as ``dst``, replacing any old ``dst``."""
    old = dst.parent / f".{dst.name}.old-{os.getpid()}"
    if dst.exists():
        os.replace(dst, old)
    os.replace(tmp, dst)
    shutil.rmtree(old, ignore_errors=True)

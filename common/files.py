"""File helpers every stage writes through, so that a kill at any point leaves a file a resuming job can
trust: atomic writes (a reader sees the old file or directory or the new one, never a torn mix), the
durable JSONL append (a kill leaves at most a torn last line), one temp-file naming scheme, checksums.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

# Legal in JSON strings but line breaks to str.splitlines() and some editors: escape them.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


# Every name temp_path makes (tags "tmp" and "old", with or without a pid), and nothing else.
_TEMP_NAME = re.compile(r"^\..+\.(tmp|old)(-\d+)?$")


def temp_path(path: Path, tag: str = "tmp", shared: bool = False) -> Path:
    """The one temp name: a hidden sibling ``.{name}.{tag}-{pid}``, renamed into place when complete.
    ``shared`` drops the pid, for a directory that every process of one run builds together (a training
    checkpoint: each rank saves its own part of the state into it)."""
    return path.with_name(f".{path.name}.{tag}" + ("" if shared else f"-{os.getpid()}"))


def remove_temps(directory: Path, of: str | None = None) -> list[Path]:
    """Delete what killed writers left in ``directory`` (files, links or dirs named by ``temp_path``; only
    those of ``of`` when given). Call it holding the lock of whoever writes there (``common.locking``): a
    live writer's temp would go too."""
    removed = []
    for p in sorted(directory.iterdir()) if directory.is_dir() else []:
        if _TEMP_NAME.match(p.name) and (of is None or p.name.startswith(f".{of}.")):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p)
    return removed


@contextmanager
def named_errors(path: str | Path) -> Iterator[None]:
    """An OSError raised inside without a file name gets ``path``: a write, flush or fsync that fails (a full disk)
    names no file, and its error line (``common.cli.os_error_line``) must say which one it was."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def fsync_dir(directory: Path) -> None:
    """Put a directory's entries (a rename, a new file) on disk: a file's own fsync does not."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with named_errors(directory):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write to a temp file beside ``path``, fsync, rename over it. A failed write (a full disk) removes its temp
    file, which would otherwise hold the space a rerun needs, and names ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with named_errors(path), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def json_safe(x: Any) -> Any:
    """``x`` with every NaN or inf float replaced by None (tuples become lists, as JSON has them)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def json_text(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` for everything the project writes for machines: a NaN or inf (an alpha of a dataset without
    cycles, a mean over nothing) becomes null, since strict readers (jq, JSON.parse) reject the bare ``NaN`` and
    ``Infinity`` that json.dumps writes. The common, finite case costs one dumps."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        return json.dumps(json_safe(obj), allow_nan=False, **kwargs)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Sorted keys: the same object always gives the same bytes (a resumed capture's manifest is byte-identical
    to an uninterrupted one's)."""
    write_bytes_atomic(path, (json_text(obj, indent=1, sort_keys=True) + "\n").encode())


def read_json_object(path: Path, fix: str, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object a stage wrote to ``path``. One that is unreadable, not UTF-8, not JSON or not an object
    raises ``error`` naming the file (and the line) and ending in ``fix``, what to do: json's own messages name no
    file."""
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte {e.start}); {fix}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}:{e.lineno}: invalid JSON ({e.msg}); {fix}") from None
    except OSError as e:
        raise error(f"{path}: unreadable ({e.strerror}); {fix}") from None
    if not isinstance(obj, dict):
        raise error(f"{path}: a JSON {type(obj).__name__}, not an object; {fix}")
    return obj


def iter_jsonl(path: Path, error: type[Exception] = ValueError, fix: str = "") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of the JSONL file ``path``, the one reader of the JSONL files the
    stages pass on: a line that is not UTF-8, not JSON or not an object raises ``error`` as one line naming the file
    and line and ending in ``fix``, what to do (json's own messages name neither). A torn last line is an error too:
    a reader of a file a killed append may have left calls ``cut_torn_tail`` first."""
    end = f"; {fix}" if fix else ""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                # Without its newline, a cut string reads "Unterminated string", not "Invalid control character".
                obj = json.loads(raw.rstrip(b"\r\n").decode("utf-8"))
            except UnicodeDecodeError as e:
                raise error(f"{path}:{n}: invalid UTF-8 at byte {e.start} of the line{end}") from None
            except json.JSONDecodeError as e:
                raise error(f"{path}:{n}: not JSON ({e.msg}){end}") from None
            if not isinstance(obj, dict):
                raise error(f"{path}:{n}: a JSON {type(obj).__name__}, not an object{end}")
            yield n, obj


def json_line(record: dict[str, Any], sort_keys: bool = False) -> str:
    """One JSONL line (UTF-8 text kept readable) that every line splitter sees as exactly one line."""
    return json_text(record, ensure_ascii=False, sort_keys=sort_keys).translate(_LINE_BREAKS) + "\n"


def write_jsonl_atomic(path: Path, records: list[dict[str, Any]]) -> None:
    write_text_atomic(path, "".join(json_line(r) for r in records))


def append_jsonl(f: IO[bytes], record: dict[str, Any], sort_keys: bool = False) -> None:
    """Append ``record`` as one whole line and put it on disk before returning (``f`` is opened "ab"):
    a kill leaves at most a torn last line, which readers drop, never a lost or half-written record
    before it."""
    with named_errors(f.name):
        _append_line(f, record, sort_keys)
        os.fsync(f.fileno())


class JsonlAppender:
    """Whole JSONL lines appended to ``f`` (opened "ab") for a stream of many records: each is flushed at once, so a
    killed process loses none and leaves at most a torn last line (the page cache outlives the process); the file
    is fsynced at most every ``sync_every_s`` seconds and at ``sync()``, so a machine that dies loses at most that
    window's records, which a resumed run redoes. An fsync per record (``append_jsonl``) cost regeneration ~0.5 ms
    a conversation, on the thread that feeds the GPU."""

    def __init__(self, f: IO[bytes], sync_every_s: float = 1.0, clock: Any = time.monotonic):
        self.f, self.every, self.clock = f, sync_every_s, clock
        self.last_sync = clock()
        self.unsynced = 0
        self.seconds = 0.0  # spent appending and syncing (what the writer's thread waited)

    def append(self, record: dict[str, Any], sort_keys: bool = False) -> None:
        start = time.perf_counter()
        with named_errors(self.f.name):
            _append_line(self.f, record, sort_keys)
        self.unsynced += 1
        if self.clock() - self.last_sync >= self.every:
            self.sync()
        self.seconds += time.perf_counter() - start

    def sync(self) -> None:
        if self.unsynced:
            with named_errors(self.f.name):
                os.fsync(self.f.fileno())
            self.unsynced = 0
        self.last_sync = self.clock()


def _append_line(f: IO[bytes], record: dict[str, Any], sort_keys: bool) -> None:
    f.write(json_line(record, sort_keys).encode("utf-8"))
    f.flush()


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


def copy_file_durable(src: Path, dst: Path) -> None:
    """Copy bytes and fsync them (a plain copy may sit in the page cache when the machine dies)."""
    with named_errors(dst), open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 22)
        fout.flush()
        os.fsync(fout.fileno())


def replace_symlink(link: Path, target: str) -> None:
    """Point ``link`` at ``target`` with one rename of a temp link over it: a reader sees the old target or
    the new one, never no link. ``link`` may not be a real directory (see ``exchange``)."""
    tmp = temp_path(link)
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    fsync_dir(link.parent)


_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux renameat2 RENAME_EXCHANGE): the only atomic way to replace a real
    directory by a symlink. False where the kernel, libc or file system cannot; the caller falls back."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def cut_torn_tail(path: Path) -> int:
    """Truncate a JSONL file after its last newline (what a kill during an append leaves); returns the bytes
    cut. An append after a torn tail would otherwise glue the new record onto the torn one."""
    if not path.exists():
        return 0
    with named_errors(path), open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return len(data) - keep


def sha256_json(value: Any) -> str:
    """sha256 of a JSON value with its keys sorted: the same value names the same thing across runs (store keys,
    the gate's families of tries)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def sha256_file(*paths: str | Path) -> str:
    """sha256 of the files' bytes in turn, read in blocks (a shard or checkpoint may not fit in memory);
    several paths give one digest over them all (a checkpoint's weight files)."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()

"""One writer per run dir: an ``flock`` on ``run_dir/.lock`` held by every stage and by the pipeline.

A second writer fails at once with a one-line error naming the holder's pid (written into the lock file),
rather than appending duplicate lines beside the first. The kernel drops the lock when its holder dies,
even by ``kill -9``, so there is no stale lock to clear by hand.

The pipeline holds the locks of the dirs its stages write and starts each stage with two environment
variables: ``EAGLE3_LOCK_HOLDER`` (its pid) and ``EAGLE3_HELD_LOCKS`` (the lock files). A stage whose lock is
among them, and whose holder is one of its ancestors (the pipeline, possibly through ``accelerate launch``),
runs under the pipeline's lock instead of taking its own, and so cannot deadlock on it; it also arranges to
die with its parent (``common.parent_death``), because the lock it relies on dies with the pipeline. A stray
copy of the variables in another shell does not match: its holder is no ancestor there.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from common import parent_death
from common.files import named_errors

LOCK_NAME = ".lock"
HOLDER_ENV = "EAGLE3_LOCK_HOLDER"
HELD_ENV = "EAGLE3_HELD_LOCKS"


class LockBusy(ValueError):
    """Another live process writes the same dir; the message names its pid."""


def lock_path(directory: str | Path) -> Path:
    return Path(directory).absolute() / LOCK_NAME


def _ancestors() -> set[int]:
    """Pids of this process's parent, grandparent, ... (from /proc; empty where there is none)."""
    found, pid = set(), os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return found


def held_by_ancestor(path: Path) -> bool:
    held = os.environ.get(HELD_ENV, "").split(os.pathsep)
    try:
        holder = int(os.environ.get(HOLDER_ENV, ""))
    except ValueError:
        return False
    return str(path) in held and holder in _ancestors()


def inherit_env(paths: Sequence[Path]) -> dict[str, str]:
    """What a holder passes to the stages it starts, so that they run under its locks."""
    return {HOLDER_ENV: str(os.getpid()), HELD_ENV: os.pathsep.join(str(p) for p in paths)}


def _holder_pid(path: Path) -> str:
    try:
        return path.read_text().split()[0]
    except (OSError, IndexError):
        return "unknown"


@contextmanager
def run_lock(directory: str | Path, what: str, main_process: bool = True) -> Iterator[Path]:
    """Hold ``directory``'s lock for the block; ``what`` names the writer in the holder's message.
    ``main_process`` False (the other ranks of one ``accelerate launch``): rank 0 holds it for all of them.
    Creates ``directory``; an unwritable one is an OSError naming it."""
    path = lock_path(directory)
    if held_by_ancestor(path):
        parent_death.die_with_parent()
        yield path
        return
    if not main_process:
        yield path
        return
    path.parent.mkdir(parents=True, exist_ok=True)

    def refuse() -> None:
        raise LockBusy(f"{path.parent} is in use by pid {_holder_pid(path)} (lock {path}); wait for it to "
                       f"finish or stop it, then rerun (every stage resumes)") from None

    with flock(path, busy=refuse) as fd:
        with named_errors(path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {what}\n".encode())
        yield path


@contextmanager
def flock(path: Path, busy: Callable[[], None] | None = None) -> Iterator[int]:
    """Hold an exclusive ``flock`` on ``path`` (created) for the block; yields its fd. When another process
    holds it, ``busy`` runs first: it raises to refuse (a run dir) or says why this one waits (a shared cache);
    then the lock is waited for. The kernel drops it when the holder dies, even by ``kill -9``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if busy is not None:
                busy()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing drops the flock

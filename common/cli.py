"""Exit codes and error lines shared by every command: 0 done (or promoted), 1 rejected by the gate,
2 an error. Python exits 1 on an uncaught exception, which a caller would read as "rejected"; so every
entry point goes through ``one_line_errors`` and a crash is 2 like any other error.

Our own errors are ``ValueError`` subclasses whose message is ready to show; an ``OSError`` (no permission,
a read-only or full disk) becomes one line naming the file and the fix; anything else is a bug: its
traceback is printed, then the same one-line error, exit 2 (so is an OSError that names no file).
"""

from __future__ import annotations

import errno
import faulthandler
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import ParamSpec

EXIT_OK, EXIT_REJECTED, EXIT_ERROR = 0, 1, 2
P = ParamSpec("P")

_OS_HINTS = {
    errno.ENOSPC: "no space left on the device: free some, or point run_dir at a bigger disk "
                  "(--set run_dir=/big/disk/run), then rerun (stages resume)",
    errno.EDQUOT: "disk quota exceeded: free some space, then rerun (stages resume)",
    errno.EROFS: "read-only file system: point run_dir somewhere writable (--set run_dir=...)",
    errno.EACCES: "permission denied: make it writable or point run_dir elsewhere (--set run_dir=...)",
    errno.EPERM: "operation not permitted: make it writable or point run_dir elsewhere (--set run_dir=...)",
    errno.ENOENT: "no such file or directory",
    errno.ENOTDIR: "a path component is not a directory",
}


# What a child killed by a signal most likely met. A negative return code is all the parent learns, and
# "exited early (-4)" names neither the signal nor the fix.
SIGNAL_CAUSES = {
    signal.SIGILL: "an instruction this CPU does not allow (a native library built for another CPU)",
    signal.SIGKILL: "killed from outside: by hand, or by the kernel's out-of-memory killer (`dmesg` says which)",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a bus error (a memory-mapped file truncated under it, or a full /dev/shm)",
    signal.SIGABRT: "aborted by native code (a failed assertion)",
    signal.SIGTERM: "asked to stop",
}
# llama.cpp compiles with -march=native by default: on a VM that reports AVX-512/AMX it cannot run, the server
# dies with SIGILL on its first completion.
LLAMA_CPP_CAUSES = {
    signal.SIGILL: "the llama.cpp build uses CPU instructions this machine does not allow; rebuild llama-cpp-python "
                   "with CMAKE_ARGS=-DGGML_NATIVE=OFF (make setup does)",
}


def exit_reason(returncode: int, causes: Mapping[int, str] | None = None) -> str:
    """How a child process ended, for people: ``exit 3``, or ``killed by SIGILL (signal 4): <likely cause>``
    (``causes`` first, for what the child runs, then ``SIGNAL_CAUSES``)."""
    if returncode >= 0:
        return f"exit {returncode}"
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        return f"killed by signal {number}"
    cause = {**SIGNAL_CAUSES, **(causes or {})}.get(number)
    return f"killed by {name} (signal {number})" + (f": {cause}" if cause else "")


def os_error_line(e: OSError) -> str:
    """``path: what happened; what to do`` for an OSError. Our writers name their file in every OSError
    (``common.files.named_errors``); one that still names none is a writer that forgot, so the line points at the
    traceback ``one_line_errors`` prints before it."""
    what = _OS_HINTS.get(e.errno or 0, e.strerror or str(e))
    if e.filename is None:
        return f"{what} (no file named: the traceback above says where)"
    where = str(e.filename) if e.filename2 is None else f"{e.filename} -> {e.filename2}"
    return f"{where}: {what}"


def stacks_on_signal(signum: int = signal.SIGUSR1) -> None:
    """Print every thread's Python stack to stderr when ``signum`` arrives, and go on: what a watchdog
    (``bench.runs.run``'s silence limit) sends a run it is about to kill, so a hang leaves its location."""
    faulthandler.register(signum, file=sys.stderr, all_threads=True)


class StopRequest:
    """Whether SIGTERM arrived. A long loop reads it at a point where stopping loses nothing (after a step,
    before the next), saves and returns, instead of dying mid-step: a cut call (``timeout``, a scheduler's
    preemption) then costs no work, where a kill costs everything since the last periodic save. If the process
    is still alive ``stacks_after`` seconds later (stuck on the way out), every thread's stack goes to stderr:
    ``timeout``'s SIGKILL follows, and the log then says where it was."""

    def __init__(self, stacks_after: float = 10.0) -> None:
        self.signum: int | None = None
        self.stacks_after = stacks_after

    def __bool__(self) -> bool:
        return self.signum is not None

    def set(self, signum: int, _frame: object = None) -> None:
        if self.signum is None:
            faulthandler.dump_traceback_later(self.stacks_after, exit=False, file=sys.stderr)
        self.signum = signum


@contextmanager
def stop_on_sigterm() -> Iterator[StopRequest]:
    """SIGTERM sets the yielded request instead of ending the process; the old handler is back on exit.
    Must run in the main thread (Python only delivers signals there)."""
    request = StopRequest()
    old = signal.signal(signal.SIGTERM, request.set)
    try:
        yield request
    finally:
        signal.signal(signal.SIGTERM, old)
        faulthandler.cancel_dump_traceback_later()


def own_process_group(*_: object) -> None:
    """For helper processes (data loader workers): ``timeout`` and a terminal's Ctrl-C signal the whole process
    group, and a helper that died of it would break its parent's orderly stop (finish the step, save). In a group
    of its own the helper misses those, yet still dies of a signal sent to it alone. Ignoring SIGTERM instead
    would hang the parent's exit whenever a loader iterator is still open then: multiprocessing ends daemonic
    helpers at exit with SIGTERM and waits for them. A helper whose parent was killed ends itself (torch's
    watchdog)."""
    os.setpgrp()


def exception_line(e: BaseException) -> str:
    """Any exception in one line of at most 200 characters, with its type: for a fallback's warning and a run's
    stats, where the exception is not ours (a kernel that did not build), unlike ``error_line``'s."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def trace_unnamed(e: BaseException) -> None:
    """In an except block, before ``error_line(e)``: the traceback of an OSError that names no file, which its
    error line then points at (the only place that says where it happened)."""
    if isinstance(e, OSError) and not isinstance(e, ValueError) and e.filename is None:
        traceback.print_exc()


def error_line(e: BaseException) -> str:
    if isinstance(e, OSError) and not isinstance(e, ValueError):
        return os_error_line(e)
    return str(e)


def one_line_errors(*ours: type[Exception], prefix: str = "error") -> Callable[[Callable[P, int]], Callable[P, int]]:
    """Wrap a command returning its exit code: every exception becomes ``{prefix}: message`` on stderr and
    exit 2, with the traceback first when it is a bug (not a ValueError, an OSError or one of ``ours``)."""

    def wrap(command: Callable[P, int]) -> Callable[P, int]:
        @functools.wraps(command)
        def run(*args: P.args, **kwargs: P.kwargs) -> int:
            try:
                return command(*args, **kwargs)
            except (ValueError, OSError, *ours) as e:
                trace_unnamed(e)
                message = error_line(e)
            except Exception as e:  # a bug: show where, and still exit as an error, not as "rejected"
                traceback.print_exc()
                message = f"unexpected {type(e).__name__}: {e} (the traceback above says where)"
            # Printed once the exception is gone: the frames it held are freed first, so a progress bar
            # they own closes before this line, which stays the last one.
            print(f"{prefix}: {message}", file=sys.stderr)
            return EXIT_ERROR

        return run

    return wrap

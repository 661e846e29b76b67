"""Where a long run spends its host time, from samples of its main thread's stack (nothing traced, nothing slowed).

A profiler that traces every call (cProfile) doubles the cost of Python-heavy code and so misreports the very
bookkeeping it is asked about; the regeneration engine's host work is such code. Here a daemon thread reads the main
thread's stack every ``interval_s`` (``sys._current_frames``) and credits the time since its last sample to the
innermost frame (``own``: file:line function) and to every function on the stack once (``inclusive``). Credited by
time, not counted: the sampler needs the GIL, so while the main thread runs Python it wakes only at the
interpreter's switch interval (5 ms), and a count would under-weigh exactly that work against waits that release the
GIL. While the main thread waits in C with the GIL released (a CUDA synchronisation, a tokenizer), the samples name
the Python line that waits. Shares are of the sampled time.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

MAX_DEPTH = 96  # frames walked per sample: deeper ones (recursion) add nothing to a summary


def _where(frame: FrameType, line: bool) -> str:
    code = frame.f_code
    name = os.sep.join(Path(code.co_filename).parts[-2:])  # package/module.py: enough to find it, short to read
    return f"{name}:{frame.f_lineno} {code.co_name}" if line else f"{name} {code.co_name}"


class StackSampler:
    """``with StackSampler() as s: ...`` samples the thread that entered it; ``s.summary()`` after."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.own: Counter[str] = Counter()  # seconds credited
        self.inclusive: Counter[str] = Counter()
        self.samples = 0
        self.seconds = 0.0
        self._target = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StackSampler:
        self._target = threading.get_ident()
        self._stop.clear()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.seconds = time.perf_counter() - self._start

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._target)  # noqa: SLF001 (the documented way to read a stack)
            now = time.perf_counter()
            credit, last = now - last, now
            if frame is None:
                continue
            self.samples += 1
            self.own[_where(frame, line=True)] += credit
            seen = set()
            depth = 0
            f: FrameType | None = frame
            while f is not None and depth < MAX_DEPTH:
                seen.add(_where(f, line=False))
                f, depth = f.f_back, depth + 1
            for where in seen:
                self.inclusive[where] += credit

    def summary(self, top: int = 25) -> dict[str, Any]:
        """The ``top`` lines by own time and functions by inclusive time, as shares of the sampled time."""
        total = sum(self.own.values()) or 1.0

        def ranked(credits: Counter[str]) -> list[dict[str, Any]]:
            return [{"where": w, "share": round(c / total, 4)} for w, c in credits.most_common(top)]

        return {"samples": self.samples, "interval_s": self.interval_s, "seconds": round(self.seconds, 2),
                "own": ranked(self.own), "inclusive": ranked(self.inclusive)}

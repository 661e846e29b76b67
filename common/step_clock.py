"""Marks in a step on the device's clock: one home for the benchmarks that time steps or their phases, and for the
training loop's split of its steps (the target's forward, the drafter's).

CUDA events on CUDA (read after one synchronisation, when the spans are asked for), the wall clock elsewhere,
where the work has finished when a call returns.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    """``mark()`` between the parts of a step; ``spans_ms()``: the ms between consecutive marks."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def spans_ms(self) -> list[float]:
        if self.cuda:
            if self.marks:
                self.marks[-1].synchronize()  # the marks only: work queued after them may still run
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]

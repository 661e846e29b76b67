"""The online target's forward queued one micro-batch ahead of the step's one wait.

A step ends in a wait: the host reads the window's loss and gradient norm from the device, then steps the optimizer.
Until then the device drains its queue and idles; the next micro-batch's target forward, launched after the wait,
then ran at the pace of its host-side launches (HF's eager forward costs about as much host time as device time).
Queued before the wait, it runs on the device while the host waits and steps, and its launches hide behind the
drafter's backward still running (issue #20: the loop against the bench). The batch it completes is the same one,
so losses, resume points and the data order do not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from common.step_clock import StepClock
from train.data import to_device

Completed = tuple[int, dict[str, Any], dict[str, Tensor]]  # (batch index, the loader's batch, the model's inputs)


class TargetAhead:
    """``take(clock)``: the next micro-batch with its target forward queued (now, unless ``queue`` did it before);
    ``queue(clock)``: queue the next one's forward now. Each forward is marked on ``clock`` (before, after)."""

    def __init__(self, loader: Iterable[dict[str, Any]], complete: Callable[[dict[str, Tensor]], dict[str, Tensor]],
                 device: torch.device, start: int):
        self._batches = enumerate(loader, start=start)
        self._complete, self._device = complete, device
        self._queued: Completed | None = None
        self._exhausted = False

    def queue(self, clock: StepClock) -> None:
        if self._queued is not None or self._exhausted:
            return
        item = next(self._batches, None)
        if item is None:
            self._exhausted = True
            return
        k, raw = item
        moved = to_device(raw, self._device)
        clock.mark()
        batch = self._complete(moved)
        clock.mark()
        self._queued = (k, raw, batch)

    def take(self, clock: StepClock) -> Completed | None:
        """None when the loader is done."""
        self.queue(clock)
        out, self._queued = self._queued, None
        return out

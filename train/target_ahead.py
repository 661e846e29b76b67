"""The online target's forward queued one micro-batch ahead of the step's one wait.

A step ends in a wait: the host reads the window's loss and gradient norm from the device, then steps the optimizer.
Until then the device drains its queue and idles; the next micro-batch's target forward, launched after the wait,
then ran at the pace of its host-side launches (HF's eager forward costs about as much host time as device time).
Queued before the wait, it runs on the device while the host waits and steps, and its launches hide behind the
drafter's backward still running. The batch it completes is the same one,
so losses, resume points and the data order do not change.

On CUDA the forward runs on a stream of its own, so its kernels (small at a drafter's batch: the target's norms,
rotary and activations are a few tens of microseconds each) share the device with the drafter's backward and the
optimizer instead of queueing behind them. The drafter's stream waits for the forward's event before it reads the
batch, and each tensor handed over is marked as used there (``record_stream``) so that its memory is not reused by
the forward's stream while the drafter still reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from common.step_clock import StepClock
from train.data import to_device

Completed = tuple[int, dict[str, Any], dict[str, Tensor]]  # (batch index, the loader's batch, the model's inputs)
_Queued = tuple[int, dict[str, Any], dict[str, Tensor], torch.cuda.Event | None]  # ... and when it is ready (CUDA)


class TargetAhead:
    """``take(clock)``: the next micro-batch with its target forward queued (now, unless ``queue`` did it before);
    ``queue(clock)``: queue the next one's forward now. Each forward is marked on ``clock`` (before, after)."""

    def __init__(self, loader: Iterable[dict[str, Any]], complete: Callable[[dict[str, Tensor]], dict[str, Tensor]],
                 device: torch.device, start: int):
        self._batches = enumerate(loader, start=start)
        self._complete, self._device = complete, device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queued: _Queued | None = None
        self._exhausted = False

    def queue(self, clock: StepClock) -> None:
        if self._queued is not None or self._exhausted:
            return
        item = next(self._batches, None)
        if item is None:
            self._exhausted = True
            return
        k, raw = item
        if self._side is None:
            self._queued = (k, raw, self._completed(raw, clock), None)
            return
        with torch.cuda.stream(self._side):  # the copies in (from pinned memory) and the forward, on the side stream
            batch = self._completed(raw, clock)
            ready = torch.cuda.Event()
            ready.record()
        self._queued = (k, raw, batch, ready)

    def take(self, clock: StepClock) -> Completed | None:
        """None when the loader is done. On CUDA the current stream waits for the batch from here on."""
        self.queue(clock)
        queued, self._queued = self._queued, None
        if queued is None:
            return None
        k, raw, batch, ready = queued
        if ready is not None:
            here = torch.cuda.current_stream(self._device)
            here.wait_event(ready)
            for t in batch.values():
                if isinstance(t, Tensor) and t.is_cuda:
                    t.record_stream(here)
        return k, raw, batch

    def _completed(self, raw: dict[str, Any], clock: StepClock) -> dict[str, Tensor]:
        moved = to_device(raw, self._device)
        clock.mark()
        batch = self._complete(moved)
        clock.mark()
        return batch

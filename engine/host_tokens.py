"""Answer tokens on their way from the device to the host: a decode step's (``Launched``, ``HostTokens``) and a
prefill's first ones (``Firsts``). The stream launches work without waiting for its tokens and reads them a step
later, so the host's bookkeeping overlaps the device's next step (``engine.continuous_batching``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engine.requests import Request


@dataclass
class Launched:
    """A decode step on its way: its tokens (and margins) are copied to the host without a wait, and read at the
    next step's launch (``Stream.step``). ``requests`` are what rows [0, hi) served when it was launched: a row
    whose request changed since (finished, preempted, continued or admitted anew) gets nothing from it."""

    hi: int
    live: int
    requests: list[Request | None]
    buffer: int  # which of ``HostTokens``'s buffers its tokens go to
    launch_s: float
    first_shape: bool
    start: Any  # CUDA events before its forward (profiled only) and after its copies (None on a CPU, where the step
    done: Any  # ran as it was launched: its device seconds are its launch's)

    def device_s(self) -> float:
        return self.start.elapsed_time(self.done) / 1e3 if self.done is not None else self.launch_s


@dataclass
class Firsts:
    """A prefill's first answer tokens on their way to the host (pinned copies, queued): taken into the rows by the
    next ``_read_launched``, so the host launches the next decode step while the device still runs the prefill, as
    it does with decode steps: waiting for each prefill's tokens would idle the device once per prefill."""

    rows: list[tuple[int, Request]]  # each row and the request it was prefilled for
    tokens: Tensor
    margins: Tensor | None
    done: Any  # a CUDA event after the copies (None on a CPU, where they are done)
    continued: bool


class HostTokens:
    """Two host buffers for decode steps' tokens and margins, pinned on CUDA, used in turn: step k + 1's copy
    goes to the other buffer while the host still reads step k's."""

    def __init__(self, rows: int, device: torch.device, margins: bool):
        pin = device.type == "cuda"
        self.tokens = [torch.zeros(rows, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.margins = [torch.zeros(rows, dtype=torch.float32, pin_memory=pin) for _ in range(2)] if margins else None
        self.turn = 0

    def send(self, tokens: Tensor, margins: Tensor | None) -> int:
        """Copy a step's (hi,) tokens (and margins) to the next buffer without waiting; which buffer it is."""
        i, self.turn = self.turn, 1 - self.turn
        hi = tokens.shape[0]
        self.tokens[i][:hi].copy_(tokens, non_blocking=True)
        if self.margins is not None and margins is not None:
            self.margins[i][:hi].copy_(margins, non_blocking=True)
        return i

    def read(self, i: int, hi: int) -> tuple[list[int], list[float] | list[None]]:
        toks = self.tokens[i][:hi].tolist()
        return toks, (self.margins[i][:hi].tolist() if self.margins is not None else [None] * hi)

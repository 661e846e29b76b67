"""One call timed on the host's clock with the device synchronised around it: the one home for the benchmarks that
time whole calls (a prefill forward, a target forward, a generation run). Marks on the device's own clock are
``common.step_clock``'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


@dataclass
class Timed(Generic[T]):
    result: T
    returned_s: float  # until the call returned: its launches, when the device runs behind the host
    finished_s: float  # until the device finished what it queued (the same off CUDA)


def synced(fn: Callable[[], T], device: torch.device) -> Timed[T]:
    """``fn()`` with ``device`` synchronised before it and after it returns."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    returned = time.perf_counter()
    if cuda:
        torch.cuda.synchronize(device)
    return Timed(result, returned - start, time.perf_counter() - start)

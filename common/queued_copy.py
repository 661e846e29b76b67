"""Copies between host and device that queue like kernels: the one home for every copy issued while the device is
busy.

A copy from pageable host memory makes CUDA wait for every kernel already queued on the stream before it starts,
so the host stalls until the device has drained its queue. The stream's page-table flush between decode steps
would stall the step launched one ahead that way (``engine.stream_decoding``), as would the training step's
figures on their way to the reduction (``train.loop``). From pinned memory the copy is queued like a kernel
(PyTorch's pinned allocator keeps the buffer until the copy has run).
"""

from __future__ import annotations

import torch
from torch import Tensor


def queued_to_device(values: Tensor, device: torch.device) -> Tensor:
    """Host tensor ``values`` on ``device``, queued without waiting (a plain copy off CUDA)."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def queued_to_host(values: Tensor) -> Tensor:
    """``values`` copied into pinned host memory, queued without waiting: read it only after the stream has passed
    the copy (an event recorded after this call, or a synchronisation). A copy into pageable memory waits."""
    if not values.is_cuda:
        return values.clone()
    out = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    return out.copy_(values, non_blocking=True)

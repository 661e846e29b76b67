"""Copies queued behind the device's work: the same values, and on CUDA no wait for the queue."""

from __future__ import annotations

import pytest
import torch

from common.queued_copy import queued_to_device, queued_to_host


def test_queued_copies_carry_the_values() -> None:
    values = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    there = queued_to_device(values, torch.device("cpu"))
    back = queued_to_host(there)
    assert torch.equal(back, values) and back.data_ptr() != there.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_queued_copies_do_not_wait_for_the_device_cuda() -> None:
    """Behind a long queue of kernels, both copies are issued without a synchronising call; the host copy's values
    are read after an event recorded behind it."""
    dev = torch.device("cuda")
    x = torch.randn(4096, 4096, device=dev)
    for _ in range(20):
        x = x @ x / 64
    values = torch.arange(5, dtype=torch.float64)
    torch.cuda.set_sync_debug_mode("error")
    try:
        there = queued_to_device(values, dev)
        back = queued_to_host(there * 2)
        landed = torch.cuda.Event()
        landed.record()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    landed.synchronize()
    assert back.is_pinned() and torch.equal(back, values * 2)

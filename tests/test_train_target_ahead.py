"""The target's forward queued one micro-batch ahead: the same batches, in order, each completed once."""

from __future__ import annotations

import pytest
import torch

from common.step_clock import StepClock
from train.target_ahead import TargetAhead


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": torch.full((1, 2), i), "loss_mask": torch.ones(1, 2, dtype=torch.bool)} for i in range(n)]


def test_each_batch_is_completed_once_in_order_whether_queued_ahead_or_not() -> None:
    calls: list[int] = []

    def complete(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        calls.append(int(batch["input_ids"][0, 0]))
        return {"input_ids": batch["input_ids"] * 10}

    ahead = TargetAhead(batches(4), complete, torch.device("cpu"), start=7)
    clock = StepClock(False)
    k, raw, done = ahead.take(clock)
    assert (k, int(raw["input_ids"][0, 0]), int(done["input_ids"][0, 0])) == (7, 0, 0)
    ahead.queue(clock)  # batch 1 completes now ...
    assert calls == [0, 1]
    ahead.queue(clock)  # ... once
    k, raw, done = ahead.take(clock)  # and take hands over the queued one without completing again
    assert (k, int(done["input_ids"][0, 0]), calls) == (8, 10, [0, 1])
    taken = [ahead.take(clock)[0], ahead.take(clock)[0]]
    assert taken == [9, 10] and calls == [0, 1, 2, 3]
    ahead.queue(clock)
    assert ahead.take(clock) is None and ahead.take(clock) is None
    assert len(clock.marks) == 2 * 4  # the target's two marks per batch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_forwards_on_the_side_stream_are_finished_where_the_drafter_reads_them_cuda() -> None:
    """Each forward runs on the side stream while the current stream is busy; what ``take`` hands over equals the
    same forward run plainly, read on the current stream right away (no wait of the host in between)."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(512, 512, generator=g) / 512 ** 0.5).to(dev)
    raws = [{"input_ids": torch.randint(0, 50, (256, 512), generator=g).pin_memory(),
             "loss_mask": torch.ones(256, 512, dtype=torch.bool).pin_memory()} for _ in range(6)]

    def complete(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = batch["input_ids"].float() / 50
        for _ in range(40):
            x = torch.tanh(x @ w)
        return {"input_ids": batch["input_ids"], "loss_mask": batch["loss_mask"], "out": x}

    ahead = TargetAhead(raws, complete, dev, start=0)
    clock = StepClock(True)
    busy = torch.randn(4096, 4096, device=dev)
    sums = []
    while (item := ahead.take(clock)) is not None:
        _, _, batch = item
        sums.append(batch["out"].sum(0))  # read on the current stream, queued behind the side stream's event
        del batch
        for _ in range(10):  # the current stream busy while the next forward is queued beside it
            busy = busy @ busy / 64
        ahead.queue(clock)
    want = [complete({k: v.to(dev) for k, v in raw.items()})["out"].sum(0) for raw in raws]
    for got, ref in zip(sums, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)  # cuBLAS may pick other kernels per stream
    assert len(clock.marks) == 2 * len(raws)
    clock.spans_ms()  # every mark has run

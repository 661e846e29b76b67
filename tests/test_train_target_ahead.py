"""The target's forward queued one micro-batch ahead: the same batches, in order, each completed once."""

from __future__ import annotations

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

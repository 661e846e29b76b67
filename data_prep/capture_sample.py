"""What every capture source yields and how it fails: a ``Sample`` (the tokens a store shard holds, with
their loss mask) and ``CaptureError`` (bad input to capture). Shared by ``capture`` (rendered conversations)
and ``specforge_import`` (SpecForge's files), which ``capture`` imports: a leaf of its own, so neither side
imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass


class CaptureError(ValueError):
    """Bad input to capture; the message names the file and line."""


@dataclass
class Sample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    unlocated_ends: int = 0  # cut answers whose text end was not found: their end-of-turn kept in the loss

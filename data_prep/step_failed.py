"""``StepFailed``: a data_prep step that ran but must not count as done, and the failure bar the steps that
call a model apply. Raised by the steps (``ingest``, ``regenerate``, ``synthesize``) and handled by their runner
(``steps``), which imports the steps: a leaf of its own, so neither side imports the other for it."""

from __future__ import annotations

from typing import Any


class StepFailed(ValueError):
    """A step that ran but must not count as done (e.g. too many prompts failed); its summary is still
    printed and saved, so the user sees what happened."""

    def __init__(self, message: str, summary: Any):
        super().__init__(message)
        self.summary = summary


def over_failure_share(failed: int, tried: int, share: float) -> bool:
    """Whether more than ``share`` (regenerate.max_failure_share) of the ``tried`` requests failed: the one bar
    regenerate and synthesize both stop at, so the two steps cannot read the setting differently."""
    return failed > share * max(tried, 1)

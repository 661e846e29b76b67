"""``StepFailed``: a data_prep step that ran but must not count as done. Raised by the steps (``ingest``,
``regenerate``) and handled by their runner (``steps``), which imports the steps: a leaf of its own, so
neither side imports the other for it."""

from __future__ import annotations

from typing import Any


class StepFailed(ValueError):
    """A step that ran but must not count as done (e.g. too many prompts failed); its summary is still
    printed and saved, so the user sees what happened."""

    def __init__(self, message: str, summary: Any):
        super().__init__(message)
        self.summary = summary

"""What ``sources`` (which opens a prompt source) and ``hf_datasets`` (which it hands `datasets` sources to)
share: ``SourceError`` and ``Fields``. A leaf of its own, so neither side imports the other for them."""

from __future__ import annotations

from dataclasses import dataclass


class SourceError(ValueError):
    """A source that cannot be read at all; the message names the file or column and the config key."""


@dataclass(frozen=True)
class Fields:
    """What a source's records hold, as far as is known before reading them all."""

    columns: set[str]
    turn_fields: set[str] | None  # keys of a turn in the chat column (None: not known)

"""A stable number for a sample or prompt id, for splits that must not move between runs.

Python's ``hash`` of a str changes per process (hash randomization), so a split by it would reshuffle the
held-out set or a resumed run's device shares; the first 32 bits of the id's sha1 do not.
"""

from __future__ import annotations

import hashlib

ID_HASH_RANGE = 0x1_0000_0000  # id_hash is below this


def id_hash(sample_id: str) -> int:
    """The first 32 bits of ``sample_id``'s sha1, as an int in [0, ID_HASH_RANGE)."""
    return int(hashlib.sha1(sample_id.encode()).hexdigest()[:8], 16)

"""How long this process has run, from the kernel's record of its start: the time a command spends before its
first line of our code runs (the interpreter, the imports) measured from inside it.

Linux only: ``/proc/self/stat`` field 22 (``starttime``, proc(5)) is the process's start in clock ticks
(``SC_CLK_TCK``, 100 a second: 10 ms steps) since boot, on the clock ``CLOCK_BOOTTIME`` reads (both shifted alike
in a time namespace). A process started by fork and exec (``subprocess``, a shell, ``multiprocessing``'s spawn)
starts at the fork. Elsewhere, or where /proc cannot be read, there is no figure (None).
"""

from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started, or None where the kernel does not say (not Linux)."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    if clock is None:
        return None
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    return max(0.0, time.clock_gettime(clock) - start_ticks(stat) / ticks)


def start_ticks(stat: bytes) -> int:
    """Field 22 of a /proc/<pid>/stat line. Field 2, the command name in parentheses, may hold spaces and
    parentheses (any process may name itself so): the fields from 3 on follow its last ")"."""
    return int(stat[stat.rindex(b")") + 1:].split()[22 - 3])

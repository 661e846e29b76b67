"""The process's age from the kernel's record of its start: a child's age covers what ran before its first line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from common.process_clock import process_age_s, start_ticks


def test_the_start_is_read_after_a_command_name_with_spaces_and_parentheses() -> None:
    fields = " ".join(str(n) for n in range(3, 30))  # field n holds n: field 22 is the start
    assert start_ticks(f"1234 (cat) {fields}".encode()) == 22
    assert start_ticks(f"1234 (a) b (c)) {fields}".encode()) == 22


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/stat is Linux's")
def test_a_childs_age_counts_from_its_start_and_not_past_its_wall_time() -> None:
    code = ("import time; time.sleep(0.5); from common.process_clock import process_age_s; "
            "print(process_age_s())")
    started = time.perf_counter()
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    wall = time.perf_counter() - started
    assert 0.5 <= age <= wall + 0.01  # the kernel's clock ticks are 10 ms
    assert 0 < process_age_s() < time.clock_gettime(time.CLOCK_BOOTTIME)

"""bench.runs.run's silence limit: a run that prints nothing for too long is killed at once (a hung trainer would
otherwise hold its GPU slot to the end of the device call); one that keeps printing runs to its end."""

from __future__ import annotations

import sys
import time

import pytest

from bench.runs import Stalled, run


def test_a_silent_run_is_killed_and_a_talking_one_is_not(tmp_path) -> None:
    log = tmp_path / "train.out"
    start = time.monotonic()
    with pytest.raises(Stalled, match="no output for 2 s, killed"):
        run([sys.executable, "-c", "import time; print('target loaded', flush=True); time.sleep(120)"],
            log=log, silent_limit_s=2)
    assert time.monotonic() - start < 60
    assert log.read_text().startswith("target loaded\n\n--- stalled: process table ---\n")
    run([sys.executable, "-c", "import time\nfor i in range(6):\n    print(i, flush=True)\n    time.sleep(0.8)"],
        log=log, silent_limit_s=2)  # 4.8 s in all, never 2 s quiet
    assert log.read_text().split() == [str(i) for i in range(6)]


def test_a_stalled_run_leaves_its_stack_and_the_process_table_in_its_log(tmp_path) -> None:
    """A run that registers common.cli.stacks_on_signal (as ``python -m train`` does) dumps where it hangs before
    the kill; the process table says whether its helpers were busy or asleep."""
    log = tmp_path / "train.out"
    hang = ("import time\nfrom common.cli import stacks_on_signal\nstacks_on_signal()\n"
            "def render_pool_wait():\n    time.sleep(120)\nprint('target loaded', flush=True)\nrender_pool_wait()\n")
    with pytest.raises(Stalled, match="stacks and the process table"):
        run([sys.executable, "-c", hang], log=log, silent_limit_s=2)
    text = log.read_text()
    assert "render_pool_wait" in text  # the hung frame, by name
    assert "--- stalled: process table ---" in text and "PPID" in text

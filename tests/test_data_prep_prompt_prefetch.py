"""data_prep/prompt_prefetch.py: results handed out once each, in any order the caller asks, waiting for the
thread where it has not got there yet; a failing encode or a stop leaves the rest to the caller, never hangs it."""

from __future__ import annotations

import threading
import time

from data_prep.prompt_prefetch import PromptPrefetch


def upper(batch: list[str]) -> list[tuple[str, list[int]]]:
    return [(s.upper(), [len(s)]) for s in batch]


def test_each_key_is_handed_out_once_and_unknown_keys_get_nothing() -> None:
    words = [f"w{i}" for i in range(600)]  # three chunks
    ahead = PromptPrefetch(words, iter(words), upper)
    assert ahead.take("w599") == ("W599", [4])  # waits for the third chunk
    assert ahead.take("w0") == ("W0", [2])
    assert ahead.take("w0") is None and ahead.take("never given") is None
    ahead.thread.join(5)
    assert ahead.finished and ahead.ready == 598
    assert ahead.stats() | {"prefetch_wait_s": 0, "prefetch_encode_s": 0} == {
        "prompts_prefetched": 2, "prefetch_wait_s": 0, "prefetch_encode_s": 0, "prefetch_error": None}


def test_take_waits_for_the_thread_then_returns_what_it_encoded() -> None:
    gate = threading.Event()

    def slow(batch: list[str]) -> list[tuple[str, list[int]]]:
        gate.wait(5)
        return upper(batch)

    ahead = PromptPrefetch(["a"], iter(["a"]), slow)
    threading.Timer(0.2, gate.set).start()
    t0 = time.perf_counter()
    assert ahead.take("a") == ("A", [1])
    assert time.perf_counter() - t0 >= 0.15 and ahead.wait_s >= 0.15


def test_a_failing_encode_leaves_every_key_to_the_caller_and_is_said() -> None:
    def broken(batch: list[str]) -> list[tuple[str, list[int]]]:
        raise ValueError("template error")

    ahead = PromptPrefetch(["a", "b"], iter(["a", "b"]), broken)
    assert ahead.take("b") is None and ahead.take("a") is None  # not a hang
    assert ahead.stats()["prefetch_error"] == "ValueError: template error"


def test_stop_ends_the_thread_after_the_chunk_under_way() -> None:
    started, release = threading.Event(), threading.Event()

    def blocking(batch: list[str]) -> list[tuple[str, list[int]]]:
        started.set()
        release.wait(5)
        return upper(batch)

    words = [f"w{i}" for i in range(3 * PromptPrefetch.CHUNK)]
    ahead = PromptPrefetch(words, iter(words), blocking)
    started.wait(5)
    ahead.stop()
    release.set()
    ahead.thread.join(5)
    assert not ahead.thread.is_alive() and ahead.ready == PromptPrefetch.CHUNK
    assert ahead.take(words[-1]) is None  # the caller encodes it itself

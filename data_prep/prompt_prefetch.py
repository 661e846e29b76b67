"""First prompts rendered and tokenized on a thread, ahead of their submit.

A regeneration's first turns are known before it starts, in the order it opens them. Rendered and tokenized on the
main thread, the first few thousand of them hold back the engine's first forward, and first turns are about half
of the caller's tokenizing over a run, while the device waits on it. The tokenizer's batch
encode releases the GIL, so a thread does this beside the first compile and while the main thread waits on the
device; the main thread takes each prompt's text and ids when it opens the conversation (``take``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any

Encoded = tuple[str, list[int]]  # a prompt's rendered text and its token ids


class PromptPrefetch:
    """``encode`` run on chunks of ``items`` (one per key of ``keys``, in that order) on a daemon thread.
    ``take(key)`` hands out a key's result once, waiting while the thread has yet to reach it. A key never
    given, taken before, or left undone (``stop``, or ``encode`` raised: the caller encodes it itself and meets
    the same error where it always did) gets None."""

    CHUNK = 256  # prompts per encode call: the first chunk is what the run waits for at its start

    def __init__(self, keys: Sequence[Hashable], items: Iterable[Any], encode: Callable[[list[Any]], list[Encoded]]):
        self.encode = encode
        self.expected = set(keys)
        self.done: dict[Hashable, Encoded] = {}
        self.cond = threading.Condition()
        self.finished = self.stopped = False
        self.error: BaseException | None = None
        self.taken = 0
        self.wait_s = 0.0  # the caller's seconds in ``take``, waiting for the thread
        self.encode_s = 0.0  # the thread's seconds in ``encode``
        self.thread = threading.Thread(target=self._run, args=(iter(keys), iter(items)), daemon=True,
                                       name="prompt-prefetch")
        self.thread.start()

    def _run(self, keys: Iterator[Hashable], items: Iterator[Any]) -> None:
        try:
            while not self.stopped:
                chunk = list(islice(items, self.CHUNK))
                if not chunk:
                    break
                t0 = time.perf_counter()
                encoded = self.encode(chunk)
                self.encode_s += time.perf_counter() - t0
                with self.cond:
                    self.done.update(zip(islice(keys, len(chunk)), encoded, strict=True))
                    self.cond.notify_all()
        except Exception as e:  # noqa: BLE001 - said in stats(); the caller encodes what is left itself
            self.error = e
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify_all()

    @property
    def ready(self) -> int:
        """Results waiting to be taken."""
        return len(self.done)

    def take(self, key: Hashable) -> Encoded | None:
        if key not in self.expected:
            return None
        self.expected.discard(key)
        t0 = time.perf_counter()
        with self.cond:
            while key not in self.done and not self.finished:
                self.cond.wait()
            found = self.done.pop(key, None)
        self.wait_s += time.perf_counter() - t0
        self.taken += found is not None
        return found

    def stop(self) -> None:
        """Encode no further chunk (the one under way finishes); the thread is a daemon either way."""
        self.stopped = True

    def stats(self) -> dict[str, Any]:
        return {"prompts_prefetched": self.taken, "prefetch_wait_s": round(self.wait_s, 2),
                "prefetch_encode_s": round(self.encode_s, 2),
                "prefetch_error": None if self.error is None else f"{type(self.error).__name__}: {self.error}"}

"""Where a regeneration's seconds go, for benchmarks: one optional ``EngineProfile`` the caller passes.

``Stream`` (and the regeneration loop around it, ``data_prep.regenerate_loop``) measure nothing unless they are given a
profile: production keeps no timings, records no CUDA timing events and runs no sampler thread. Given one, it splits
the run's seconds into prefill forwards, decode (the host's: launching steps and waiting for their tokens), the
engine's own host work by phase and the caller's time between polls, with the decode steps' own device seconds
beside them, and counts decode steps by live rows. It also bins the run second by second: a multi-turn run's tail
(its longest conversations, a few rows a step) can take as long as its full-batch start, and totals do not show it.
With ``sample_host`` it samples the host's stack through the step (``common.stack_sampler``): where the host's
seconds go, at no cost to them. bench/regenerate_throughput.py reads the figures and plots the timeline.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from common.stack_sampler import StackSampler

LIVE_ROW_BUCKETS = (8, 64, 512)  # decode steps by live rows, <= each and above the last
HOST_PHASES = ("release", "continue", "admit", "compact", "pages", "tokens")  # engine_host_s_by_phase
TIMELINE_BIN_S = 1.0  # the run's timeline, in bins of this many seconds


@dataclass
class StepTimes:
    """Prefill forwards and decode steps as the host spends them (the launch, then the wait for their tokens a step
    later), decode steps on the device too (CUDA events), ``poll`` wall time, and decode steps by live rows."""

    prefill_s: float = 0.0
    continue_prefill_s: float = 0.0  # of prefill_s: suffixes after a row's cached prefix
    continue_first_s: float = 0.0  # of continue_prefill_s: the first (under flex on CUDA, the suffix kernel's compile)
    decode_s: float = 0.0
    decode_device_s: float = 0.0  # the decode steps' own seconds on the device (overlapping the host's work)
    decode_launch_s: float = 0.0  # host time issuing the decode forwards
    decode_first_shape_s: float = 0.0  # flex: the first decode step at each padded batch size (its compile)
    poll_s: float = 0.0
    # The engine's host seconds by phase, prefill forwards left out: freeing the rows nobody continued, claiming
    # continuations, admitting, compacting, pages for the next step, taking a step's tokens into the rows.
    host_phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOST_PHASES, 0.0))
    live_steps: list[int] = field(default_factory=lambda: [0] * (len(LIVE_ROW_BUCKETS) + 1))
    live_decode_s: list[float] = field(default_factory=lambda: [0.0] * (len(LIVE_ROW_BUCKETS) + 1))
    continued: bool = False  # a continuation's prefill was timed

    def step(self, live: int, launch: float, seconds: float, device: float, first_shape: bool) -> None:
        """One decode step of ``live`` rows: ``launch`` seconds to issue, ``seconds`` of the host's in all (the
        launch and the wait for its tokens), ``device`` seconds on the device (the forward and the copies)."""
        self.decode_s += seconds
        self.decode_device_s += device
        self.decode_launch_s += launch
        self.decode_first_shape_s += seconds if first_shape else 0.0
        i = next((i for i, edge in enumerate(LIVE_ROW_BUCKETS) if live <= edge), len(LIVE_ROW_BUCKETS))
        self.live_steps[i] += 1
        self.live_decode_s[i] += seconds

    def prefill(self, seconds: float, continued: bool) -> None:
        """One prefill forward launched, in ``seconds`` (a compile's included): fresh prompts, or suffixes after
        their rows' cached prefixes."""
        self.prefill_s += seconds
        if continued:
            self.continue_first_s += seconds if not self.continued else 0.0
            self.continue_prefill_s += seconds
            self.continued = True

    def prefill_wait(self, seconds: float, continued: bool) -> None:
        """The wait for a launched prefill's first tokens (at the next step's read): the prefill's seconds too."""
        self.prefill_s += seconds
        if continued:
            self.continue_prefill_s += seconds

    def stats(self, seconds: float) -> dict[str, Any]:
        names = [f"<={edge}" for edge in LIVE_ROW_BUCKETS] + [f">{LIVE_ROW_BUCKETS[-1]}"]
        return {"prefill_s": round(self.prefill_s, 2), "continue_prefill_s": round(self.continue_prefill_s, 2),
                "continue_first_s": round(self.continue_first_s, 2),
                "decode_s": round(self.decode_s, 2), "decode_device_s": round(self.decode_device_s, 2),
                "engine_host_s": round(self.poll_s - self.prefill_s - self.decode_s, 2),
                "caller_s": round(seconds - self.poll_s, 2), "decode_launch_s": round(self.decode_launch_s, 2),
                "decode_first_shape_s": round(self.decode_first_shape_s, 2),
                "engine_host_s_by_phase": {k: round(v, 2) for k, v in self.host_phases.items()},
                "steps_by_live_rows": dict(zip(names, self.live_steps, strict=True)),
                "decode_s_by_live_rows": {n: round(x, 2) for n, x in zip(names, self.live_decode_s, strict=True)}}


@dataclass
class Timeline:
    """The run in bins of ``bin_s`` seconds, each poll counted in the bin it ended in: tokens decoded, the most live
    rows, prefill seconds."""

    bin_s: float = TIMELINE_BIN_S
    tokens: list[int] = field(default_factory=list)
    live_rows: list[int] = field(default_factory=list)
    prefill_s: list[float] = field(default_factory=list)

    def add(self, at: float, tokens: int, live: int, prefill_s: float) -> None:
        i = int(at / self.bin_s)
        while len(self.tokens) <= i:
            self.tokens.append(0)
            self.live_rows.append(0)
            self.prefill_s.append(0.0)
        self.tokens[i] += tokens
        self.live_rows[i] = max(self.live_rows[i], live)
        self.prefill_s[i] += prefill_s

    def stats(self) -> dict[str, Any]:
        return {"bin_s": self.bin_s, "tokens": self.tokens, "live_rows": self.live_rows,
                "prefill_s": [round(x, 3) for x in self.prefill_s]}


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 2)


class EngineProfile:
    """One stream's run, measured: ``times`` (``StepTimes``), ``timeline``, when its first poll and first decode
    step came (seconds after the stream started: how long the caller took to submit the first requests, then the
    first prefill and its compile), the caller's seconds by part (``caller``: rendering, tokenizing, writing), and
    with ``sample_host`` the host's stack samples of the step ``sampling`` wraps."""

    def __init__(self, sample_host: bool = False, bin_s: float = TIMELINE_BIN_S):
        self.times = StepTimes()
        self.timeline = Timeline(bin_s)
        self.caller: dict[str, float] = {}
        self.first_poll_s: float | None = None
        self.first_step_s: float | None = None
        self.sampler = StackSampler() if sample_host else None
        self._poll = (0.0, 0, 0.0)  # the open poll's start, tokens produced and prefill seconds before it

    def poll_start(self, started: float, produced: int) -> None:
        """A poll begins (``started``: the stream's start on the same clock; ``produced``: its tokens so far)."""
        now = time.perf_counter()
        if self.first_poll_s is None:
            self.first_poll_s = now - started
        self._poll = (now, produced, self.times.prefill_s)

    def poll_end(self, started: float, produced: int, live: int) -> None:
        """The poll ends with ``produced`` tokens and ``live`` rows: its seconds and its bin of the timeline."""
        now = time.perf_counter()
        begun, before, prefill = self._poll
        self.times.poll_s += now - begun
        self.timeline.add(now - started, produced - before, live, self.times.prefill_s - prefill)

    def first_step(self, started: float) -> None:
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - started

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the block's host seconds to the engine's host phase ``name``, less the prefill forwards run in it."""
        start, prefill = time.perf_counter(), self.times.prefill_s
        yield
        self.times.host_phases[name] += time.perf_counter() - start - (self.times.prefill_s - prefill)

    def add_caller(self, part: str, seconds: float) -> None:
        self.caller[part] = self.caller.get(part, 0.0) + seconds

    @contextmanager
    def sampling(self) -> Iterator[None]:
        """Sample the entering thread's stack through the block when ``sample_host`` (``host_samples`` after it)."""
        if self.sampler is None:
            yield
            return
        with self.sampler:
            yield

    @property
    def host_samples(self) -> dict[str, Any] | None:
        """The stack samples' summary (``StackSampler.summary``) once ``sampling`` ended; else None."""
        return self.sampler.summary() if self.sampler is not None and self.sampler.seconds else None

    def stats(self, seconds: float) -> dict[str, Any]:
        """The figures of a stream that has run ``seconds``."""
        return {"first_poll_s": _rounded(self.first_poll_s), "first_step_s": _rounded(self.first_step_s),
                **self.times.stats(seconds), "timeline": self.timeline.stats(),
                **({"caller_s_by_part": {k: round(v, 2) for k, v in self.caller.items()}} if self.caller else {})}

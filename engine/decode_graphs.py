"""The stream's decode step over flex attention, replayed from CUDA graphs: one graph per padded batch size.

A decode step of SmolLM2-135M (30 layers) is about 1,300 small kernels; on a fast GPU launching them, not running
them, bounds the step, whatever few rows it decodes. A CUDA graph launches them as one. The step's
shapes are fixed per padded batch size (``sizing.decode_rows``), so each size gets one graph, captured
the first time it runs and replayed after; the graphs share one memory pool.

A replay reads and writes where its capture did, so everything it touches stays in place: the ids and positions
are views of the stream's persistent ``last`` and ``pos`` (updated in place), ``logits_at`` a persistent zeros
buffer, and the cache's tensors are updated in place. ``PagedKVCache.flush`` (host-to-device table copies, which
cannot be captured) runs here before every capture and replay, so the forward's own flush finds nothing to do.
A cache whose storage moves (``PagedKVCache.grow``: a CPU pool's growth; a GPU's is sized once) drops every graph
(``storage_key``). A replay's logits are the graph's own buffer, overwritten by the next replay.

Graphs run on CUDA only, over flex attention, once a flex step ran eagerly (a flex kernel that fails to build
falls back to gather on that first step, ``BatchedTarget.forward``). A capture that fails turns them off for the
rest of the run, with one warning line and the reason in ``stats``. ``enabled=False`` turns them off (a benchmark
A/Bs them against the eager step: ``Stream``'s ``decode_graphs``).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch import Tensor

from common.cli import exception_line
from engine.batched import BatchedTarget
from engine.kv_cache import PagedKVCache

WARMUP_RUNS = 3  # eager steps before a capture (PyTorch's recipe): the first compiles and autotunes a new shape


def storage_key(cache: PagedKVCache) -> tuple[int, ...]:
    """Where the cache's tensors live: a graph reads and writes at the addresses it was captured with."""
    return tuple(t.data_ptr() for t in (cache.k, cache.v, cache.page_table, cache.owner, cache.logical,
                                        cache.query_pos))


def release_generator(device: torch.device) -> None:
    """Take the device's default generator out of capture mode. A capture registers it, and one that fails at
    its end leaves it there (PyTorch's ``capture_end`` raises before the generator's epilogue): every later random
    op on the device then fails ("Offset increment outside graph capture"). A fresh state at the same seed and
    offset replaces it."""
    if device.type != "cuda":  # (tests drive the fallback on a CPU)
        return
    gen = torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    fresh = torch.Generator(device=device)
    fresh.set_state(gen.get_state())
    gen.graphsafe_set_state(fresh.graphsafe_get_state())


def capture_error(e: BaseException) -> str:
    """A failed capture in one line: the error and the one it was raised over (a step that fails inside
    ``torch.cuda.graph`` makes the capture's end fail too, and that last error names no cause)."""
    cause = e.__context__
    return exception_line(e) + (f" (raised over {exception_line(cause)})" if cause is not None else "")


class DecodeGraphs:
    """One decode token for rows [0, b) of a stream's cache, at ids ``ids[:b]`` and positions ``positions[:b]``
    ((rows,) tensors the stream updates in place): a graph's replay when it can (on CUDA, ``enabled``), else the
    eager forward."""

    def __init__(self, target: BatchedTarget, cache: PagedKVCache, ids: Tensor, positions: Tensor,
                 enabled: bool = True):
        self.t, self.cache, self.ids, self.positions = target, cache, ids, positions
        self.logits_at = torch.zeros_like(ids)  # each row's one token: a persistent buffer, as a graph reads it
        self.on = enabled and target.device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # padded rows -> graph, its logits
        self.key: tuple[int, ...] = ()  # storage_key the graphs were captured at
        self.pool: Any = None  # the graphs' shared memory pool and capture stream, made at the first capture
        self.side: Any = None
        self.replays = self.captures = 0
        self.capture_s = 0.0
        self.fallback: str | None = None  # why graphs were turned off mid-run

    def logits(self, b: int) -> Tensor:
        """(b, V) logits of the step. A replay's are the graph's buffer, which its next replay overwrites: read
        them before the next step."""
        if self.on and "decode" in self.cache.flex_ran:  # (a decode kernel that fell back never ran)
            try:
                return self._replay(b)
            except Exception as e:  # noqa: BLE001 (a step that cannot be captured still runs, eagerly)
                self.on, self.graphs, self.fallback = False, {}, capture_error(e)
                release_generator(self.t.device)
                print(f"warning: decode steps run eagerly, CUDA graph capture failed: {self.fallback}",
                      file=sys.stderr)
        return self._eager(b)

    def stats(self) -> dict[str, Any]:
        """Steps replayed from a graph, captures and their seconds (warm-up included), and a fallback's reason."""
        return {"graph_steps": self.replays, "graph_captures": self.captures,
                "graph_capture_s": round(self.capture_s, 2), "graph_fallback": self.fallback}

    def _eager(self, b: int) -> Tensor:
        return self.t.forward(self.cache, slice(0, b), self.ids[:b, None], self.positions[:b, None], fresh=False,
                              logits_at=self.logits_at[:b]).logits

    def _replay(self, b: int) -> Tensor:
        self.cache.flush()  # outside any graph: the forward's flush then has nothing to copy in a capture
        key = storage_key(self.cache)
        if key != self.key:
            self.graphs, self.key = {}, key
        if b not in self.graphs:
            start = time.perf_counter()
            self.graphs[b] = self._capture(b)
            self.captures += 1
            self.capture_s += time.perf_counter() - start
        graph, logits = self.graphs[b]
        graph.replay()
        self.replays += 1
        return logits

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Warm the step up eagerly on a side stream, then capture it there (PyTorch's recipe). The warm-up's
        cache writes are harmless: the same ids at the same positions write the same keys and values, and every
        replay writes each layer's before its attention reads them."""
        dev = self.t.device  # named everywhere: a regeneration process on cuda:1 never sets the current device
        if self.pool is None:
            self.pool, self.side = torch.cuda.graph_pool_handle(), torch.cuda.Stream(dev)
        graph = torch.cuda.CUDAGraph()
        self.side.wait_stream(torch.cuda.current_stream(dev))  # the warm-up reads this step's ids and positions
        # This context restores the caller's stream even when a failed capture_end skips torch.cuda.graph's own.
        with torch.cuda.stream(self.side):
            for _ in range(WARMUP_RUNS):
                self._eager(b)
            with torch.cuda.graph(graph, pool=self.pool, stream=self.side):
                logits = self._eager(b)
        torch.cuda.current_stream(dev).wait_stream(self.side)
        return graph, logits

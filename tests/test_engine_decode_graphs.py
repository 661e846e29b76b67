"""CUDA graphs of the stream's flex decode step (``engine.decode_graphs``).

On a CPU: graphs are never taken there, nor over gather; the storage key moves only when the cache reallocates;
and the bookkeeping (one capture per padded batch size and storage, every step after the first flex one
replayed, a failed capture falling back to eager with one warning) runs with a stand-in graph whose replay runs
the step eagerly into its one logits buffer. On CUDA (skipped here): with real graphs a stream's answers are the
eager stream's and plain greedy ``generate``'s, token for token, as rows finish and the padded batch shrinks,
as turns continue in their rows, and after the cache's storage moves; a capture that syncs with the host falls
back to eager and the answers stay exact."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from test_engine_continuous_batching import STOPS, all_free, converse, plain_greedy, prompts, tiny
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

import engine.batched as bt
from engine.batched import BatchedTarget
from engine.continuous_batching import Stream
from engine.decode_graphs import DecodeGraphs, storage_key
from engine.kv_cache import PagedKVCache

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def eager_flex(q: Tensor, k: Tensor, v: Tensor, block_mask, scale: float) -> Tensor:
    """``flex_decode`` uncompiled: the same mask, exact for any key (``PagedKVCache._mask_mod``), with no compile
    (the CPU compile takes tens of seconds)."""
    return flex_attention(q, k[None], v[None], block_mask=block_mask, scale=scale)


class StandInGraph:
    """A CUDA graph's contract on a CPU: a replay runs the captured step and writes its logits into one buffer."""

    def __init__(self, step: Callable[[], Tensor]):
        self.step = step
        self.logits = step().clone()

    def replay(self) -> None:
        self.logits.copy_(self.step())


@pytest.fixture
def captured(monkeypatch) -> list[tuple[tuple[int, ...], int]]:
    """CPU flex decode steps whose graphs are stand-ins, graphs on as on CUDA: the (storage key, rows) of each
    capture."""
    seen: list[tuple[tuple[int, ...], int]] = []

    def capture(self: DecodeGraphs, b: int) -> tuple[StandInGraph, Tensor]:
        seen.append((self.key, b))
        graph = StandInGraph(lambda: self._eager(b))
        return graph, graph.logits

    monkeypatch.setattr(bt, "flex_decode", eager_flex)
    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    return seen


def graphed(stream: Stream) -> Stream:
    stream.decode.on = True  # as on CUDA
    return stream


def answers_are_greedy(stream: Stream, model: torch.nn.Module, ps: list[list[int]], max_new: int) -> None:
    """Every prompt through the stream at once: each answer is plain greedy decoding's."""
    for i, p in enumerate(ps):
        stream.submit(i, p, max_new)
    outs = dict(stream.run())
    for i, p in enumerate(ps):
        assert (outs[i].tokens, outs[i].finish_reason) == plain_greedy(model, p, max_new)


def test_graphs_are_on_on_cuda_unless_turned_off() -> None:
    ids = torch.zeros(4, dtype=torch.long)
    gpu, cpu = SimpleNamespace(device=torch.device("cuda")), SimpleNamespace(device=torch.device("cpu"))
    assert DecodeGraphs(gpu, None, ids, ids).on and not DecodeGraphs(gpu, None, ids, ids, enabled=False).on
    assert not DecodeGraphs(cpu, None, ids, ids).on
    assert not Stream(BatchedTarget(tiny()), STOPS, max_len=64, cpu_rows=2).decode.on


def test_the_storage_key_moves_only_when_the_cache_reallocates() -> None:
    """Pages taken and returned are written to the device tables in place (a graph reads them there); growing
    the pool reallocates keys, values and page owners, which every captured graph would still point at."""
    cache = BatchedTarget(tiny()).new_paged_cache(rows=2, pages=5, max_len=512, attention="flex")
    key = storage_key(cache)
    assert cache.ensure(0, 300) and cache.ensure(1, 10)
    cache.flush()
    cache.move_rows([1], [0])
    cache.flush()
    assert storage_key(cache) == key
    cache.grow(2)
    assert storage_key(cache) != key


def test_a_cpu_stream_never_replays_and_gather_never_captures(captured) -> None:
    """Graphs are off on a CPU (flex or not); over gather they stay off even when wanted (no fixed-shape kernel
    to capture): every step runs eagerly."""
    model = tiny()
    for stream in (Stream(BatchedTarget(model), STOPS, max_len=80, cpu_rows=3, attention="flex"),
                   graphed(Stream(BatchedTarget(model), STOPS, max_len=80, cpu_rows=3, attention="gather"))):
        for i, p in enumerate(prompts(4, 3, 30, seed=6)):
            stream.submit(i, p, 6)
        dict(stream.run())
        s = stream.stats()
        assert s["steps"] > 0 and (s["graph_steps"], s["graph_captures"], s["graph_fallback"]) == (0, 0, None)
    assert captured == []


def test_every_flex_step_after_the_first_replays_one_graph_per_size_and_storage(captured) -> None:
    """Three turns of short and long conversations through 4 rows: the padded batch shrinks as rows finish
    (sizes 4, 2, 1), and the long prompts grow the CPU pool mid-run, which drops the graphs (new storage) and
    captures again. The first flex step runs eagerly (flex's own fallback is decided there); every later one
    replays; every answer is greedy's."""
    model = tiny()
    openers = prompts(5, 2, 12) + prompts(3, 600, 700, seed=2)
    stream = graphed(Stream(BatchedTarget(model), STOPS, max_len=800, cpu_rows=4, attention="flex"))
    start = stream.cache.pages
    seen = converse(stream, openers, 3, lambda i: 6 + i)
    assert all_free(stream) and stream.cache.pages > start
    for (i, _), (prompt, answer) in seen.items():
        assert (answer.tokens, answer.finish_reason) == plain_greedy(model, prompt, 6 + i)
    s = stream.stats()
    assert s["attention"] == "flex" and s["continued"] > 0 and s["graph_fallback"] is None
    assert s["graph_steps"] == s["steps"] - 1 and s["graph_captures"] == len(captured) == len(set(captured))
    assert len({b for _, b in captured}) > 1 and len({key for key, _ in captured}) > 1
    assert captured[-1][0] == storage_key(stream.cache)


def test_a_capture_that_fails_falls_back_to_eager_with_one_warning(captured, monkeypatch, capsys) -> None:
    def broken(self: DecodeGraphs, b: int) -> None:
        try:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        finally:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    monkeypatch.setattr(DecodeGraphs, "_capture", broken)
    model = tiny()
    ps = prompts(5, 3, 40, seed=6)
    stream = graphed(Stream(BatchedTarget(model), STOPS, max_len=80, cpu_rows=3, attention="flex"))
    answers_are_greedy(stream, model, ps, 12)
    s = stream.stats()
    assert s["graph_fallback"] == ("RuntimeError: CUDA error: operation failed due to a previous error during "
                                   "capture (raised over RuntimeError: CUDA error: operation not permitted when "
                                   "stream is capturing)")
    assert (s["graph_steps"], s["graph_captures"], s["attention"]) == (0, 0, "flex") and not stream.decode.on
    warnings = [line for line in capsys.readouterr().err.splitlines() if "CUDA graph" in line]
    assert warnings == [f"warning: decode steps run eagerly, CUDA graph capture failed: {s['graph_fallback']}"]


# On CUDA: real graphs, real compiled flex attention.

def recorded_captures(monkeypatch) -> list[tuple[tuple[int, ...], int]]:
    """The (storage key, rows) of every real capture."""
    seen: list[tuple[tuple[int, ...], int]] = []
    original = DecodeGraphs._capture

    def capture(self: DecodeGraphs, b: int):
        seen.append((self.key, b))
        return original(self, b)

    monkeypatch.setattr(DecodeGraphs, "_capture", capture)
    return seen


def grow_once_at(step: int, monkeypatch) -> None:
    """Grow the stream's pool once its ``step``-th decode step has run (a GPU's pool is sized once; this moves
    the cache's storage under the captured graphs)."""
    original = Stream.poll

    def poll(self: Stream):
        if self.steps >= step and not getattr(self, "grown", False):
            self.cache.grow(4)
            self.grown = True
        return original(self)

    monkeypatch.setattr(Stream, "poll", poll)


@cuda
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_graphs_answer_as_eager_and_plain_generate_cuda(kind: str, monkeypatch) -> None:
    """Twelve conversations of three turns through 16 rows (padded to 16, 8, 4 or 2), fp32: with graphs every
    answer is the eager stream's and plain greedy ``generate``'s, token for token, across bucket changes, turns
    continued in their rows, and a pool grown mid-run (every graph captured again)."""
    model = tiny(kind).cuda()
    openers = prompts(12, 3, 150, seed=5)

    def budget(i: int) -> int:
        return 10 + 4 * i

    captures = recorded_captures(monkeypatch)
    grow_once_at(25, monkeypatch)
    runs = {}
    for graphs in (True, False):
        stream = Stream(BatchedTarget(model), STOPS, max_len=400, rows=16, attention="flex", margins=True,
                        decode_graphs=graphs)
        runs[graphs] = converse(stream, openers, 3, budget), stream.stats()
        assert all_free(stream)
    (seen, s), (eager, eager_s) = runs[True], runs[False]
    assert s["attention"] == eager_s["attention"] == "flex" and s["graph_fallback"] is None
    assert s["suffix_attention"] == eager_s["suffix_attention"] == "flex"  # the compiled suffix kernel built
    assert s["graph_steps"] == s["steps"] - 1 and eager_s["graph_steps"] == eager_s["graph_captures"] == 0
    assert s["graph_captures"] == len(captures) == len(set(captures)) and s["continued"] > 0
    assert len({b for _, b in captures}) > 1 and len({key for key, _ in captures}) == 2
    assert {k: (p, a.tokens, a.finish_reason) for k, (p, a) in seen.items()} == \
        {k: (p, a.tokens, a.finish_reason) for k, (p, a) in eager.items()}
    for key, (prompt, answer) in seen.items():
        assert answer.margins == pytest.approx(eager[key][1].margins, abs=1e-4)
        assert (answer.tokens, answer.finish_reason) == plain_greedy(model, prompt, budget(key[0]))


@cuda
def test_a_capture_that_syncs_with_the_host_falls_back_to_eager_cuda(monkeypatch, capsys) -> None:
    """A host sync inside the captured step (here one in the block mask) fails the capture: the stream warns once,
    runs every step eagerly, and its answers stay greedy's."""
    original = PagedKVCache.block_mask

    def syncing(self: PagedKVCache, b: int, q_len: int):
        int(self.query_pos[0])  # .item(): a device-to-host copy, which a capture refuses
        return original(self, b, q_len)

    monkeypatch.setattr(PagedKVCache, "block_mask", syncing)
    model = tiny().cuda()
    ps = prompts(6, 3, 60, seed=6)
    stream = Stream(BatchedTarget(model), STOPS, max_len=120, rows=4, attention="flex")
    answers_are_greedy(stream, model, ps, 16)
    s = stream.stats()
    assert s["attention"] == "flex" and s["graph_steps"] == 0 and "captur" in s["graph_fallback"]
    assert sum("CUDA graph capture failed" in line for line in capsys.readouterr().err.splitlines()) == 1
    # the failed capture left the default generator in capture mode until the fallback released it: random ops on
    # the device work again, from the same state (else the next random op on the device fails)
    state = torch.cuda.get_rng_state()
    first = torch.randn(4, device="cuda")
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.randn(4, device="cuda"), first)


@cuda
def test_a_page_table_flush_queues_its_copies_without_waiting_on_the_device_cuda() -> None:
    """Pages given and returned between decode steps reach the device tables without a host sync (a pageable copy
    waits for the queued step: the one-ahead decode step then stalled on every flush), and land as the host
    lists say."""
    cache = PagedKVCache(1, 1, 4, rows=4, pages=16, max_len=512, dtype=torch.float32, device=torch.device("cuda"),
                         attention="flex")
    for row, positions in ((0, 300), (1, 130), (2, 5)):
        assert cache.ensure(row, positions)
    cache.flush()
    cache.release(1)
    assert cache.ensure(3, 200)
    torch.cuda.set_sync_debug_mode("error")
    try:
        cache.flush()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for row in range(4):
        held = cache.row_pages[row]
        assert cache.page_table[row, : len(held)].tolist() == held and not cache.page_table[row, len(held):].any()
        assert cache.owner[held].tolist() == [row] * len(held)
        assert cache.logical[held].tolist() == list(range(len(held)))
    assert int((cache.owner >= 0).sum()) == sum(len(p) for p in cache.row_pages)


@cuda
def test_rows_that_stop_or_are_freed_queue_their_flags_without_waiting_cuda() -> None:
    """A row that stops (its alive flag) or is freed (its position) reaches the device in fills queued behind the
    step on its way: one element written from the host would wait for that step. The flags land before the next
    forward reads them."""
    stream = Stream(BatchedTarget(tiny().cuda()), STOPS, max_len=120, rows=4, attention="flex")
    for i, p in enumerate(prompts(4, 3, 20, seed=9)):
        stream.submit(i, p, 50)
    stream.poll()
    stream.poll()  # a step is on its way
    live = [r for r in range(4) if stream.request[r] is not None]
    assert live and stream.launched is not None
    torch.cuda.set_sync_debug_mode("error")
    try:
        for row in live:
            stream._preempt(row)  # stops serving (alive) and frees the row (pos)
        stream._apply_row_flags()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stream.alive[live].tolist() == [0] * len(live) and stream.pos[live].tolist() == [0] * len(live)
    assert not stream.stopped_rows and not stream.freed_rows


@cuda
def test_a_prefill_is_launched_without_waiting_and_its_first_tokens_come_with_the_next_step_cuda() -> None:
    """A prefill queues its inputs, forward, picks and their copies to the host without a synchronising call, its
    rows go live at once, and the next step takes its first tokens (waiting for them would idle the device); the
    answers are greedy's."""
    model = tiny().cuda()
    ps = prompts(8, 3, 30, seed=10)
    stream = Stream(BatchedTarget(model), STOPS, max_len=120, rows=8, attention="flex")
    for i, p in enumerate(ps[:4]):
        stream.submit(i, p, 20)
    answers = dict(stream.poll())  # the first prefill (its compiles) and decode step
    for i, p in enumerate(ps[4:], 4):
        stream.submit(i, p, 20)
    torch.cuda.set_sync_debug_mode("error")
    try:
        stream._admit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stream.firsts and stream.live == 8 and all(not stream.tokens[r] for r, _ in stream.firsts[0].rows)
    stream.step()
    assert not stream.firsts and all(stream.tokens[r] or stream.request[r] is None for r in range(4, 8))
    while stream.busy:
        answers.update(stream.poll())
    for i, p in enumerate(ps):
        assert (answers[i].tokens, answers[i].finish_reason) == plain_greedy(model, p, 20)


@cuda
def test_the_compiled_layer_pieces_give_the_eager_forward_and_stay_compiled_cuda() -> None:
    """A prefill, a suffix over cached pages and decode steps of a few batch sizes with the pieces compiled: the
    logits of the same forwards with the pieces off (eager), and the pieces still on after every shape."""
    torch.manual_seed(0)
    model = tiny().cuda()
    out = {}
    for name in ("compiled", "eager"):
        t = BatchedTarget(model)
        if name == "eager":
            t.pieces.state = "off: the reference"
        cache = t.new_paged_cache(rows=8, pages=40, max_len=512, attention="flex")
        got = []
        for b, width in ((8, 40), (3, 7)):
            for r in range(b):
                assert cache.ensure(r, 200)
            ids = torch.randint(0, 100, (b, width), device="cuda", generator=torch.Generator("cuda").manual_seed(b))
            pos = torch.arange(width, device="cuda")[None].expand(b, width).contiguous()
            at = torch.full((b,), width - 1, device="cuda")
            got.append(t.forward(cache, torch.arange(b, device="cuda"), ids, pos, fresh=True, logits_at=at).logits)
            got.append(t.forward(cache, torch.arange(b, device="cuda"), ids, pos + width, fresh=False,
                                 logits_at=at).logits)
            got.append(t.forward(cache, slice(0, b), ids[:, :1], pos[:, :1] + 2 * width, fresh=False,
                                 logits_at=torch.zeros(b, dtype=torch.long, device="cuda")).logits)
        out[name] = got
        if name == "compiled":
            assert t.pieces.state == "compiled"
    for a, b in zip(out["compiled"], out["eager"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

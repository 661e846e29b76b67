"""The regeneration stream's decode step at fixed live rows and context, on one GPU: time, kernels, bandwidth.

    python bench/decode_step.py                                    # one H200 -> "decode_step"
    python bench/decode_step.py --device cpu --rows 4 --context 100 --layers 2 --steps 2   # plumbing only

Why: in a multi-turn regeneration a full-batch decode step (hundreds of live rows) is most of the engine's decode
time, and inside the engine its cost mixes with the host's. This measures that step alone, on a random-weight target
of SmolLM2-135M's shape (30 layers, 9 query and 3 key/value heads of 64; weights do not change a step's time), every
row holding --context cached positions in pages of the shared pool, as in the engine:

- ``graph_ms``: the step replayed from its CUDA graph (``engine.decode_graphs``, what the engine runs), median of
  --steps replays timed with CUDA events; ``eager_ms`` the same step run eagerly;
- the eager step's kernels by class (bench/kernel_profile.py), and ``kv_gb_per_s``: the cache bytes a step must
  read (rows x context x key and value bytes per position) over the attention kernels' ms: how close the
  attention comes to the H200's ~4.8 TB/s;
- ``stream``: the same rows and context inside the engine (``Stream``, decode steps one ahead of the host), the wall
  ms a step costs there, and the stream's split of it: against ``graph_ms``, what the host adds or hides;
- each configuration twice, with the decode block mask's full pages read without the mask (``full_blocks``, the
  engine's default) and with the mask on every page; with --autotune a third time, full blocks with the decode
  kernel compiled under ``max-autotune-no-cudagraphs`` (Inductor times its block sizes, warps and stages for the
  shape, where the engine takes the defaults: whether the attention has headroom below the H200's ~4.8 TB/s).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from bench.kernel_profile import kernel_times, summarize
from bench.random_smollm2 import SMOLLM2, random_smollm2
from bench.results import record
from common.step_clock import StepClock
from engine.attention import compile_flex_decode
from engine.batched import BatchedTarget
from engine.continuous_batching import Stream
from engine.decode_graphs import DecodeGraphs
from engine.kv_cache import PAGE
from engine.profile import EngineProfile


def random_target(layers: int, device: torch.device, dtype: torch.dtype) -> BatchedTarget:
    return BatchedTarget(random_smollm2(layers, device, dtype))


def timed(step, steps: int, cuda: bool) -> float:
    """Median ms of ``steps`` calls, each timed on its own (``StepClock``)."""
    out = []
    for _ in range(steps):
        clock = StepClock(cuda)
        clock.mark()
        step()
        clock.mark()
        out.append(clock.spans_ms()[0])
    return statistics.median(out)


def measure(target: BatchedTarget, rows: int, context: int, full_blocks: bool, steps: int,
            autotune: bool = False) -> dict:
    """One configuration: a fresh pool holding ``context`` positions for each of ``rows`` rows. Compiled kernels
    are dropped first: every configuration is a new shape, and past dynamo's recompile limit (8) the decode kernel
    would run uncompiled (flex's unfused fallback, which materialises scores over the whole pool), as it did in
    this bench's first run. The engine itself compiles one shape per padded batch size over one pool."""
    torch._dynamo.reset()
    # the engine's own compile of the decode kernel, or the autotuned one in its place for this run
    compile_flex_decode("max-autotune-no-cudagraphs" if autotune else None)
    dev = target.device
    pages = rows * -(-(context + 1) // PAGE) + 1
    cache = target.new_paged_cache(rows, pages, max_len=-(-(context + 1) // PAGE) * PAGE, attention="flex")
    cache.full_blocks = full_blocks
    for r in range(rows):
        assert cache.ensure(r, context + 1)
    ids = torch.randint(0, target.embed.weight.shape[0], (rows,), device=dev)
    positions = torch.full((rows,), context, dtype=torch.long, device=dev)
    graphs = DecodeGraphs(target, cache, ids, positions)
    cuda = dev.type == "cuda"
    graphs.logits(rows)  # the first flex step runs eagerly (and compiles this shape)
    graph_ms = timed(lambda: graphs.logits(rows), steps, cuda) if graphs.on else None
    eager_ms = timed(lambda: graphs._eager(rows), steps, cuda)
    prof = summarize(kernel_times(lambda: graphs._eager(rows), 2), top=8)
    attention_ms = prof["by_class_ms"].get("attention")
    kv_bytes = rows * (context + 1) * target.kv_bytes_per_token()
    return {"rows": rows, "context": context, "full_blocks": full_blocks, "autotune": autotune,
            "graph_ms": graph_ms and round(graph_ms, 3), "eager_ms": round(eager_ms, 3),
            "graph_fallback": graphs.fallback,
            "tokens_per_s_graph": graph_ms and round(rows / graph_ms * 1e3, 1),
            "kv_gb_per_step": round(kv_bytes / 1e9, 3),
            "kv_gb_per_s": round(kv_bytes / 1e9 / (attention_ms / 1e3), 1) if attention_ms else None, **prof}


def stream_steps(target: BatchedTarget, rows: int, context: int, steps: int) -> dict:
    """The same step inside the engine: a ``Stream`` with ``rows`` requests of ``context`` random prompt tokens
    (no stop token, no loop check), every row live; after its prefill and a few steps, ``steps`` polls timed end to
    end. ``ms`` is the wall time a step costs the engine (the host's bookkeeping and the device's forward, which
    the stream overlaps: ``Stream.step``), beside the stream's own split of it (``decode_s`` the host's launch and
    wait, ``decode_device_s`` the device's; booked when a step's tokens are read, one step after its launch, so the
    split lags the wall time by a step: --steps 20 keeps that small)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(rows)
    vocab = target.embed.weight.shape[0]
    max_len = context + steps + 16
    # every row's pages and the admission's reserve (a quarter page a live row), so that all rows are admitted
    pages = 1 + rows * (-(-max_len // PAGE) + 1)
    profile = EngineProfile()
    stream = Stream(target, [], max_len=max_len, rows=rows, wanted=rows, pages=pages, attention="flex",
                    profile=profile)
    for i in range(rows):
        stream.submit(i, torch.randint(0, vocab, (context,), generator=g).tolist(), steps + 12)
    for _ in range(rows):  # each poll prefills what fits its token budget
        if not stream.waiting:
            break
        stream.poll()
    if stream.live < rows:
        raise RuntimeError(f"decode_step: {stream.live} of {rows} rows admitted with {pages} pages")
    for _ in range(4):  # the first steps compile, capture and warm the graph
        stream.poll()
    timing = profile.times

    def split() -> tuple[float, float, float]:  # the host's decode, the device's decode, the engine's own host work
        return (timing.decode_s, timing.decode_device_s,
                timing.poll_s - timing.prefill_s - timing.decode_s)

    before = split()
    t0 = time.perf_counter()
    for _ in range(steps):
        stream.poll()
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    host_decode, device, host_own = ((a - b) / steps * 1e3 for a, b in zip(split(), before, strict=True))
    stats = stream.decode.stats()
    return {"ms": round(wall / steps * 1e3, 3), "tokens_per_s": round(rows * steps / wall, 1),
            "host_decode_ms": round(host_decode, 3), "device_ms": round(device, 3),
            "engine_host_ms": round(host_own, 3), "graph_steps": stats["graph_steps"],
            "graph_fallback": stats["graph_fallback"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 512, 2048])
    ap.add_argument("--context", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--autotune", action="store_true", help="also full blocks with the kernel autotuned")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    target = random_target(args.layers, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    runs = []
    for context in args.context:
        for rows in args.rows:
            variants = [(True, False), (False, False)] + ([(True, True)] if args.autotune else [])
            for full_blocks, autotune in variants:
                runs.append(measure(target, rows, context, full_blocks, args.steps, autotune))
                r = runs[-1]
                if full_blocks and not autotune:
                    r["stream"] = stream_steps(target, rows, context, args.steps)
                    print(f"rows {rows} context {context} in the stream: {r['stream']}", flush=True)
                print(f"rows {rows} context {context} full_blocks {full_blocks} autotune {autotune}: graph "
                      f"{r['graph_ms']} ms, eager {r['eager_ms']} ms, kernels {r['kernel_ms']} ms "
                      f"{r['by_class_ms']}, KV {r['kv_gb_per_s']} GB/s",
                      flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    record("decode_step", {"model": "SmolLM2-135M shape, random weights", "layers": args.layers,
                           "kv_bytes_per_token": target.kv_bytes_per_token(), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The regeneration stream's prefill forwards at fixed shapes, on one GPU: the host's time, the device's, kernels.

    python bench/prefill_step.py                                  # one H200 -> "prefill_step"
    python bench/prefill_step.py --device cpu --layers 2 --shapes 2x8+0 2x8+16 --repeats 2   # plumbing only
    python bench/prefill_step.py --inductor cpp_wrapper=True      # an inductor setting -> "prefill_step_inductor"

Why: in a multi-turn regeneration (``"regenerate"``) a continuation prefill, a next turn's new tokens attending over
the pages its conversation already holds, is a few thousand tokens that a GPU computes in a few ms, yet the
forwards, hundreds of them, can hold a large share of the engine's seconds. This runs such forwards alone, as the engine
calls them (``Stream._prefill``: the rows' suffixes right-padded, padded again to ``prefill_shape``; logits at each
row's last token), on a random-weight target of SmolLM2-135M's shape, over a pool where every row holds its prefix's
pages:

- a shape ``RxW+P``: R rows, W new tokens each, after P cached positions (P = 0: a fresh prefill; every prefill
  runs the suffix kernel, flex attention over the row's pages, a fresh one after an empty prefix, as the engine
  runs them; ``kernel`` says which ran);
- ``first_ms``: the first forward at that shape, wall, synchronised (a compile or a cuDNN plan shows here);
  ``again_ms``: the median of --repeats more; ``host_ms``: how long the call takes to return (the launches: when it
  is close to ``again_ms`` the host, not the device, bounds the forward); ``kernel_ms`` and ``by_class_ms``: the
  device's kernels, ``host_top`` and ``launches``: the host's own ops and regions (guards, the compiled wrapper,
  eager ops) and kernel launches a forward (bench/kernel_profile.py); ``first_compile_s``: dynamo's compile
  seconds by phase in the first call (``compile_guard.compile_seconds``);
- ``--inductor KEY=VALUE`` (repeatable): the same forwards with inductor's config changed (``cpp_wrapper=True``:
  its generated wrapper in C++ rather than Python, against the host time of the compiled calls), recorded as
  ``"prefill_step_inductor"`` with the settings beside them, so a run of each in one device call compares them.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from typing import Any

import torch

from bench.kernel_profile import host_times, kernel_times, summarize
from bench.random_smollm2 import SMOLLM2, random_smollm2
from bench.results import record
from bench.wall_clock import synced
from common.compile_guard import compile_seconds
from engine.attention import flex_kind, prefill_shape
from engine.batched import BatchedTarget
from engine.kv_cache import PAGE

# 26x129+650: the bench's average continuation forward (rows per forward, the padded width, a prefix); 26x60+650: a
# shorter suffix, padded to the same width (its second query block all padding); the others bracket them; 16x512+0
# and 64x256+0: first turns
DEFAULT_SHAPES = ["16x512+0", "64x256+0", "26x60+650", "26x129+650", "26x256+1500", "128x129+650", "8x129+3000"]
SHAPE_RE = re.compile(r"^(\d+)x(\d+)\+(\d+)$")


def parse_inductor_setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> (key, value) for ``torch._inductor.config``: the value as JSON (``true``, ``1``) or Python
    (``True``), else the text; a key inductor does not have is an error naming it."""
    import torch._inductor.config as inductor_config

    key, sep, raw = text.partition("=")
    if not sep or not hasattr(inductor_config, key):
        raise argparse.ArgumentTypeError(f"--inductor {text!r}: want KEY=VALUE with KEY a torch._inductor.config "
                                         f"setting (e.g. cpp_wrapper=True)")
    for parse in (json.loads, ast.literal_eval):
        try:
            return key, parse(raw)
        except (ValueError, SyntaxError):
            pass
    return key, raw


def parse_shape(text: str) -> tuple[int, int, int]:
    """``RxW+P`` -> (rows, width, prefix)."""
    m = SHAPE_RE.match(text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: want ROWSxWIDTH+PREFIX, e.g. 26x129+650")
    return int(m[1]), int(m[2]), int(m[3])


def forward_call(target: BatchedTarget, rows: int, width: int, prefix: int):
    """The engine's prefill of ``rows`` rows holding ``prefix`` positions each, ``width`` new tokens a row, as a
    function of no arguments, over a fresh pool sized for them; and the attention it runs (``flex_kind``)."""
    dev = target.device
    continued = prefix > 0
    b, w = prefill_shape(rows, width)
    per_row = -(-(prefix + w + 1) // PAGE)
    cache = target.new_paged_cache(b, 1 + b * per_row, max_len=per_row * PAGE, attention="flex")
    for r in range(b):
        assert cache.ensure(r, prefix + w + 1)
    g = torch.Generator().manual_seed(rows * 7919 + width)
    ids = torch.randint(0, target.embed.weight.shape[0], (b, w), generator=g).to(dev)
    positions = (prefix + torch.arange(w))[None].expand(b, w).contiguous().to(dev)
    index = torch.arange(b, device=dev)
    at = torch.full((b,), width - 1, device=dev)  # each row's last real token; the rest of w is padding

    def call() -> torch.Tensor:
        return target.forward(cache, index, ids, positions, fresh=not continued, logits_at=at, lengths=at + 1).logits

    kind = flex_kind(cache, index, ids, fresh=not continued)
    return call, f"{kind} (flex)" if kind else "fresh (sdpa)"


def measure(target: BatchedTarget, shape: tuple[int, int, int], repeats: int) -> dict:
    rows, width, prefix = shape
    call, kernel = forward_call(target, rows, width, prefix)
    compiled_before = compile_seconds(top=100)
    first = synced(call, target.device).finished_s * 1e3
    compiled = {name: round(s - compiled_before.get(name, 0.0), 3) for name, s in compile_seconds(top=100).items()}
    runs = [synced(call, target.device) for _ in range(repeats)]
    again = statistics.median(r.finished_s for r in runs) * 1e3
    prof = summarize(kernel_times(call, 2), top=8)
    host = host_times(call, 2)
    padded = prefill_shape(rows, width)
    return {"shape": f"{rows}x{width}+{prefix}", "rows": rows, "width": width, "prefix": prefix,
            "padded": list(padded), "kernel": kernel,
            "first_ms": round(first, 3), "again_ms": round(again, 3),
            "host_ms": round(statistics.median(r.returned_s for r in runs) * 1e3, 3),
            "tokens_per_s": round(rows * width / again * 1e3, 1),
            "first_compile_s": dict(sorted(((n, v) for n, v in compiled.items() if v >= 0.05),
                                           key=lambda nv: -nv[1])[:8]),
            **prof, **host}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=parse_shape, nargs="+", default=[parse_shape(s) for s in DEFAULT_SHAPES])
    ap.add_argument("--layers", type=int, default=SMOLLM2["num_hidden_layers"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--inductor", type=parse_inductor_setting, action="append", default=[], metavar="KEY=VALUE",
                    help="a torch._inductor.config setting for this run's compiles (repeatable)")
    args = ap.parse_args(argv)
    settings = dict(args.inductor)
    import torch._inductor.config as inductor_config

    for key, value in settings.items():
        setattr(inductor_config, key, value)
    device = torch.device(args.device)
    target = BatchedTarget(random_smollm2(args.layers, device, torch.bfloat16 if device.type == "cuda"
                                          else torch.float32))
    runs = []
    for shape in args.shapes:
        runs.append(measure(target, shape, args.repeats))
        r = runs[-1]
        print(f"{r['shape']} ({r['kernel']}): first {r['first_ms']} ms, again {r['again_ms']} ms, "
              f"host {r['host_ms']} ms, kernels {r['kernel_ms']} ms {r['by_class_ms']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    figures = {"model": "SmolLM2-135M shape, random weights", "layers": args.layers, "runs": runs}
    if settings:
        figures["inductor_config"] = settings
    record("prefill_step_inductor" if settings else "prefill_step", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

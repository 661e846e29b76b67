"""The target's right-padded forward (online training's, capture's) over batches of shapes it has not seen, by how
it runs: the first call at each shape and the second, on one GPU.

    python bench/target_forward.py                                            # one H200 -> "target_forward"
    python bench/target_forward.py --device cpu --layers 2 --tokens 96 --lengths 16 32 --dtype float32   # plumbing

Why: in the training loop the online target's forward took 117 ms a step beside the drafter's 160 (issue #20, the
loop against the bench), though it ran ~35 ms at a shape it had seen. A token-budget loop meets new shapes step
after step (rows x padded length), and cuDNN's attention builds a plan for each. This measures, on a random-weight
target of SmolLM2-135M's shape (weights do not change the time), --tokens tokens a batch at each of --lengths, each
length a new shape to each way of running (its own row count):

- ``cudnn_allowed``: the forward with SDPA choosing its backend (cuDNN allowed): what ran before;
- ``no_cudnn``: SDPA without cuDNN (``target_model.hf_model.RIGHT_PADDED_SDPA``), eager layers;
- ``compiled``: that, with the decoder layers compiled (``target_model.compiled_layers``): what the loop and capture run
  on CUDA. Its first calls include the compiles (a few graphs for all shapes).

Figures per way: the median ms of the first and of the second call at each shape (wall, synchronised), and the
second calls' speed-up of ``compiled`` over ``no_cudnn``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.random_smollm2 import random_smollm2  # noqa: E402
from bench.results import record  # noqa: E402
from bench.wall_clock import synced  # noqa: E402
from common.dtypes import torch_dtype  # noqa: E402
from target_model.aux_layers import default_aux_layer_ids  # noqa: E402
from target_model.hf_model import RIGHT_PADDED_SDPA, TargetModel  # noqa: E402

NAME = "target_forward"
WAYS = ("cudnn_allowed", "no_cudnn", "compiled")


def smollm2_shaped(layers: int, device: torch.device, dtype: torch.dtype) -> TargetModel:
    return TargetModel(random_smollm2(layers, device, dtype), tokenizer=None, name="random SmolLM2-135M shape",
                       source_dir=None)


def forward_by_way(target: TargetModel, way: str, aux_ids: tuple[int, ...]) -> Callable[[torch.Tensor], Any]:
    def plain(ids: torch.Tensor) -> Any:
        return target.forward(ids, aux_ids, logits=False)

    def without_cudnn(ids: torch.Tensor) -> Any:
        with sdpa_kernel(list(RIGHT_PADDED_SDPA)):
            return plain(ids) if way == "no_cudnn" else target.compiled_layers.run(lambda: plain(ids))

    return plain if way == "cudnn_allowed" else without_cudnn


def measure(target: TargetModel, tokens: int, lengths: list[int], device: torch.device) -> dict[str, Any]:
    """Each way meets each length as a new shape: ``tokens // length + i`` rows for the i-th way."""
    n = target.num_layers  # a plumbing run's few layers: the first ones
    aux_ids = default_aux_layer_ids(n) if n >= 6 else tuple(range(min(3, n)))
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for i, way in enumerate(WAYS):
        fn = forward_by_way(target, way, aux_ids)
        first, again = [], []
        for length in lengths:
            ids = torch.randint(0, target.vocab_size, (max(1, tokens // length) + i, length), generator=g).to(device)
            first.append(round(synced(lambda f=fn, x=ids: f(x), device).finished_s * 1e3, 2))
            again.append(round(synced(lambda f=fn, x=ids: f(x), device).finished_s * 1e3, 2))
        out[way] = {"first_ms_median": round(statistics.median(first), 2),
                    "again_ms_median": round(statistics.median(again), 2),
                    "first_ms": first, "again_ms": again}
    out["compiled_state"] = target.compiled_layers.state
    out["again_speedup_compiled_over_no_cudnn"] = round(
        out["no_cudnn"]["again_ms_median"] / out["compiled"]["again_ms_median"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens a batch (the loop's train.batch_tokens)")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(range(1280, 4097, 128)),
                    help="padded lengths, each a new shape")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    target = smollm2_shaped(args.layers, device, torch_dtype(args.dtype))
    figures = measure(target, args.tokens, args.lengths, device)
    record(NAME, {"model": target.name, "layers": args.layers, "dtype": args.dtype, "tokens": args.tokens,
                  "lengths": args.lengths, **figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The real training loop against bench/train_throughput.py's step at the same drafter and tokens per step.

    python bench/train_loop.py --config configs/smollm2-135m-h200.yaml \
        --conversations runs/smollm2-h200/conversations.jsonl           # one GPU -> "train_loop_smollm2"

``python -m train`` runs --steps steps of the config's training (its source: online for the H200 config) on the
first --samples conversations, with no held-out split and no evaluation or saves before its last step;
loop_tokens_per_s is the median of its per-step tokens/s (train_log.jsonl: padded tokens, as the loop counts
them) after --skip warm-up steps (compilation), loop_real_tokens_per_s the same of its real (unpadded) tokens.
Then, in this process, the bench step of the drafter that loop trains (shape from the config's target, its draft
vocab and TTT length) on batch_tokens // --seq rows of --seq tokens, eager as the loop runs it, synthetic inputs:
bench_tokens_per_s. ratio = loop / bench (the bar: at least 0.85): what the loop costs beyond the step; ratio_real
counts the loop's real tokens only, so its padding costs too.

What stays in the loop's figure and not in the bench's: the online target forward for every batch (none from a
store), data loading and collation, variable-length batches padded to a multiple of 16 (most hold fewer tokens
than batch_tokens: loop_real_tokens_per_step), the non-finite checks, logging's reductions and the LR schedule.
The loop runs first, so this process holds no GPU memory while it does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from bench.results import record
from bench.runs import make_run, median_tokens_per_s, run, step_records, train_command
from bench.train_throughput import bench, shape_figures
from common.config import RunConfig, load_config
from drafter.model import DrafterShape
from target_model.aux_layers import resolve_aux_layer_ids
from target_model.hf_model import target_text_config
from train.build import fresh_shape

NAME = "train_loop_smollm2"
BAR = 0.85


def drafter_shape(cfg: RunConfig) -> DrafterShape:
    """The fresh drafter the loop trains for this config (train.build.fresh_shape; the aux ids name layers
    only: they cost nothing)."""
    hf = target_text_config(cfg.target)
    return fresh_shape(cfg, hf, resolve_aux_layer_ids(cfg.target.aux_layer_ids, None, hf.num_hidden_layers))


def loop_figures(run_dir: Path, skip: int) -> dict[str, Any]:
    """The median over the same steps of tokens/s (padded), of real (unpadded) tokens per step, and of the ms a step
    spent in the target's forward and in the drafter's forward and backward (the log's ``target_ms``,
    ``drafter_ms``: what the loop pays beside the bench's step, and the step itself)."""
    records = step_records(run_dir)
    seen = [0] + [r["tokens_seen"] for r in records]  # a run from step 0: --resume never
    real = [b - a for a, b in pairwise(seen)]
    first = min(skip, len(records) - 1)
    kept = records[first:]
    return {"loop_tokens_per_s": round(median_tokens_per_s(run_dir, skip), 1), "loop_steps": len(real),
            "loop_real_tokens_per_s": round(statistics.median(r["real_tokens_per_s"] for r in kept), 1),
            "loop_real_tokens_per_step": statistics.median(real[first:]),
            "loop_target_ms": statistics.median(r["target_ms"] for r in kept),
            "loop_drafter_ms": statistics.median(r["drafter_ms"] for r in kept)}


def measure(base_config: str, conversations: Path, out: Path, steps: int, skip: int, samples: int, seq: int,
            bench_steps: int, bench_warmup: int) -> dict[str, Any]:
    """The loop (a child process), then the bench step here: the "train_loop_smollm2" figures."""
    config = make_run(base_config, out, conversations, [
        f"train.max_steps={steps}", f"train.max_train_samples={samples}", "train.holdout_fraction=0.0",
        "train.eval_every=100000", "train.save_every=100000", "train.save_at=[]", "tracking.report_to=none"])
    cfg = load_config(config)
    if cfg.drafter.init_from:
        raise ValueError("drafter.init_from keeps its checkpoint's shape: measure a fresh drafter's loop")
    batch_tokens, ttt = cfg.train.batch_tokens, cfg.train.ttt_length
    if batch_tokens % seq:
        raise ValueError(f"--seq {seq} does not divide train.batch_tokens {batch_tokens}")
    run([*train_command(config), "--resume", "never"], log=out / "train.log")
    loop = loop_figures(out, skip)
    shape = drafter_shape(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    step = bench(shape, batch_tokens // seq, seq, ttt, bench_steps, bench_warmup, device, False)
    return {**loop, "bench_tokens_per_s": step["tokens_per_s"],
            "ratio": round(loop["loop_tokens_per_s"] / step["tokens_per_s"], 3), "bar": BAR,
            "ratio_real": round(loop["loop_real_tokens_per_s"] / step["tokens_per_s"], 3),
            "compared": {"config": base_config, "source": cfg.train.source, "shape": shape_figures(shape),
                         "ttt_length": ttt, "batch_tokens": batch_tokens, "bench_batch": batch_tokens // seq,
                         "bench_seq": seq, "skip": skip, "samples": samples,
                         "loop_only": "target forward (online), data loading, padded variable-length batches, "
                                      "non-finite checks, logging reductions, LR schedule"},
            "bench_raw": step}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--conversations", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-train-loop"), help="the loop's run dir")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=10, help="the loop's warm-up steps, left out of its median")
    ap.add_argument("--samples", type=int, default=2000, help="train on the first N conversations")
    ap.add_argument("--seq", type=int, default=2048, help="the bench step's row length")
    ap.add_argument("--bench-steps", type=int, default=20)
    ap.add_argument("--bench-warmup", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        figures = measure(args.config, args.conversations, args.out.resolve(), args.steps, args.skip, args.samples,
                          args.seq, args.bench_steps, args.bench_warmup)
    except ValueError as e:
        print(f"train_loop: {e}", file=sys.stderr)
        return 2
    record(NAME, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

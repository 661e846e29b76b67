"""Both GPUs of a node against one: DDP training.

    python bench/ddp_scaling.py --config configs/smollm2-135m-h200.yaml \
        --conversations runs/smollm2-h200/conversations.jsonl

The same online training (first --samples conversations, --steps steps) on one GPU accumulating 2 batches
per step and on two GPUs with DDP (one batch each): the same global batches, so the per-step losses must
agree (max_rel_loss_diff; --precision no makes that exact up to summation order) and train_speedup_2gpu
compares tokens/s. Writes the training fields of bench/results.json "ddp_scaling"; its regeneration fields
(regenerate_speedup_2gpu: the regenerate command end to end on one GPU and on two) come from
``bench/regenerate_throughput.py --gpus 1 2`` and are kept.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.results import record
from bench.runs import make_run, median_tokens_per_s, run, step_records, train_command


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--conversations", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-ddp"))
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", default="no", choices=["no", "bf16"])
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("ddp_scaling needs 2 GPUs", file=sys.stderr)
        return 2

    common = ["train.source=online", f"train.max_train_samples={args.samples}", f"train.max_steps={args.steps}",
              f"train.mixed_precision={args.precision}", "train.holdout_fraction=0.0", "train.eval_every=100000",
              "train.save_every=100000", "train.log_every=100000", "tracking.report_to=none"]
    single = make_run(args.config, args.out / "one-gpu", args.conversations, [*common, "train.grad_accum=2"])
    double = make_run(args.config, args.out / "two-gpus", args.conversations, common)
    run([*train_command(single), "--resume", "never"], env={"CUDA_VISIBLE_DEVICES": "0"},
        log=args.out / "one-gpu.log")
    run([*train_command(double, gpus=2, precision=args.precision), "--resume", "never"],
        log=args.out / "two-gpus.log")
    a, b = step_records(args.out / "one-gpu"), step_records(args.out / "two-gpus")
    rel = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b, strict=True))
    tps1, tps2 = median_tokens_per_s(args.out / "one-gpu"), median_tokens_per_s(args.out / "two-gpus")
    record("ddp_scaling", {
        "train_tokens_per_s_1gpu": round(tps1, 1), "train_tokens_per_s_2gpu": round(tps2, 1),
        "train_speedup_2gpu": round(tps2 / tps1, 3), "train_steps": len(a), "train_precision": args.precision,
        "train_source": "online", "max_rel_loss_diff": rel,
        "losses_1gpu": [x["loss"] for x in a], "losses_2gpu": [y["loss"] for y in b]}, merge=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Online training against training from the capture store, on the same GPU and the same batches.

    python bench/online_vs_offline.py --config configs/smollm2-135m-h200.yaml \
        --conversations runs/smollm2-h200/conversations.jsonl

The first --convs regenerated conversations are captured into a store (timed; its bytes/token are what
online training saves on disk), then trained --steps steps from the store and --steps steps online (the
target runs on the training GPU for every batch). tokens_per_s_ratio = online / offline (medians after
warm-up); max_abs_loss_diff compares the per-step losses. Both train in the config's precision, or with --fp32
the target, the store and training all in fp32, where the two must agree up to summation order (the CPU test
of that is tests/test_train_online.py). Writes "online_vs_offline".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.results import record
from bench.runs import make_run, median_tokens_per_s, run, step_records, train_command
from data_prep.store import read_manifest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--conversations", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-online"))
    ap.add_argument("--convs", type=int, default=600)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--fp32", action="store_true", help="target, store and training in fp32 (the exactness check)")
    args = ap.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    subset = args.out / "conversations.jsonl"
    with open(args.conversations) as src, open(subset, "w") as dst:
        for i, line in enumerate(src):
            if i >= args.convs:
                break
            dst.write(line)
    common = [f"train.max_steps={args.steps}", "train.holdout_fraction=0.0", "train.eval_every=100000",
              "train.save_every=100000", "train.log_every=100000", "tracking.report_to=none"]
    if args.fp32:
        common += ["target.dtype=float32", "capture.dtype=float32", "train.mixed_precision=no"]
    offline = make_run(args.config, args.out / "store", subset, [*common, "train.source=store"])
    online = make_run(args.config, args.out / "online", subset, [*common, "train.source=online"])
    start = time.perf_counter()
    run([sys.executable, "-m", "data_prep", "capture", "--config", str(offline)], log=args.out / "capture.log")
    capture_s = time.perf_counter() - start
    totals = read_manifest(args.out / "store" / "store")["totals"]
    run([*train_command(offline), "--resume", "never"], env={"CUDA_VISIBLE_DEVICES": "0"}, log=args.out / "store.log")
    run([*train_command(online), "--resume", "never"], env={"CUDA_VISIBLE_DEVICES": "0"}, log=args.out / "online.log")
    a, b = step_records(args.out / "store"), step_records(args.out / "online")
    off, on = median_tokens_per_s(args.out / "store"), median_tokens_per_s(args.out / "online")
    record("online_vs_offline", {
        "precision": "fp32" if args.fp32 else "config", "conversations": args.convs, "steps": len(a),
        "store_tokens": totals["tokens"],
        "store_bytes_per_token": round(totals["bytes"] / totals["tokens"], 1), "capture_seconds": round(capture_s, 1),
        "tokens_per_s_offline": round(off, 1), "tokens_per_s_online": round(on, 1),
        "tokens_per_s_ratio": round(on / off, 3),
        "max_abs_loss_diff": max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))})
    return 0


if __name__ == "__main__":
    sys.exit(main())

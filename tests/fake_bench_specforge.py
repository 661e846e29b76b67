#!/usr/bin/env python3
"""Stands in for ../shared/peer-bench/bench_specforge.py in CPU tests: the same arguments, the same
``--out/results.jsonl`` rows (an ``env`` row, then a ``train_step`` row per shape with every field the real
``run_one`` writes, or an ``error`` row) appended as it appends them, and the same stdout (timestamped log
lines, then a SUMMARY table). No torch, no GPU: the step time comes from FAKE_STEP_S.

FAKE_STEP_S (default 0.234): the median step in seconds; FAKE_ERROR: write an error row instead (the real
script catches a failed shape and exits 0); FAKE_HIDDEN: report another hidden size (a shape that differs).
"""

import argparse
import json
import os
import time

T0 = time.time()
SHAPES = {"kimi": dict(hidden=7168, inter=18432, heads=64, kv_heads=64, head_dim=128, vocab=163840,
                       draft_vocab=32000, rope_theta=50000.0)}


def log(*a):
    print(f"[{time.time() - T0:7.1f}s]", *a, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="kimi,llama8b")
    ap.add_argument("--backends", default="flex_attention,sdpa")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-matmul", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    jpath = os.path.join(args.out, "results.jsonl")

    def emit(d):
        with open(jpath, "a") as f:
            f.write(json.dumps(d) + "\n")

    vers = dict(torch="2.11.0", transformers="5.17.0", triton="3.6.0", python="3.12.3", specforge="0.2.0",
                gpu="NVIDIA H200", sms=132, cuda="13.0")
    emit({"kind": "env", **vers, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")})
    log("env", vers)
    rows = []
    for shape_name in args.shapes.split(","):
        backend = args.backends.split(",")[0]
        log(f"=== {shape_name} / {backend} ===")
        if os.environ.get("FAKE_ERROR"):
            err = os.environ["FAKE_ERROR"]
            log(f"ERROR {shape_name}/{backend}: {err}\nTraceback ...")
            emit({"kind": "train_step", "shape": shape_name, "backend": backend, "error": err,
                  "traceback": "Traceback ..."})
            continue
        s = dict(SHAPES[shape_name], hidden=int(os.environ.get("FAKE_HIDDEN", SHAPES[shape_name]["hidden"])))
        med = float(os.environ.get("FAKE_STEP_S", "0.234"))
        tok = args.batch * args.seq
        r = dict(shape=shape_name, backend=backend, seq_len=args.seq, batch=args.batch, ttt=args.ttt,
                 warmup_steps=args.warmup, timed_steps=args.steps, **s, trainable_params=1_201_000_000,
                 frozen_params_draft=1_174_405_120, target_head_params=1_174_405_120, build_s=4.2,
                 warmup_wall_s=[40.0] + [med] * (args.warmup - 1), first_step_s_incl_compile=40.0,
                 step_times_s=[med] * args.steps,
                 phase_median_s={"forward_loss": 0.082, "backward": 0.112, "optimizer_step": 0.041},
                 pipelined_mean_step_s=med, median_step_s=med, min_step_s=med, max_step_s=med,
                 tokens_per_s=tok / med, losses=[10.0] * args.steps, acc_step0_last=[0.0] * args.ttt,
                 peak_mem_GiB=31.0, peak_reserved_GiB=33.0, flops_per_step=6.0e13, flops_executed=5.5e13,
                 param_breakdown={}, mfu_per_step=0.55, mfu_executed=0.5, tflops_per_step=430.0,
                 position_mask_frac=0.93, kind="train_step")
        emit(r)
        rows.append(r)
        log(f"{shape_name}/{backend}: median {med * 1e3:.1f} ms, {r['tokens_per_s']:.0f} tok/s")
    print("\nSUMMARY")  # the real table, column for column
    print(f"{'shape':8} {'backend':15} {'median ms':>10} {'tok/s':>8} {'TFLOP/step':>10} "
          f"{'MFU per_step':>9} {'MFU exec':>9} {'peak GiB':>8} {'1st step s':>10}")
    for r in rows:
        print(f"{r['shape']:8} {r['backend']:15} {r['median_step_s']*1e3:10.1f} "
              f"{r['tokens_per_s']:8.0f} {r['flops_per_step']/1e12:10.2f} "
              f"{r['mfu_per_step']*100:8.1f}% {r['mfu_executed']*100:8.1f}% "
              f"{r.get('peak_mem_GiB', float('nan')):8.1f} "
              f"{r['first_step_s_incl_compile']:10.1f}")
    log("done")


if __name__ == "__main__":
    main()

"""Both GPUs of a node against one: regeneration throughput and DDP training, in one run.

    python bench/ddp_scaling.py --config configs/smollm2-135m-h200.yaml \
        --conversations runs/smollm2-h200/conversations.jsonl --prompts-file runs/smollm2-h200/prompts.jsonl

Regeneration: the batched engine answers --regen-prompts first turns of --prompts-file on one GPU, then the same
prompts split over two GPUs (one process each, started together once both have loaded the model);
regenerate_speedup_2gpu compares generated tokens/s. Training: the same online training (first
--samples conversations, --steps steps) on one GPU accumulating 2 batches per step and on two GPUs with
DDP (one batch each): the same global batches, so the per-step losses must agree (max_rel_loss_diff;
--precision no makes that exact up to summation order) and train_speedup_2gpu compares tokens/s.
Writes bench/results.json "ddp_scaling".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.regenerate_throughput import first_turn_prompts  # noqa: E402
from bench.results import record  # noqa: E402
from bench.runs import make_run, median_tokens_per_s, run, step_records, train_command  # noqa: E402


def _generate_on(device: str, prompts: list[list[int]], max_tokens: int, dtype: str, barrier, out) -> None:
    from target.batched import BatchedTarget
    from target.continuous_batching import generate
    from target.hf_model import load_target, stop_token_ids

    target = load_target("smollm2-135m-instruct", dtype=dtype, device=device)
    engine, stops = BatchedTarget(target.model), stop_token_ids(target.tokenizer)
    generate(engine, prompts[:8], 8, stops, desc=f"warm-up {device}")
    barrier.wait()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    res = generate(engine, prompts, max_tokens, stops, desc=device)
    torch.cuda.synchronize(device)
    out.put((device, sum(len(r.tokens) for r in res), time.perf_counter() - start))


def regeneration(prompts: list[list[int]], max_tokens: int, dtype: str, devices: list[str]) -> dict[str, float]:
    """Generated tokens/s over ``devices`` together (prompts dealt out in length order)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(devices)), ctx.Queue()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    shares = [[prompts[i] for i in order[r::len(devices)]] for r in range(len(devices))]
    procs = [ctx.Process(target=_generate_on, args=(d, s, max_tokens, dtype, barrier, out))
             for d, s in zip(devices, shares, strict=True)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    tokens, seconds = sum(r[1] for r in results), max(r[2] for r in results)
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--conversations", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-ddp"))
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--precision", default="no", choices=["no", "bf16"])
    ap.add_argument("--prompts-file", type=Path, required=True, help="an ingested prompts.jsonl")
    ap.add_argument("--regen-prompts", type=int, default=3000)
    ap.add_argument("--regen-max-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("ddp_scaling needs 2 GPUs", file=sys.stderr)
        return 2

    from target.hf_model import load_target

    tok = load_target("smollm2-135m-instruct", device="cpu").tokenizer
    prompts = first_turn_prompts(tok, args.regen_prompts, args.prompts_file)
    one = regeneration(prompts, args.regen_max_tokens, args.dtype, ["cuda:0"])
    two = regeneration(prompts, args.regen_max_tokens, args.dtype, ["cuda:0", "cuda:1"])

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
        "regenerate_tokens_per_s_1gpu": one["tokens_per_s"], "regenerate_tokens_per_s_2gpu": two["tokens_per_s"],
        "regenerate_speedup_2gpu": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
        "regenerate_prompts": len(prompts), "regenerate_max_tokens": args.regen_max_tokens,
        "train_tokens_per_s_1gpu": round(tps1, 1), "train_tokens_per_s_2gpu": round(tps2, 1),
        "train_speedup_2gpu": round(tps2 / tps1, 3), "train_steps": len(a), "train_precision": args.precision,
        "train_source": "online", "max_rel_loss_diff": rel,
        "losses_1gpu": [x["loss"] for x in a], "losses_2gpu": [y["loss"] for y in b]})
    return 0


if __name__ == "__main__":
    sys.exit(main())

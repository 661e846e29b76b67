"""Regeneration speed of the hf backend's batched engine against plain ``model.generate``, in one run.

    python bench/regenerate_throughput.py --prompts-file runs/smollm2-h200/prompts.jsonl   # on a GPU
    python bench/regenerate_throughput.py --prompts-file P --prompts 24 --baseline-prompts 8 --max-tokens 16 \
        --exact-prompts 4 --exact-max-tokens 8 --baseline-batch 4     # a CPU smoke run (figures not for quoting)

Prompts are the first user turns of an ingested ShareGPT prompts.jsonl (--prompts-file) under the chat
template, answered greedily up to --max-tokens (a realistic mix: answers from a few tokens to the cap).
Figures, written to bench/results.json "regenerate":
- baseline_gen_tokens_per_s: plain ``model.generate`` on --baseline-prompts prompts, sorted by length and
  left-padded in batches of --baseline-batch (the old backend at its best setting);
- fast_same_set_tokens_per_s and speedup: the engine on those very prompts;
- gen_tokens_per_s: the engine on --prompts prompts (its working size: slots sized from free memory);
- exact_prompts / exact_matches: in fp32, how many of --exact-prompts answers equal ``generate``'s token
  for token (``generate`` left-padded in one batch, as the CPU test runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import record  # noqa: E402
from eval.prompts import render  # noqa: E402
from target.batched import BatchedTarget  # noqa: E402
from target.continuous_batching import generate  # noqa: E402
from target.hf_model import TargetModel, load_target, stop_token_ids  # noqa: E402


def first_turn_prompts(tok, n: int, prompts_file: Path) -> list[list[int]]:
    """The first user turn of the first ``n`` records of an ingested prompts.jsonl, chat-templated (prompts
    over 2,048 tokens left out)."""
    texts = []
    with open(prompts_file) as f:
        for line in f:
            if len(texts) >= n:
                break
            texts.append(next(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"))
    return [ids for ids in (render(tok, t) for t in texts) if len(ids) <= 2048]


def answer_tokens(row: list[int], stops: list[int]) -> list[int]:
    end = next((i for i, t in enumerate(row) if t in stops), None)
    return row if end is None else row[:end]


def plain_generate(target: TargetModel, prompts: list[list[int]], max_new: int, batch: int) -> list[list[int]]:
    """HF generate, length-sorted left-padded batches; answers in prompt order."""
    tok, stops = target.tokenizer, stop_token_ids(target.tokenizer)
    tok.padding_side = "left"
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for a in range(0, len(order), batch):
        idx = order[a:a + batch]
        enc = tok.pad({"input_ids": [prompts[i] for i in idx]}, return_tensors="pt").to(target.device)
        with torch.no_grad():
            gen = target.model.generate(**enc, max_new_tokens=max_new, do_sample=False, eos_token_id=stops,
                                        pad_token_id=tok.pad_token_id)
        for i, row in zip(idx, gen[:, enc["input_ids"].shape[1]:].tolist(), strict=True):
            out[i] = answer_tokens(row, stops)
    tok.padding_side = "right"
    return out


def timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts-file", type=Path, required=True, help="an ingested prompts.jsonl")
    ap.add_argument("--prompts", type=int, default=6000)
    ap.add_argument("--baseline-prompts", type=int, default=512)
    ap.add_argument("--baseline-batch", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--exact-prompts", type=int, default=64)
    ap.add_argument("--exact-max-tokens", type=int, default=256)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()

    target = load_target("smollm2-135m-instruct", dtype=args.dtype, device=args.device)
    prompts = first_turn_prompts(target.tokenizer, args.prompts, args.prompts_file)
    figures = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "max_tokens": args.max_tokens,
               **speed(target, prompts, args)}
    record("regenerate", figures)  # the speed figures stand even if the exactness check below fails
    target = load_target("smollm2-135m-instruct", dtype="float32", device=args.device)
    figures |= exactness(target, prompts[: args.exact_prompts], args.exact_max_tokens)
    record("regenerate", figures)
    return 0


def speed(target: TargetModel, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    dev, stops = target.device, stop_token_ids(target.tokenizer)
    engine = BatchedTarget(target.model)
    base_set = prompts[: args.baseline_prompts]
    generate(engine, base_set[:8], 8, stops, desc="warm-up")
    plain, plain_s = timed(lambda: plain_generate(target, base_set, args.max_tokens, args.baseline_batch), dev)
    plain_tokens = sum(map(len, plain))
    print(f"plain generate: {plain_tokens} tokens in {plain_s:.1f} s", flush=True)
    fast, fast_s = timed(lambda: generate(engine, base_set, args.max_tokens, stops, desc="same set"), dev)
    fast_tokens = sum(len(o.tokens) for o in fast)
    print(f"engine, same prompts: {fast_tokens} tokens in {fast_s:.1f} s", flush=True)
    big, big_s = timed(lambda: generate(engine, prompts, args.max_tokens, stops, desc="full set"), dev)
    print(f"engine, {len(prompts)} prompts: {sum(len(o.tokens) for o in big)} tokens in {big_s:.1f} s", flush=True)
    lengths = sorted(len(o.tokens) for o in big)
    return {"prompts": len(prompts), "gen_tokens": sum(lengths), "seconds": round(big_s, 2),
            "gen_tokens_per_s": round(sum(lengths) / big_s, 1), "answer_tokens_p50": lengths[len(lengths) // 2],
            "answers_at_cap": sum(n >= args.max_tokens for n in lengths),
            "baseline_prompts": len(base_set), "baseline_batch": args.baseline_batch,
            "baseline_gen_tokens_per_s": round(plain_tokens / plain_s, 1),
            "fast_same_set_tokens_per_s": round(fast_tokens / fast_s, 1),
            "speedup": round((fast_tokens / fast_s) / (plain_tokens / plain_s), 2)}


def exactness(target: TargetModel, prompts: list[list[int]], max_new: int) -> dict:
    ref = plain_generate(target, prompts, max_new, len(prompts))
    got = generate(BatchedTarget(target.model), prompts, max_new, stop_token_ids(target.tokenizer), desc="exact")
    return {"exact_prompts": len(prompts), "exact_max_tokens": max_new, "exact_dtype": str(target.dtype),
            "exact_matches": sum(r == g.tokens for r, g in zip(ref, got, strict=True))}


if __name__ == "__main__":
    sys.exit(main())

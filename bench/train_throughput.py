"""Training-step throughput of the TTT drafter step: tokens/s, peak memory, MFU.

    python bench/train_throughput.py                       # on CUDA: K2.5 shape, SmolLM2 B=1 and B=8
    python bench/train_throughput.py --shape tiny --device cpu   # dry run (no timing claims)

Writes "train_throughput" (one row per shape and batch; a CPU dry run's object says so in its device field,
and BENCH_RESULTS keeps it out of bench/results.json). bench/train_k25.py (against SpecForge's step) and
bench/train_loop.py (against the real training loop) reuse ``bench``.

One step = train/module.py's TTTModel forward (teacher logits over the draft rows only, ttt_length
unrolled draft steps, flex attention on CUDA, chunked soft cross-entropy) + backward + grad clipping
+ fused AdamW, bf16 autocast over fp32 master weights with fp32 AdamW state (accelerate's bf16 path);
the frozen embedding and the teacher rows are bf16 and outside the optimizer. Synthetic inputs.
Median of --steps steps after --warmup, timed with CUDA events.

MFU = model FLOPs / step time / 790 TFLOP/s (H200 dense bf16). Model FLOPs per step, with N = B·T
tokens, h·d = heads·head_dim, kv·d likewise, n = ttt_length, Vd = draft vocab:
    per draft step, forward:   2N·[2H·(h·d + 2·kv·d) + h·d·H + 3·H·I + H·Vd]      projections, MLP, lm_head
                             + 4N·h·d·(T/2 + i)                                    scores + AV, causal + i diagonal keys
    fc (step 0 only):          2N·3H·H
    training = 3 × forward (fwd + grads w.r.t. inputs and weights), summed over i = 0..n-1;
    teacher draft-row logits:  2N·H·Vd once per step (forward only: computed once, shared by all steps).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from bench.results import record
from common.step_clock import StepClock
from drafter.model import DrafterShape, Eagle3Drafter
from train.module import TTTModel
from train.optim import clip_into_step, make_optimizer, trainable
from train.ttt import TTTResult

PEAK_TFLOPS = 790.0
SHAPES = {
    "k25": dict(hidden_size=7168, intermediate_size=18432, num_attention_heads=64, num_key_value_heads=64,
                head_dim=128, vocab_size=163840, draft_vocab_size=32000),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, vocab_size=49152, draft_vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=512, draft_vocab_size=256),
}
DEFAULT_RUNS = [("k25", 1), ("smollm2", 1), ("smollm2", 8)]


def shape_named(name: str) -> DrafterShape:
    """One of SHAPES (the aux layer ids only name layers: they do not change the step)."""
    return DrafterShape(**SHAPES[name], aux_layer_ids=(2, 30, 58))


def shape_figures(s: DrafterShape) -> dict[str, int]:
    """The numbers that fix the step's cost, named as in SHAPES."""
    return {k: getattr(s, k) for k in SHAPES["tiny"]}


def model_flops(s: DrafterShape, batch: int, seq: int, ttt: int) -> float:
    n_tok = batch * seq
    hd, kvd, h = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim, s.hidden_size
    dense = 2 * n_tok * (2 * h * (hd + 2 * kvd) + hd * h + 3 * h * s.intermediate_size + h * s.draft_vocab_size)
    fwd = 2 * n_tok * 3 * h * h + sum(dense + 4 * n_tok * hd * (seq / 2 + i) for i in range(ttt))
    return 3 * fwd + 2 * n_tok * h * s.draft_vocab_size


def synthetic_batch(s: DrafterShape, batch: int, seq: int, device: torch.device, d2t: torch.Tensor) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    draft = torch.randint(0, s.draft_vocab_size, (batch, seq), generator=g)
    return {
        "input_ids": torch.randint(0, s.vocab_size, (batch, seq), generator=g).to(device),
        "loss_mask": torch.ones(batch, seq, dtype=torch.bool, device=device),
        "aux": torch.randn(batch, seq, 3 * s.hidden_size, generator=g).to(device, torch.bfloat16),
        "last_hidden": torch.randn(batch, seq, s.hidden_size, generator=g).to(device, torch.bfloat16),
        "target_argmax": (draft + d2t[draft]).to(device),
    }


def step_setup(shape: DrafterShape, batch: int, seq: int, ttt: int, device: torch.device, compile_step: bool
               ) -> tuple[TTTModel, torch.optim.Optimizer, dict]:
    """A fresh drafter of ``shape`` in the TTT module (teacher rows random), its fused AdamW and one synthetic batch:
    what ``bench`` times and bench/train_step_profile.py takes apart."""
    cuda = device.type == "cuda"
    with device:  # built in place: the K2.5 shape is ~2.4B parameters with its embedding
        drafter = Eagle3Drafter(shape)
    d2t = torch.zeros(shape.draft_vocab_size, dtype=torch.long)  # identity map: the first Vd target ids
    compute = torch.bfloat16 if cuda else torch.float32
    rows = torch.randn(shape.draft_vocab_size, shape.hidden_size) * shape.hidden_size ** -0.5
    model = TTTModel(drafter, rows, ttt, 0.8).to_device(device, compute)
    if compile_step:  # the draft step and its logits' final norm (fp32 in eager: a cast and five passes a step)
        drafter.step = torch.compile(drafter.step, dynamic=False)
        drafter.logits = torch.compile(drafter.logits, dynamic=False)
    opt = make_optimizer(model, 1e-4, 0.0, fused=cuda)
    return model, opt, synthetic_batch(shape, batch, seq, device, d2t)


def forward_loss(model: TTTModel, data: dict) -> TTTResult:
    with torch.autocast(data["input_ids"].device.type, dtype=torch.bfloat16, enabled=data["input_ids"].is_cuda):
        return model(**data)


def update(model: TTTModel, opt: torch.optim.Optimizer) -> None:
    """Clip and step, as the training loop does after backward (on CUDA the clip runs inside the fused step)."""
    clip_into_step(opt, trainable(model), 0.5)
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench(shape: DrafterShape, batch: int, seq: int, ttt: int, steps: int, warmup: int, device: torch.device,
          compile_step: bool) -> dict:
    """One step's median over ``steps`` after ``warmup`` (CUDA events on CUDA, wall time on CPU)."""
    cuda = device.type == "cuda"
    model, opt, data = step_setup(shape, batch, seq, ttt, device, compile_step)
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for k in range(warmup + steps):
        clock = StepClock(cuda)
        clock.mark()
        res = forward_loss(model, data)
        res.loss.backward()
        update(model, opt)
        clock.mark()
        if k >= warmup:
            times.append(clock.spans_ms()[0])
    ms = statistics.median(times)
    flops = model_flops(shape, batch, seq, ttt)
    return {"shape": shape_figures(shape), "batch": batch, "seq": seq, "ttt_length": ttt, "device": str(device),
            "compile": compile_step, "median_ms": round(ms, 2), "tokens_per_s": round(batch * seq / ms * 1e3, 1),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
            "model_tflop_per_step": round(flops / 1e12, 3),
            "mfu": round(flops / (ms / 1e3) / (PEAK_TFLOPS * 1e12), 4) if cuda else None,
            "trainable_params_m": round(sum(p.numel() for p in trainable(model)) / 1e6, 1),
            "loss": round(float(res.loss.detach()), 4), "steps_timed": len(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="one shape (default: k25 B=1, smollm2 B=1 and B=8)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile the drafter's step and its logits")
    ap.add_argument("--out", help="also write the JSON results here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and args.shape != "tiny":
        print("CPU: only the dry run is meaningful: --shape tiny --device cpu", file=sys.stderr)
        return 2
    runs = [(args.shape, args.batch)] if args.shape else DEFAULT_RUNS
    seq = args.seq if device.type == "cuda" else min(args.seq, 128)
    results = []
    for name, batch in runs:
        r = {"name": name, **bench(shape_named(name), batch, seq, args.ttt, args.steps, args.warmup, device,
                                   args.compile)}
        results.append(r)
        print(json.dumps(r), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    record("train_throughput", {"runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())

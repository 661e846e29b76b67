"""Where our TTT training step's time goes at a drafter shape: phases, then kernels by class.

    python bench/train_step_profile.py          # one H200: the K2.5 shape, compiled -> "train_step_profile"
    python bench/train_step_profile.py --shape smollm2 --batch 8 --eager  # the training loop's step, beside it
    python bench/train_step_profile.py --shape tiny --device cpu --steps 2 --warmup 1   # plumbing only

Each configuration is its own entry of the object (``k25_b1_compiled``, ``smollm2_b8_eager``, ...), with its command.

The step is bench/train_throughput.py's (``step_setup``: the same drafter, batch and fused AdamW). Phases, each
bracketed by CUDA events over --steps steps after --warmup (medians): forward with the loss, backward, clipping and
the optimizer (clip + step + zero_grad). Then --profile-steps more steps under ``torch.profiler``: device ms per
step by kernel class and the top kernels (bench/kernel_profile.py). ``model_ms_at_peak`` is the step's model FLOPs
at 790 TFLOP/s (train_throughput's ``model_flops``): what the GEMM class would take at the dense peak, the floor
the 1.5x-of-SpecForge bar (bench/train_k25.py) is weighed against.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.kernel_profile import kernel_times, summarize
from bench.results import command_line, record
from bench.train_throughput import (
    PEAK_TFLOPS,
    SHAPES,
    forward_loss,
    model_flops,
    shape_figures,
    shape_named,
    step_setup,
    update,
)
from common.step_clock import StepClock

PHASES = ("forward_loss", "backward", "clip_optimizer")


def profile_step(name: str, batch: int, seq: int, ttt: int, steps: int, warmup: int, profile_steps: int,
                 device: torch.device, compile_step: bool) -> dict:
    shape = shape_named(name)
    model, opt, data = step_setup(shape, batch, seq, ttt, device, compile_step)

    def one_step(clock: StepClock | None = None) -> None:
        mark = clock.mark if clock else (lambda: None)
        mark()
        res = forward_loss(model, data)
        mark()
        res.loss.backward()
        mark()
        update(model, opt)
        mark()

    spans: list[list[float]] = []
    for k in range(warmup + steps):
        clock = StepClock(device.type == "cuda")
        one_step(clock)
        if k >= warmup:
            spans.append(clock.spans_ms())
    phase_ms = {p: round(statistics.median(s[i] for s in spans), 2) for i, p in enumerate(PHASES)}
    step_ms = statistics.median(sum(s) for s in spans)
    flops = model_flops(shape, batch, seq, ttt)
    return {"shape_name": name, "shape": shape_figures(shape), "batch": batch, "seq": seq, "ttt_length": ttt,
            "compile": compile_step, "step_ms": round(step_ms, 2), "phase_ms": phase_ms,
            "model_ms_at_peak": round(flops / (PEAK_TFLOPS * 1e12) * 1e3, 2),
            "mfu": round(flops / (step_ms / 1e3) / (PEAK_TFLOPS * 1e12), 4) if device.type == "cuda" else None,
            "steps_timed": steps, "profile_steps": profile_steps,
            **summarize(kernel_times(one_step, profile_steps), top=40)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="k25")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="the drafter's step uncompiled (default: compiled)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and args.shape != "tiny":
        ap.error("on a CPU only the plumbing runs: --shape tiny --device cpu")
    seq = args.seq if device.type == "cuda" else min(args.seq, 64)
    compiled = not args.eager and device.type == "cuda"
    figures = profile_step(args.shape, args.batch, seq, args.ttt, args.steps, args.warmup, args.profile_steps,
                           device, compiled)
    # one entry per configuration, so that the K2.5 step and the loop's (SmolLM2, eager) can be profiled side by side
    label = f"{args.shape}_b{args.batch}_{'compiled' if compiled else 'eager'}"
    record("train_step_profile", {label: {"command": command_line(), **figures}}, merge=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

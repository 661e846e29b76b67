"""tau* measured on a machine others share: read from each run's whole time, and read past its stalls.

    python bench/tau_star_under_load.py                 # the real SmolLM2 on this CPU -> "tau_star_under_load"

The measured break-even tau* = t_cycle / t_decode comes from batch-1 timing runs (eval/measure.py): per prompt,
the plain decode, then the speculative one. Here the same runs are timed ``--repeats`` times on a quiet machine and
again while ``--load-procs`` processes burn the cores in bursts (``--burst-s`` on, ``--idle-s`` off: another job's
bursts on a CI runner or a laptop), and tau* with its bootstrap interval is read from the same per-step durations
two ways: ``with_stalls``, each run's whole time (the sum of its steps), and ``stall_free``, what the gate reads
(eval/stall_free.py: its steps times their lower quartile). A read that a shared machine cannot move keeps its
points together under load, near the quiet ones, and its intervals narrow. The drafter is a random one (the
timings, not its acceptance, are measured); the prompts are MT-Bench's first ``--prompts``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import torch
from tqdm import tqdm

from bench.results import record
from common.config import DatasetConfig
from drafter.factory import fresh_drafter, shape_for_target
from drafter.vocab_map import build_vocab_map
from eval.intervals import Bootstrap, tau_star_estimate
from eval.prompts import load_eval_prompts, render
from eval.speculative import Eagle3Proposer, Engine
from eval.stall_free import stall_free_s, stalled
from target_model.hf_model import load_target, stop_token_ids

AUX = (2, 15, 27)
READS: dict[str, Callable[[Sequence[float]], float]] = {"with_stalls": sum, "stall_free": stall_free_s}


def _burn(burst_s: float, idle_s: float) -> None:
    while True:
        end = time.perf_counter() + burst_s
        while time.perf_counter() < end:
            pass
        time.sleep(idle_s)


@contextmanager
def bursty_load(procs: int, burst_s: float, idle_s: float) -> Iterator[None]:
    """``procs`` processes, each busy for burst_s then idle for idle_s, until the block ends."""
    workers = [mp.Process(target=_burn, args=(burst_s, idle_s), daemon=True) for _ in range(procs)]
    for w in workers:
        w.start()
    try:
        yield
    finally:
        for w in workers:
            w.terminate()
            w.join()


def timing_runs(engine: Engine, proposer: Eagle3Proposer, prompts: list[list[int]], k: int, max_new: int
                ) -> tuple[list[list[float]], list[list[float]]]:
    """Per prompt, the plain decode's step durations and the speculative decode's cycle durations."""
    plain, cycles = [], []
    for p in prompts:
        plain.append(engine.plain(p, max_new).step_s)
        cycles.append(engine.speculative(proposer, p, k, max_new).cycle_s)
    return plain, cycles


def tau_star_reads(plain: list[list[float]], cycles: list[list[float]], boot: Bootstrap) -> dict[str, dict]:
    """tau* and its interval under each read of a run's time, and the steps counted as stalled."""
    out: dict[str, dict] = {}
    for name, read in READS.items():
        iv = tau_star_estimate([read(s) for s in plain], [len(s) for s in plain], [read(c) for c in cycles],
                               [len(c) for c in cycles], boot).interval(boot.level)
        out[name] = {"point": iv.point, "ci": [iv.low, iv.high]}
    out["stalled_steps"] = sum(map(stalled, plain)) + sum(map(stalled, cycles))
    out["steps"] = sum(map(len, plain)) + sum(map(len, cycles))
    return out


def summary(repeats: list[dict]) -> dict[str, dict]:
    """Per read: the spread of the points (max - min) and the median interval width over the repeats."""
    return {name: {"points_spread": max(r[name]["point"] for r in repeats) - min(r[name]["point"] for r in repeats),
                   "median_point": statistics.median(r[name]["point"] for r in repeats),
                   "median_ci_width": statistics.median(r[name]["ci"][1] - r[name]["ci"][0] for r in repeats)}
            for name in READS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=6, help="Timing passes per condition (default 6).")
    ap.add_argument("--prompts", type=int, default=4, help="MT-Bench prompts timed per pass (default 4, as the "
                    "measured-break-even gate test).")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="Tokens per run (default 32).")
    ap.add_argument("--num-steps", type=int, default=3, help="k, drafts per cycle (default 3).")
    ap.add_argument("--load-procs", type=int, default=3, help="Processes burning the cores under load (default 3).")
    ap.add_argument("--burst-s", type=float, default=0.6, help="Seconds each load process is busy (default 0.6).")
    ap.add_argument("--idle-s", type=float, default=1.0, help="Seconds it then sleeps (default 1.0).")
    args = ap.parse_args(argv)
    for name in ("repeats", "prompts", "max_new_tokens", "num_steps", "load_procs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.burst_s <= 0 or args.idle_s < 0:
        ap.error(f"--burst-s {args.burst_s} / --idle-s {args.idle_s}: a burst must last, an idle spell can be 0")
    target = load_target("smollm2-135m-instruct", dtype="float32", device="cpu")
    engine = Engine(target, AUX, stop_token_ids(target.tokenizer))
    d2t, t2d = build_vocab_map(torch.zeros(target.vocab_size), 1024)
    proposer = Eagle3Proposer(fresh_drafter(shape_for_target(target.hf_config, 1024, AUX),
                                            target.embed_weight().detach(), d2t, t2d), AUX)
    prompts = [render(target.tokenizer, p)
               for p in load_eval_prompts(DatasetConfig(name="mtbench", kind="mtbench"), args.prompts)]
    boot = Bootstrap(0.95, 2000, 0)
    timing_runs(engine, proposer, prompts[:1], args.num_steps, 4)  # warm-up: first-call allocations
    conditions: dict[str, list[dict]] = {"quiet": [], "loaded": []}
    bar = tqdm(total=2 * args.repeats, desc="timing passes", unit="pass")
    for condition, runs in conditions.items():
        with bursty_load(args.load_procs, args.burst_s, args.idle_s) if condition == "loaded" else nullcontext():
            for _ in range(args.repeats):
                runs.append(tau_star_reads(*timing_runs(engine, proposer, prompts, args.num_steps,
                                                        args.max_new_tokens), boot))
                bar.update()
    bar.close()
    figures = {"prompts": args.prompts, "repeats": args.repeats, "max_new_tokens": args.max_new_tokens,
               "num_steps": args.num_steps, "threads": torch.get_num_threads(),
               "load": {"procs": args.load_procs, "burst_s": args.burst_s, "idle_s": args.idle_s},
               "passes": conditions, "summary": {c: summary(runs) for c, runs in conditions.items()}}
    for c, by_read in figures["summary"].items():
        print(f"{c}: " + "; ".join(f"{name} tau* median {s['median_point']:.3f}, points spread "
                                   f"{s['points_spread']:.3f}, median 95% interval width {s['median_ci_width']:.3f}"
                                   for name, s in by_read.items()))
    record("tau_star_under_load", figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Our TTT training step against SpecForge 0.2.0's at the Kimi-K2.5 drafter shape, in one invocation.

    python bench/train_k25.py                                   # one H200 -> "train_k25"
    python bench/train_k25.py --rounds 2 --specforge-bench .gpu/peer/bench_specforge.py

Both steps run on the same GPU in the same call, so the speed-up does not depend on which machine a run
got: ours (bench/train_throughput.py's ``bench``, eager and with the drafter's step compiled) in this process,
SpecForge's (its own draft model, TTT wrapper, Triton loss and BF16Optimizer, timed by
../shared/peer-bench/bench_specforge.py, flex attention) in a child process, so neither holds the other's
GPU memory or compiled kernels. With --rounds 2 the second round runs them in the other order.
speedup = SpecForge's median step / our faster median step (the bar: at least 1.5). B=1, T=2048, TTT 7, bf16,
synthetic inputs, CUDA events on both sides.

SpecForge's benchmark lies outside the repo (--specforge-bench; on the GPU machine, carry a copy in .gpu/) and
needs the ``specforge==0.2.0`` wheel installed with ``--no-deps`` on PYTHONPATH (its EAGLE-3 path imports no
sglang); bench/h200_pipeline.sh's setup phase installs it from .whl/.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from bench.results import record
from bench.runs import REPO, run
from bench.train_throughput import bench, shape_figures, shape_named
from common.files import iter_jsonl

OURS, PEERS = "k25", "kimi"  # the one shape's name in train_throughput.SHAPES and in bench_specforge.SHAPES
# bench_specforge.py's row fields -> ours (its row carries its shape's numbers: checked equal to ours)
PEER_FIELDS = {"hidden": "hidden_size", "inter": "intermediate_size", "heads": "num_attention_heads",
               "kv_heads": "num_key_value_heads", "head_dim": "head_dim", "vocab": "vocab_size",
               "draft_vocab": "draft_vocab_size"}
DEFAULT_SPECFORGE_BENCH = REPO.parent / "shared" / "peer-bench" / "bench_specforge.py"
WHEEL = "specforge==0.2.0"
BAR = 1.5


class MissingPeer(RuntimeError):
    """SpecForge's benchmark script or the specforge module is not here."""


def check_peer(script: Path) -> None:
    """Before any GPU work: both halves of the comparison must be able to run."""
    if not script.is_file():
        raise MissingPeer(f"SpecForge's benchmark {script} not found: pass --specforge-bench PATH to "
                          "peer-bench/bench_specforge.py (on the GPU machine, a copy carried in .gpu/peer/), "
                          f"with the {WHEEL} wheel installed --no-deps")
    if importlib.util.find_spec("specforge") is None:
        raise MissingPeer(f"no module named specforge for {script}: install the wheel with "
                          f"`python -m pip install --no-deps {WHEEL}` (on the GPU machine: .whl/ and "
                          "`bash bench/h200_pipeline.sh setup`)")


def specforge_step(script: Path, batch: int, seq: int, ttt: int, steps: int, warmup: int, out: Path) -> dict:
    """bench_specforge.py at the K2.5 shape with flex attention in a child process: its results.jsonl row of kind
    ``train_step``, with its ``env`` row (versions) under "env". Its failures are rows with an ``error``."""
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "results.jsonl"  # the script appends: one file per call
    rows_file.unlink(missing_ok=True)
    log = out / "specforge.log"
    run([sys.executable, str(script), "--shapes", PEERS, "--backends", "flex_attention", "--batch", str(batch),
         "--seq", str(seq), "--ttt", str(ttt), "--steps", str(steps), "--warmup", str(warmup), "--no-matmul",
         "--out", str(out)], log=log)
    rows = [r for _, r in iter_jsonl(rows_file, RuntimeError, fix=f"see {log}")]
    step = next((r for r in rows if r.get("kind") == "train_step"), None)
    if step is None or "error" in step:
        raise RuntimeError(f"{script}: {step['error'] if step else 'no train_step row'} (log: {log})")
    env = next((r for r in rows if r.get("kind") == "env"), {})
    return {**step, "env": env}


def peer_shape(row: dict) -> dict[str, int]:
    return {ours: row[theirs] for theirs, ours in PEER_FIELDS.items()}


def our_steps(batch: int, seq: int, ttt: int, steps: int, warmup: int, device: torch.device) -> dict[str, dict]:
    """Eager and compiled, each on a fresh drafter; the memory handed back before SpecForge's process runs."""
    out = {}
    for mode, compiled in (("eager", False), ("compiled", True)):
        out[mode] = bench(shape_named(OURS), batch, seq, ttt, steps, warmup, device, compiled)
        print(json.dumps({mode: out[mode]}), flush=True)
        gc.collect()  # a compiled step refers back to its drafter: a cycle
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def compare(script: Path, rounds: int, batch: int, seq: int, ttt: int, steps: int, warmup: int,
            device: torch.device, out: Path) -> dict[str, Any]:
    """The "train_k25" figures: ``rounds`` of both steps, SpecForge's first in even rounds (our process has then
    not touched the GPU yet in the first), medians over rounds."""
    ours: list[dict[str, dict]] = []
    peers: list[dict] = []
    order = []
    for r in range(rounds):
        first = ["specforge", "ours"] if r % 2 == 0 else ["ours", "specforge"]
        for side in first:
            if side == "ours":
                ours.append(our_steps(batch, seq, ttt, steps, warmup, device))
            else:
                peers.append(specforge_step(script, batch, seq, ttt, steps, warmup, out / f"specforge-{r}"))
        order.append(first)
    shape = shape_figures(shape_named(OURS))
    if (theirs := peer_shape(peers[0])) != shape:
        raise RuntimeError(f"{script}'s {PEERS!r} shape {theirs} is not ours {shape}: not the same step")
    ours_ms = {mode: statistics.median(o[mode]["median_ms"] for o in ours) for mode in ("eager", "compiled")}
    specforge_ms = statistics.median(p["median_step_s"] * 1e3 for p in peers)
    best = min(ours_ms, key=ours_ms.__getitem__)
    return {"ours_ms": {k: round(v, 2) for k, v in ours_ms.items()}, "specforge_ms": round(specforge_ms, 2),
            "speedup": round(specforge_ms / ours_ms[best], 3), "best": best, "bar": BAR, "shape": shape,
            "batch": batch, "seq": seq, "ttt": ttt, "steps": steps, "warmup": warmup, "rounds": rounds,
            "order": order, "specforge_version": peers[0]["env"].get("specforge"), "ours_raw": ours,
            "specforge_raw": peers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specforge-bench", type=Path, default=DEFAULT_SPECFORGE_BENCH,
                    help="SpecForge's step benchmark (default: ../shared/peer-bench/bench_specforge.py from the repo)")
    ap.add_argument("--rounds", type=int, default=1, help="2: again in the other order (about 3 minutes a round)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-k25"), help="SpecForge's rows and logs")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    script = args.specforge_bench.resolve()  # the child runs from the repo root
    try:
        check_peer(script)
    except MissingPeer as e:
        print(f"train_k25: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("train_k25: needs a CUDA GPU (the K2.5-shape step is ~2.4B parameters)", file=sys.stderr)
        return 2
    record("train_k25", compare(script, args.rounds, args.batch, args.seq, args.ttt, args.steps, args.warmup,
                                torch.device("cuda"), args.out.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

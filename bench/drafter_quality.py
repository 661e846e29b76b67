"""How good a SmolLM2 drafter is: tau on all of MT-Bench and HumanEval, and the learning curve.

    python bench/drafter_quality.py eval --config configs/smollm2-135m-h200.yaml --checkpoint DIR [--set KEY=VALUE]
    python bench/drafter_quality.py curve --config configs/smollm2-135m-h200.yaml --run-dir runs/smollm2-h200

eval: ``python -m eval quality`` (``eval.quality``: every prompt of the config's eval datasets at each --settings
k:T with the batched engine, the lossless check, tau* per k from batch-1 timings, the gate's decision at the first
setting, against --incumbent too when given; the target in fp32), recorded as "quality" (or --name): every tau with
its interval (ci) and prompts, tau* with its interval, tau_by_context (tau per history-length bucket on the run's
held-out conversations, with counts) and the weights' fingerprint (sha256), so a record names the file it measured.
Each drafter's figures per dataset and setting are kept as they land in <run_dir>/eval/measured/, one store
for every --name of the run: a rerun after a kill (or a device call's deadline) measures only the rest,
and an --incumbent measured before on the same target and prompts is read, not measured again.

curve: the same tau (k=3, T=0) for each checkpoint a training run kept (train.save_at), against the real
tokens it had trained on, with the held-out acc_0..acc_n logged at that step; learning_curve.png beside
the results file (bench/) and "learning_curve", both rewritten as each point lands; a rerun measures only
the checkpoints not measured yet (points are kept in <run-dir>/learning_curve/).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.results import record, results_path
from bench.runs import holdout_at
from common.config import RunConfig
from common.files import sha256_file, write_json_atomic
from eval.batched_eval import GreedyReferences, acceptance
from eval.quality import DEFAULT_SETTINGS, figures_store, load_drafter, parse_settings, quality, setup
from train.run_checkpoints import STATE_DIR, TRAINER_FILE, complete_checkpoints, read_trainer_state


def cmd_eval(args: argparse.Namespace) -> int:
    cfg, target, prompts = setup(args.config, args.limit, overrides=args.set)
    figures = quality(cfg, target, prompts, args.checkpoint, parse_settings(args.settings), args.timing_prompts,
                      args.limit or args.context_prompts, incumbent=args.incumbent,
                      keep_dir=figures_store(cfg))
    figures["goal_tau_mtbench"] = 3.0
    record(args.name, figures)
    print(json.dumps(figures, indent=1))
    return 0


def cmd_curve(args: argparse.Namespace) -> int:
    cfg, target, prompts = setup(args.config, args.limit, overrides=args.set)
    run_dir = Path(args.run_dir)
    ckpts = complete_checkpoints(run_dir / "checkpoints")
    if not ckpts:
        print(f"error: {run_dir / 'checkpoints'}: no complete checkpoint to measure (train first)", file=sys.stderr)
        return 2
    png = results_path().with_name("learning_curve.png")
    head = {"run_dir": str(run_dir), "k": 3, "temperature": 0.0, "max_new_tokens": cfg.eval.max_new_tokens,
            "plot": "bench/learning_curve.png", "checkpoints": len(ckpts)}
    points: list[dict] = []
    for point in curve_points(cfg, target, prompts, run_dir, [d for _, d in ckpts]):
        points.append(point)
        print(json.dumps(point))
        plot(points, png)  # the object and the plot grow with each point: a cut run keeps what it measured
        record("learning_curve", {**head, "points": points})
    print(f"plot: {png}")
    return 0


def curve_points(cfg: RunConfig, target: Any, prompts: dict[str, list[list[int]]], run_dir: Path,
                 ckpts: list[Path]) -> Iterator[dict[str, Any]]:
    """Each checkpoint's point: tau (k=3, T=0) on every eval prompt, the held-out metrics of its step and the
    tokens it had trained on. A point is kept in run_dir/learning_curve/ under its checkpoint's trainer state
    digest, so a rerun after a kill measures only the checkpoints not done (and a retrained step again)."""
    cache = run_dir / "learning_curve"
    refs = GreedyReferences(target, prompts, cfg.eval.max_new_tokens)  # generated (or read) when a point needs them
    for ckpt in ckpts:
        key = sha256_file(ckpt / STATE_DIR / TRAINER_FILE)
        kept = cache / f"{ckpt.name}.json"
        if kept.is_file() and (old := json.loads(kept.read_text())).pop("trainer_sha256", None) == key:
            yield old
            continue
        position = read_trainer_state(ckpt)["position"]
        drafter, aux_ids = load_drafter(target, cfg, ckpt)
        stats = acceptance(target, drafter, aux_ids, prompts, 3, 0.0, cfg.eval.max_new_tokens, refs,
                           tie_epsilon=cfg.eval.tie_epsilon)
        held = holdout_at(run_dir, position["step"])
        point = {"step": position["step"], "tokens": position.get("tokens_seen"),
                 "tau": {n: st["tau"] for n, st in stats.items()},
                 "lossless_mismatches": {n: len(st["lossless_mismatches"]) for n, st in stats.items()},
                 "holdout": {k.split("/")[1]: v for k, v in held.items() if k.startswith("holdout/")}}
        write_json_atomic(kept, {**point, "trainer_sha256": key})
        yield point


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [p["tokens"] for p in points]
    for name in points[0]["tau"]:
        ax.plot(xs, [p["tau"][name] for p in points], "o-", label=f"{name} τ (k=3, T=0)")
    ax.axhline(3.0, ls="--", c="grey", lw=0.8, label="goal τ 3.0 (MT-Bench)")
    ax.set(xscale="log", xlabel="training tokens seen", ylabel="τ (tokens per verify cycle)",
           title="SmolLM2-135M drafter: τ against training data")
    ax.legend(fontsize=8)
    accs = sorted(k for k in points[0]["holdout"] if k.startswith("acc_"))
    for key in accs:
        ax2.plot(xs, [p["holdout"].get(key) for p in points], "o-", label=f"held-out {key}")
    ax2.set(xscale="log", xlabel="training tokens seen", ylabel="accuracy", title="held-out acc_i (TTT step i)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval")
    e.add_argument("--config", required=True)
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), help="k:T pairs; the first one gates")
    e.add_argument("--timing-prompts", type=int, default=8)
    e.add_argument("--context-prompts", type=int, default=80, help="held-out turns per history-length bucket")
    e.add_argument("--name", default="quality", help="the results.json object to write")
    e.add_argument("--incumbent", help="the drafter it must beat (paired on the same prompts at the first setting)")
    c = sub.add_parser("curve")
    c.add_argument("--config", required=True)
    c.add_argument("--run-dir", required=True)
    for p in (e, c):
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
        p.add_argument("--limit", type=int, help="prompts per dataset (smoke runs; figures are for all)")
    return ap


def main() -> int:
    args = parser().parse_args()
    torch.set_grad_enabled(False)
    return cmd_eval(args) if args.cmd == "eval" else cmd_curve(args)


if __name__ == "__main__":
    sys.exit(main())

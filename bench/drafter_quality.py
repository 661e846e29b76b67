"""How good a SmolLM2 drafter is: tau on all of MT-Bench and HumanEval, and the learning curve.

    python bench/drafter_quality.py eval --config configs/smollm2-135m-h200.yaml --checkpoint DIR
    python bench/drafter_quality.py curve --config configs/smollm2-135m-h200.yaml --run-dir runs/smollm2-h200

eval: every prompt of the config's eval datasets (their limits lifted), first turn, chat-templated, at each
--settings k:T, with the batched engine (``eval.batched_eval``): tau, alpha_k, and at T=0 the prompts whose
output differs from the target's greedy output. Then tau* per k from the batch-1 engine's timings on the
first --timing-prompts prompts (one process, nothing else on the GPU), and the gate decision at the first
setting. The target runs in fp32 so that the lossless check is exact. Writes "quality".

curve: the same tau (k=3, T=0) for each checkpoint a training run kept (train.save_at), against the real
tokens it had trained on, with the held-out acc_0..acc_n logged at that step; learning_curve.png beside
the results file (bench/) and "learning_curve".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import record, results_path  # noqa: E402
from bench.runs import holdout_at  # noqa: E402
from common.config import RunConfig, load_config  # noqa: E402
from drafter.factory import load_for_target  # noqa: E402
from eval import breakeven  # noqa: E402
from eval.batched_eval import acceptance, greedy_references  # noqa: E402
from eval.gate import decide  # noqa: E402
from eval.measure import Settings, measure  # noqa: E402
from eval.prompts import rendered_datasets  # noqa: E402
from eval.speculative import Eagle3Proposer, Engine  # noqa: E402
from target.hf_model import TargetModel, load_target_from_config, stop_token_ids  # noqa: E402
from train.run_checkpoints import read_trainer_state  # noqa: E402


def setup(config: str, limit: int | None = None, dtype: str = "float32",
          ) -> tuple[RunConfig, TargetModel, dict[str, list[list[int]]]]:
    """The config, the target (fp32 unless asked) and every eval prompt (``limit`` per dataset: smoke runs only)."""
    cfg = load_config(config, [f"target.dtype={dtype}"])
    target = load_target_from_config(cfg.target)
    datasets = [ds.model_copy(update={"limit": limit}) for ds in cfg.eval.datasets]
    return cfg, target, rendered_datasets(target.tokenizer, datasets, template_kwargs=cfg.target.chat_template_kwargs)


def load_drafter(target: TargetModel, cfg: RunConfig, checkpoint: str | Path):
    return load_for_target(checkpoint, target.embed_weight(), target.num_layers, cfg.target.aux_layer_ids,
                           device=target.device, dtype=target.dtype)


def summary(stats: dict, k: int, temperature: float) -> dict:
    out = {name: {"tau": s["tau"], "prompts": s["prompts"], "k": k, "temperature": temperature,
                  "alpha": s["alpha_conditional"], "histogram": s["histogram"]} for name, s in stats.items()}
    for name, s in stats.items():
        if "lossless_mismatches" in s:
            out[name]["lossless_mismatches"] = len(s["lossless_mismatches"])
    return out


def timings(target: TargetModel, drafter, aux_ids, prompts: list[list[int]], ks: list[int], max_new: int) -> dict:
    """Batch-1 plain decode and speculative cycle times: tau* per k (one process, one stream)."""
    engine = Engine(target, aux_ids, stop_token_ids(target.tokenizer))
    out = {}
    for k in ks:
        rep = measure(engine, {"timing": prompts}, {"d": Eagle3Proposer(drafter, aux_ids)}, Settings(k, 0.0, max_new))
        cycle = rep["drafters"]["d"]["phases_ms_per_cycle"]["cycle"]
        out[str(k)] = breakeven.breakeven(rep["plain"]["decode_ms"], cycle, k)
    return out


def cmd_eval(args: argparse.Namespace) -> int:
    cfg, target, prompts = setup(args.config, args.limit)
    drafter, aux_ids = load_drafter(target, cfg, args.checkpoint)
    max_new = cfg.eval.max_new_tokens
    refs = greedy_references(target, prompts, max_new)
    settings = [(int(s.split(":")[0]), float(s.split(":")[1])) for s in args.settings]
    results = {f"k{k}_T{t:g}": summary(acceptance(target, drafter, aux_ids, prompts, k, t, max_new, refs,
                                                   rule=cfg.eval.acceptance, tie_epsilon=cfg.eval.tie_epsilon), k, t)
               for k, t in settings}
    first = next(iter(results.values()))
    first_name = list(prompts)[0]
    times = timings(target, drafter, aux_ids, prompts[first_name][: args.timing_prompts],
                    sorted({k for k, _ in settings}), max_new)
    k0 = settings[0][0]
    tau_star = times[str(k0)]["tau_star"]
    mismatches = [f"{name}: {s['lossless_mismatches']} prompts differ from greedy" for name, s in first.items()
                  if s.get("lossless_mismatches")]
    d = decide({name: s["tau"] for name, s in first.items()}, tau_star, cfg.gate.margin, lossless_mismatches=mismatches)
    figures = {**first, "goal_tau_mtbench": 3.0, "checkpoint": str(args.checkpoint), "max_new_tokens": max_new,
               "settings": results, "tau_star": {k: v["tau_star"] for k, v in times.items()},
               "timings_ms": {k: {"decode": v["decode_ms"], "cycle": v["cycle_ms"]} for k, v in times.items()},
               "timing_prompts": args.timing_prompts, "gate": {"promote": d.promote, "reasons": d.reasons}}
    record(args.name, figures)
    print(json.dumps(figures, indent=1))
    return 0


def cmd_curve(args: argparse.Namespace) -> int:
    cfg, target, prompts = setup(args.config, args.limit)
    run_dir = Path(args.run_dir)
    ckpts = sorted((run_dir / "checkpoints").glob("step-*"))
    max_new = cfg.eval.max_new_tokens
    refs = greedy_references(target, prompts, max_new)
    points = []
    for ckpt in ckpts:
        trainer = read_trainer_state(ckpt)
        step = trainer["position"]["step"]
        drafter, aux_ids = load_drafter(target, cfg, ckpt)
        stats = acceptance(target, drafter, aux_ids, prompts, 3, 0.0, max_new, refs, tie_epsilon=cfg.eval.tie_epsilon)
        held = holdout_at(run_dir, step)
        points.append({"step": step, "tokens": trainer["position"].get("tokens_seen"),
                       "tau": {n: s["tau"] for n, s in stats.items()},
                       "lossless_mismatches": {n: len(s["lossless_mismatches"]) for n, s in stats.items()},
                       "holdout": {k.split("/")[1]: v for k, v in held.items() if k.startswith("holdout/")}})
        print(json.dumps(points[-1]))
    png = results_path().with_name("learning_curve.png")
    plot(points, png)
    record("learning_curve", {"run_dir": str(run_dir), "k": 3, "temperature": 0.0, "max_new_tokens": max_new,
                              "points": points, "plot": "bench/learning_curve.png"})
    print(f"plot: {png}")
    return 0


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval")
    e.add_argument("--config", required=True)
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--settings", nargs="+", default=["3:0", "3:1", "5:0"], help="k:T pairs; the first one gates")
    e.add_argument("--timing-prompts", type=int, default=8)
    e.add_argument("--name", default="quality", help="the results.json object to write")
    c = sub.add_parser("curve")
    c.add_argument("--config", required=True)
    c.add_argument("--run-dir", required=True)
    for p in (e, c):
        p.add_argument("--limit", type=int, help="prompts per dataset (smoke runs; figures are for all)")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    return cmd_eval(args) if args.cmd == "eval" else cmd_curve(args)


if __name__ == "__main__":
    sys.exit(main())

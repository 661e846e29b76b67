"""Full-size speculative-decoding eval on one GPU: every prompt of the eval datasets under several
(k, T) settings, then the break-even τ* from a quiet timing run and the gate decision.

    python bench/h200_eval.py --config configs/smollm2-135m-h200.yaml --checkpoint runs/smollm2-h200/checkpoints/best \
        --settings 3:0 3:1 5:0 --workers 12 --out runs/smollm2-h200/eval/h200

Batch size 1 per sequence, as the eval engine runs; the acceptance counts (τ, α_k) do not depend on timing, so
prompts are spread over worker processes sharing the GPU. Timings, which do, come from a separate run in one
process on an otherwise idle GPU, over the first --timing-prompts prompts of the first dataset.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common.config import load_config
from drafter.checkpoint import check_checkpoint
from drafter.factory import load_for_target
from drafter.target import load_target_from_config, stop_token_ids
from eval import breakeven
from eval.gate import decide
from eval.measure import Settings, dataset_stats, measure
from eval.prompts import rendered_datasets
from eval.speculative import Eagle3Proposer, Engine, Generation, first_divergence

_STATE: dict = {}


def _setup(config: str, checkpoint: str) -> tuple[Engine, Eagle3Proposer, object]:
    torch.set_num_threads(1)
    cfg = load_config(config)
    target = load_target_from_config(cfg.target)
    drafter, ids = load_for_target(checkpoint, target.embed_weight(), target.num_layers, cfg.target.aux_layer_ids,
                                   device=target.device, dtype=target.dtype)
    return Engine(target, ids, stop_token_ids(target.tokenizer)), Eagle3Proposer(drafter, ids), target


def _init_worker(config: str, checkpoint: str) -> None:
    _STATE["engine"], _STATE["proposer"], _ = _setup(config, checkpoint)


def _run_prompt(task: tuple) -> dict:
    """Greedy reference once, then every setting on the same prompt."""
    dataset, index, ids, settings, max_new, seed = task
    engine, proposer = _STATE["engine"], _STATE["proposer"]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    reference = engine.plain(ids, max_new, 0.0, gen)
    out = {"dataset": dataset, "index": index, "settings": {}}
    for k, temp in settings:
        g = engine.speculative(proposer, ids, k, max_new, temp, torch.Generator().manual_seed(seed + index))
        div = first_divergence(reference.tokens, g.tokens) if temp == 0 else None
        out["settings"][f"{k}:{temp:g}"] = {"accepted": g.accepted, "tokens": len(g.tokens), "divergence": div}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--settings", nargs="+", default=["3:0", "3:1", "5:0"], help="k:T pairs")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--limit", type=int, help="prompts per dataset (default: all)")
    ap.add_argument("--timing-prompts", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = load_config(args.config)
    problems = check_checkpoint(args.checkpoint)
    if problems:
        print("checkpoint fails drafter check:\n" + "\n".join(problems))
        return 1
    settings = [(int(s.split(":")[0]), float(s.split(":")[1])) for s in args.settings]
    max_new = cfg.eval.max_new_tokens
    engine, proposer, target = _setup(args.config, args.checkpoint)
    prompts = rendered_datasets(target.tokenizer, cfg.eval.datasets, args.limit)
    tasks = [(ds, i, ids, settings, max_new, cfg.eval.seed) for ds, pl in prompts.items() for i, ids in enumerate(pl)]
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers, initializer=_init_worker, initargs=(args.config, args.checkpoint)) as pool:
        results = list(tqdm(pool.imap_unordered(_run_prompt, tasks), total=len(tasks), desc="prompts"))
    acceptance_s = time.time() - t0

    # Quiet timing run: plain decode and each k, one process, nothing else on the GPU.
    timing_prompts = {name: pl[: args.timing_prompts] for name, pl in list(prompts.items())[:1]}
    timings = {}
    for k in sorted({k for k, _ in settings}):
        rep = measure(engine, timing_prompts, {"drafter": proposer}, Settings(k, 0.0, max_new, cfg.eval.seed))
        cycle = rep["drafters"]["drafter"]["phases_ms_per_cycle"]
        timings[k] = {"decode_ms": rep["plain"]["decode_ms"], "phases_ms_per_cycle": cycle,
                      "phase_lines": rep["drafters"]["drafter"]["phase_lines"],
                      "breakeven": breakeven.breakeven(rep["plain"]["decode_ms"], cycle["cycle"], k, None)}

    report: dict = {"checkpoint": args.checkpoint, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                    else "cpu", "batch_size": 1, "max_new_tokens": max_new, "workers": args.workers,
                    "acceptance_wall_s": round(acceptance_s, 1), "prompts": {d: len(p) for d, p in prompts.items()},
                    "timings": timings, "settings": {}}
    for k, temp in settings:
        key = f"{k}:{temp:g}"
        per_ds = {}
        for ds in prompts:
            rs = [r["settings"][key] for r in results if r["dataset"] == ds]
            # dataset_stats reads only the acceptance counts and the number of tokens.
            stats = dataset_stats([Generation(tokens=[0] * r["tokens"], accepted=r["accepted"]) for r in rs], k)
            stats["lossless_mismatches"] = sum(r["divergence"] is not None for r in rs) if temp == 0 else None
            per_ds[ds] = stats
        report["settings"][key] = per_ds
    k0 = settings[0][0]
    first = report["settings"][f"{k0}:{settings[0][1]:g}"]
    tau_star = timings[k0]["breakeven"]["tau_star"]
    mism = [f"{ds}: {s['lossless_mismatches']} prompts differ from greedy" for ds, s in first.items()
            if s.get("lossless_mismatches")]
    d = decide({ds: s["tau"] for ds, s in first.items()}, tau_star, cfg.gate.margin, lossless_mismatches=mism)
    report["gate"] = {"setting": f"{k0}:{settings[0][1]:g}", "tau_star": tau_star, "promote": d.promote,
                      "reasons": d.reasons}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "h200_eval.json").write_text(json.dumps(report, indent=2))
    lines = ["| setting | dataset | prompts | τ | α_k (conditional) | lossless mismatches |",
             "|---|---|---|---|---|---|"]
    for key, per_ds in report["settings"].items():
        for ds, s in per_ds.items():
            alphas = ", ".join(f"{a:.3f}" for a in s["alpha_conditional"])
            mism = s["lossless_mismatches"] if s["lossless_mismatches"] is not None else "n/a"
            k_, t_ = key.split(":")
            lines.append(f"| k={k_}, T={t_} | {ds} | {len(prompts[ds])} | {s['tau']:.3f} | {alphas} | {mism} |")
    for k, t in timings.items():
        lines.append(f"\nk={k}: plain decode {t['decode_ms']:.2f} ms/token; τ* = {t['breakeven']['tau_star']:.3f}")
        lines += [f"  {x}" for x in t["phase_lines"]]
    verdict = "PROMOTE" if d.promote else "REJECT"
    lines.append(f"\ngate ({report['gate']['setting']}): {verdict} — " + "; ".join(d.reasons))
    (out / "h200_eval.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

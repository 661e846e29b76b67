"""The data-efficiency levers, one at a time: same data, same steps, one change per row, tau measured.

    python bench/ablations.py --config configs/smollm2-135m-h200.yaml \
        --conversations runs/smollm2-h200/conversations.jsonl --samples 3000 --steps 200

Every row trains online on the first --samples regenerated conversations (the held-out split is theirs)
for --steps steps from scratch,
then is measured like the shipped drafter (k=3, T=0, every MT-Bench and HumanEval prompt, fp32 target).
Rows: the baseline recipe (the config's), then one lever each: initialisation from the target, a 3x
learning rate, TTT length 3, a 32k draft vocab (the config's 16k is what fits the 32 MB the shipped
drafter may weigh: this row is its tau cost), and the data itself cut to first turns with answers of at
most 256 tokens (what the old data engine produced; with greedy decoding a 256-token answer is the first
256 tokens of the longer one). Rows run on every visible GPU in parallel, one process each.

Writes "ablations" (each row: its overrides, the command that trains it, held-out metrics, tau) and
<out>/keep.json: the config overrides whose rows beat the baseline's mean tau by more than --margin, for
the final run to use ("keep what helps").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import record  # noqa: E402
from bench.runs import REPO, holdout_at, make_run, read_log  # noqa: E402
from common import parent_death  # noqa: E402
from common.cli import exit_reason  # noqa: E402

ROWS = {
    "baseline": [],
    "init_from_target": ["drafter.init=target"],
    "lr_x3": None,  # filled from the config: 3 x train.lr
    "ttt_3": ["train.ttt_length=3"],
    "draft_vocab_32k": ["drafter.draft_vocab_size=32000"],
    "first_turn_short_answers": [],  # a data change, not an override
}
SHORT_ANSWER_TOKENS = 256


def subset(src: Path, dst: Path, samples: int) -> None:
    with open(src) as f, open(dst, "w") as out:
        for i, line in enumerate(f):
            if i >= samples:
                break
            out.write(line)


def first_turns(src: Path, dst: Path, tokenizer) -> None:
    """The first user turn and the first answer cut at SHORT_ANSWER_TOKENS tokens, of each conversation."""
    with open(src) as f, open(dst, "w") as out:
        for line in f:
            rec = json.loads(line)
            msgs = rec["messages"]
            first = next(j for j, m in enumerate(msgs) if m["role"] == "assistant")
            answer = msgs[first]["content"]
            ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
            if len(ids) > SHORT_ANSWER_TOKENS:
                answer = tokenizer.decode(ids[:SHORT_ANSWER_TOKENS])
            out.write(json.dumps(rec | {"messages": msgs[:first] + [{"role": "assistant", "content": answer}]}) + "\n")


def worker(args: argparse.Namespace) -> int:
    """Train and measure the given rows on this process's GPU; rows go to <out>/row-<name>.json."""
    from common.config import load_config
    from eval.batched_eval import acceptance, greedy_references
    from eval.quality import load_drafter, setup
    from train.loop import train

    cfg, target, prompts = setup(args.config, args.limit)
    refs = greedy_references(target, prompts, cfg.eval.max_new_tokens)
    for name in args.rows.split(","):
        overrides = json.loads(args.overrides)[name]
        conv = args.out / ("first_turns.jsonl" if name == "first_turn_short_answers" else "subset.jsonl")
        run_dir = args.out / name
        common = ["train.source=online", f"train.max_steps={args.steps}", "train.save_every=100000",
                  "train.eval_every=100000", "tracking.report_to=none"]
        config = make_run(args.config, run_dir, conv, [*common, *overrides])
        train(load_config(config), "never")
        drafter, aux_ids = load_drafter(target, cfg, run_dir / "checkpoints" / "best")
        stats = acceptance(target, drafter, aux_ids, prompts, 3, 0.0, cfg.eval.max_new_tokens, refs,
                           tie_epsilon=cfg.eval.tie_epsilon)
        last = max(r["step"] for r in read_log(run_dir) if "loss" in r)
        row = {"name": name, "overrides": overrides, "command": f"python -m train --config {config}",
               "tau": {n: s["tau"] for n, s in stats.items()},
               "lossless_mismatches": {n: len(s["lossless_mismatches"]) for n, s in stats.items()},
               "holdout": {k.split("/")[1]: v for k, v in holdout_at(run_dir, last).items() if "/" in k}}
        (args.out / f"row-{name}.json").write_text(json.dumps(row))
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--conversations", required=True, type=Path)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-ablations"))
    ap.add_argument("--samples", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--limit", type=int, help="eval prompts per dataset (smoke runs; figures are for all)")
    ap.add_argument("--rows", help=argparse.SUPPRESS)  # worker mode
    ap.add_argument("--overrides", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.rows:
        return worker(args)

    from common.config import load_config
    from target.hf_model import load_target

    cfg = load_config(args.config)
    rows = {k: (v if v is not None else [f"train.lr={3 * cfg.train.lr:g}"]) for k, v in ROWS.items()}
    subset(args.conversations, args.out / "subset.jsonl", args.samples)
    first_turns(args.out / "subset.jsonl", args.out / "first_turns.jsonl",
                load_target(cfg.target.name, device="cpu").tokenizer)
    gpus = max(1, torch.cuda.device_count())
    names = list(rows)
    procs = []
    for g in range(gpus):
        mine = names[g::gpus]
        cmd = [sys.executable, __file__, "--config", args.config, "--conversations", str(args.conversations),
               "--out", str(args.out), "--samples", str(args.samples), "--steps", str(args.steps),
               "--rows", ",".join(mine), "--overrides", json.dumps(rows)]
        cmd += ["--limit", str(args.limit)] if args.limit else []
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(g)} if torch.cuda.is_available() else dict(os.environ)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(args.out / f"gpu{g}.log", "w"),
                                      stderr=subprocess.STDOUT, **parent_death.stage_kwargs()))  # die with us
    codes = [p.wait() for p in procs]
    results = [json.loads((args.out / f"row-{n}.json").read_text()) for n in names
               if (args.out / f"row-{n}.json").is_file()]
    if any(codes) or len(results) < len(names):
        print(f"ablation workers ended: {', '.join(exit_reason(c) for c in codes)}; see {args.out}/gpu*.log",
              file=sys.stderr)
    base = next((r for r in results if r["name"] == "baseline"), None)
    keep = []
    if base is not None:
        mean = lambda r: sum(r["tau"].values()) / len(r["tau"])  # noqa: E731
        for r in results:
            r["delta_mean_tau"] = round(mean(r) - mean(base), 4)
            if r["name"] != "baseline" and r["overrides"] and r["delta_mean_tau"] > args.margin:
                keep += r["overrides"]
    (args.out / "keep.json").write_text(json.dumps(keep))
    record("ablations", {"samples": args.samples, "steps": args.steps, "k": 3, "temperature": 0.0,
                         "rows": results, "kept_overrides": keep, "keep_margin": args.margin})
    return 0 if not any(codes) else 1


if __name__ == "__main__":
    sys.exit(main())

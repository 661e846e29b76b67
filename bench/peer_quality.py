"""Our trainer against SpecForge's on the same work: same conversations, target, aux layers, draft vocab, TTT length,
batches and optimizer steps; both drafters measured by ``eval quality`` (k=3, T=0, every prompt).

    python bench/peer_quality.py --config runs/smollm2-h200/config.yaml \
        --conversations runs/smollm2-h200/conversations.jsonl --epochs 1

Rows (--rows picks some):
- ours: ``python -m train`` (the user's command, in its own process) on the config with --epochs;
- specforge: SpecForge 0.2.0's training step on our batches with our recipe (our initial weights, lr, warm-up,
  mask alignment): the trainer is the only difference (bench/peer_specforge.py);
- specforge_shipped: SpecForge's step as it ships (random init, lr 1e-4, warm-up 1.5 %, its loss-mask offset).
Every row trains in a process of its own (a data loader forked from a process holding a CUDA context can hang) and
is measured as soon as it is trained, by this process, which loads the target once. A trained row is kept
(<out>/<row>/), a measured one too (<out>/row-<name>.json; a measured row is not trained again): a rerun after a
kill redoes only what was cut (our trainer resumes from its last checkpoint; a SpecForge row cut mid-training starts
over). The eval data wheels and specforge are what the GPU machine lacks (bench/device_assets.sh carries them).
"peer_quality" in the results file is rewritten as each row is measured; ``ours_minus.<row>.<dataset>`` is our tau
minus that row's with its paired interval (the same prompts resampled for both, from the per-prompt columns each
row's file keeps).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from bench.peer_specforge import RECIPES, loss_tenths
from bench.peer_specforge import train as train_specforge
from bench.results import measured_here, record
from bench.runs import make_run, run, train_command
from common.config import load_config
from common.files import write_json_atomic
from eval.intervals import Bootstrap, paired_difference
from train.holdout_curve import read_train_log

ROWS = ("ours", "specforge", "specforge_shipped")
RECIPE_OF = {"specforge": "ours", "specforge_shipped": "shipped"}
DRAFTER = "drafter"  # a SpecForge row's saved drafter, under its row dir
TRAINED = "trained.json"  # a trained row's drafter and what its training did, written once it is saved


def row_config(args: argparse.Namespace, name: str) -> Path:
    """The row's run config: the base config, online, with the schedule; nothing else changes between rows."""
    schedule = [f"train.epochs={args.epochs}"] if args.steps is None else [f"train.max_steps={args.steps}"]
    return make_run(args.config, args.out / name, args.conversations,
                    ["train.source=online", *schedule, "tracking.report_to=none", *args.set])


def train_row(args: argparse.Namespace, name: str) -> None:
    """Train ``name`` unless it is done (its ``TRAINED`` file) or measured: ours through the user's command,
    SpecForge's through this script's ``specforge`` subcommand, each in its own process."""
    config, row_dir = row_config(args, name), args.out / name
    if (row_dir / TRAINED).is_file() or measured_file(args, name).is_file():
        return
    if name == "ours":
        run(train_command(config), log=row_dir / "train.out")  # resumes from its last checkpoint after a kill
        write_json_atomic(row_dir / TRAINED, ours_trained(row_dir))
    else:
        run([sys.executable, str(Path(__file__).resolve()), "specforge", "--config", str(config), "--recipe",
             RECIPE_OF[name], "--out", str(row_dir)], log=row_dir / "train.out")


def cmd_specforge(args: argparse.Namespace) -> int:
    """One SpecForge row's training (a process of its own)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    done = train_specforge(load_config(args.config), RECIPES[args.recipe], args.out / DRAFTER, device)
    write_json_atomic(args.out / TRAINED, {"checkpoint": str(args.out / DRAFTER), **done})
    print(json.dumps(done), flush=True)
    return 0


def ours_trained(row_dir: Path) -> dict[str, Any]:
    """What our trainer did: its last step's checkpoint (not the best by held-out accept length: SpecForge's rows
    have no such choice), its steps, tokens and the first and last tenth's mean losses."""
    from train.run_checkpoints import latest, read_trainer_state

    ckpt = latest(row_dir / "checkpoints")
    if ckpt is None:
        raise RuntimeError(f"{row_dir / 'checkpoints'}: no complete checkpoint (see {row_dir / 'train.out'})")
    position = read_trainer_state(ckpt)["position"]
    losses = [r["loss"] for r in read_train_log(row_dir) if r.get("loss") is not None]
    return {"checkpoint": str(ckpt), "steps": position["step"], "tokens_seen": position["tokens_seen"],
            **loss_tenths(losses)}


def ours_minus(rows: dict[str, dict[str, Any]], boot: Bootstrap) -> dict[str, dict[str, dict[str, Any]]]:
    """Per peer row and dataset: ours' tau minus the row's, with its paired interval (both drafters on the same
    prompts, resampled together: prompt difficulty cancels), for the rows that kept their per-prompt columns."""
    ours = rows.get("ours", {})
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, row in rows.items():
        if name == "ours":
            continue
        diffs = {}
        for ds, fig in row.items():
            mine = ours.get(ds)
            if isinstance(fig, dict) and "per_prompt" in fig and isinstance(mine, dict) and "per_prompt" in mine:
                cols = [(f["per_prompt"]["tokens"], f["per_prompt"]["cycles"]) for f in (mine, fig)]
                diffs[ds] = paired_difference(*cols, boot).interval(boot.level).to_dict()
        if diffs:
            out[name] = diffs
    return out


def without_columns(row: dict[str, Any]) -> dict[str, Any]:
    """A row as the results file shows it: the per-prompt columns stay in the row's own file."""
    return {k: ({f: v for f, v in fig.items() if f != "per_prompt"} if isinstance(fig, dict) else fig)
            for k, fig in row.items()}


def summary(rows: dict[str, dict[str, Any]], args: argparse.Namespace, boot: Bootstrap) -> dict[str, Any]:
    """The results object: each measured row, ours' tau minus each peer row's with its paired interval, and
    whether every row saw the same tokens."""
    seen = {r["training"]["tokens_seen"] for r in rows.values()}
    diffs = ours_minus(rows, boot)
    return {"config": str(args.config), "conversations": str(args.conversations), "epochs": args.epochs,
            "steps": args.steps, "k": 3, "temperature": 0.0, **{n: without_columns(r) for n, r in rows.items()},
            **({"ours_minus": diffs, "confidence": boot.level} if diffs else {}), "tokens_seen": sorted(seen),
            "tokens_seen_equal": len(seen) == 1, "rows_pending": [n for n in args.rows if n not in rows]}


def measured_file(args: argparse.Namespace, name: str) -> Path:
    return args.out / f"row-{name}.json"


class RowMeasurer:
    """Each trained row measured by ``eval quality``'s function (k=3, T=0, every prompt, fp32 target), the target
    loaded once, on the first row that needs it. Once this run has measured a row, the results object is rewritten
    after each row, so a cut call keeps every row it measured; a kept row (measured by an earlier run) joins it with
    the device and date that measured it, and alone rewrites nothing."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rows: dict[str, dict[str, Any]] = {}
        self.loaded: tuple[Any, Any, Any] | None = None  # (run config, target, prompts)

    def __call__(self, name: str) -> None:
        from eval.gate_stats import bootstrap

        kept = measured_file(self.args, name)
        if kept.is_file():
            self.rows[name] = json.loads(kept.read_text())
        else:
            self.rows[name] = self.measure(name)
            write_json_atomic(kept, self.rows[name])
        if self.loaded is not None:
            record("peer_quality", summary(self.rows, self.args, bootstrap(self.loaded[0].gate)))

    def measure(self, name: str) -> dict[str, Any]:
        from eval.quality import quality, setup

        training = json.loads((self.args.out / name / TRAINED).read_text())
        ckpt = training.pop("checkpoint")
        if self.loaded is None:
            self.loaded = setup(self.args.config, self.args.limit)
        cfg, target, prompts = self.loaded
        figures = quality(cfg, target, prompts, ckpt, [(3, 0.0)], self.args.timing_prompts, context_prompts=0,
                          per_prompt_columns=True, keep_dir=self.args.out / "measured")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next row trains in another process on the same GPU
        return {"checkpoint": str(ckpt), "training": training, **measured_here(),
                **{ds: {key: figures[ds][key] for key in ("tau", "ci", "alpha", "prompts", "lossless_mismatches",
                                                          "per_prompt")}
                   for ds in prompts}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    sf = sub.add_parser("specforge", help="(internal) train one SpecForge row")
    sf.add_argument("--config", type=Path, required=True)
    sf.add_argument("--recipe", choices=["ours", "shipped"], required=True)
    sf.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", type=Path)
    ap.add_argument("--conversations", type=Path)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--steps", type=int, help="optimizer steps instead of --epochs (smoke runs)")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every row")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-peer"))
    ap.add_argument("--timing-prompts", type=int, default=4)
    ap.add_argument("--limit", type=int, help="prompts per dataset (smoke runs; figures are for all)")
    args = ap.parse_args()
    if args.cmd == "specforge":
        return cmd_specforge(args)
    if args.config is None or args.conversations is None:
        ap.error("--config and --conversations are required")
    measure = RowMeasurer(args)
    with torch.no_grad():  # this process only measures; each row trains in a process of its own
        for name in args.rows:
            train_row(args, name)
            measure(name)
    for name, row in measure.rows.items():
        print(name, {ds: round(v["tau"], 3) for ds, v in row.items() if isinstance(v, dict) and "tau" in v})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Whether an eval prompt reached training reworded: the eval prompts that share a run of n words (13 by default, as
in GPT-3's overlap check; 8 as a looser look) with a user turn of the training conversations.

    python bench/prompt_overlap.py --config configs/smollm2-135m-h200.yaml \
        --conversations runs/smollm2-h200-mt/conversations.jsonl runs/smollm2-h200-self/conversations.jsonl

Ingest drops a training record whose user turn *is* an eval prompt (case and whitespace aside); this measures what
that exact match cannot see: a prompt copied with words around it, or a prompt the target wrote itself that repeats
one. Each eval dataset's measured turn (``turn``) of every record is checked against each conversations file apart,
so a figure says which source brought an overlap in. Recorded as "prompt_overlap" (or --name): per n, dataset and
file, how many prompts share a run, and for each such prompt its index in the dataset and the first run shared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.results import record
from common.cli import one_line_errors
from common.config import DatasetConfig, load_config
from common.files import iter_jsonl
from data_prep.decontaminate import first_shared_ngram, ngram_index
from eval.prompts import load_eval_turns


def measured_turns(ds: DatasetConfig) -> list[str]:
    """The user turn each record of ``ds`` is measured on, every record as ``eval quality`` reads them (its limit
    lifted; records with fewer user turns left out, as eval leaves them out)."""
    turns, _ = load_eval_turns(ds.model_copy(update={"limit": None}))
    return [t[-1] for t in turns]


def training_turns(path: Path) -> list[str]:
    """Every user turn of every conversation in ``path``; a line that is not a conversation is an error naming it."""
    turns = []
    for n, rec in iter_jsonl(path):
        try:
            turns += [m["content"] for m in rec["messages"] if m["role"] == "user"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: not a conversation with messages ({e})") from None
    return turns


def overlaps(evals: dict[str, list[str]], training: dict[str, list[str]], n: int) -> dict[str, dict[str, dict]]:
    """Per eval dataset and training file: the prompts sharing a run of ``n`` words, by index, with that run."""
    out: dict[str, dict[str, dict]] = {}
    for source, turns in training.items():
        index = ngram_index(turns, n)
        for name, prompts in evals.items():
            shared = {i: run for i, text in enumerate(prompts) if (run := first_shared_ngram(text, n, index))}
            out.setdefault(name, {})[source] = {"prompts": len(prompts), "sharing": len(shared),
                                                "examples": [{"index": i, "run": run} for i, run in shared.items()]}
    return out


@one_line_errors()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="Run config whose eval.datasets are checked.")
    ap.add_argument("--conversations", nargs="+", required=True, type=Path, help="Training conversations files.")
    ap.add_argument("--ngram", nargs="+", type=int, default=[13, 8], help="Run lengths in words (default 13 8).")
    ap.add_argument("--name", default="prompt_overlap",
                    help="The results object to write: another name keeps an earlier stage's files' figures.")
    args = ap.parse_args()
    if any(n < 1 for n in args.ngram):
        ap.error(f"--ngram {args.ngram}: each length must be at least 1 word")
    for path in args.conversations:
        if not path.is_file():
            ap.error(f"--conversations {path}: no such file")
    cfg = load_config(args.config)
    evals = {ds.name: measured_turns(ds) for ds in cfg.eval.datasets}
    training = {str(p): training_turns(p) for p in args.conversations}
    figures = {"ngram": {str(n): overlaps(evals, training, n) for n in args.ngram},
               "training_turns": {source: len(turns) for source, turns in training.items()}}
    for n, by_ds in figures["ngram"].items():
        for name, by_src in by_ds.items():
            print(f"{n}-word runs, {name}: " + "; ".join(f"{s['sharing']} of {s['prompts']} share one with {src}"
                                                         for src, s in by_src.items()))
    record(args.name, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())

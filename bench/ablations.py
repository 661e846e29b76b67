"""The drafter's levers, one at a time: same data, same schedule, one change per row, tau measured.

    python bench/ablations.py --config runs/smollm2-h200/config.yaml \
        --conversations runs/smollm2-h200/conversations.jsonl --samples 0 --epochs 1 --procs-per-gpu 6

Every row trains online on the first --samples regenerated conversations (0: all; the held-out split is theirs)
for --epochs epochs (or --steps steps), from scratch or, when the config sets drafter.init_from, from that drafter
(a later stage's levers; the object's ``init_from`` and ``init_from_fingerprint``, the sha256 of its weights, say
which: a path may hold other weights later), then is measured like the shipped drafter (k=3, T=0, every MT-Bench
and HumanEval prompt, fp32 target, lossless checked). Rows (--rows picks some):
- baseline: the config's recipe and data;
- init_from_target: the drafter starts from the target's last layer, final norm and head (left out where the
  config's drafter.init is target already);
- lr_x3, lr_x10: three and ten times train.lr (whether the recipe is learning-rate bound at its step count);
- ttt_3: TTT length 3 instead of the config's;
- mlp_x3: an MLP three times the target's width (drafter.intermediate_size; capacity, at a size cost);
- draft_vocab_32k: a 32k draft vocab (the config's 16k is what fits the 32 MB the shipped drafter may weigh:
  this row is its tau cost);
- loop_copies_dropped: the data with each loop answer's kept copies (regenerate.loop_keep_tokens) taken off
  again, i.e. answers cut at the loop's first copy: whether the bounded loop tail teaches decoding;
- first_turn_short_answers: first turns with answers of at most 256 tokens (whether answer length matters);
- first_turns_only: each conversation's first turn and whole first answer: against the baseline on multi-turn
  conversations, what the later turns (longer histories) add at the same number of steps;
- aux_scaled: fc reads each aux state scaled to rows of RMS about 1 while training (drafter.aux_scale=per_state;
  folded into fc at save, so the checkpoint is served as is);
- sharp_teacher: trained toward the target's distribution at temperature 0.5 (train.teacher_temperature), nearer
  its argmax, the token greedy verification accepts;
- aux_late: the top aux id moved to N-2, the latest layer whose output SGLang can capture (its residual stream
  is closest to the target's own next-token prediction; the config's is N-3);
- lk_alpha, lk_lambda: the LK losses on the expected acceptance instead of the KL to the teacher (train.loss);
- answers_sampled: the same conversations with the answers the target sampled at the serving temperature
  (--sampled-conversations: the same prompts regenerated with regenerate.temperature > 0 and a seed): whether
  data drawn the way users are served lifts tau at that temperature;
- answers_both: each conversation twice, with its greedy answers and with its sampled ones: whether more answer
  text for the same prompts lifts tau at equal steps;
- self_prompts: the conversations plus those of prompts the target wrote itself (--self-conversations: data_prep
  synthesize, ingest and regenerate into another run dir): whether prompts in the target's own domain lift tau
  when the prompt corpus is used up (at equal steps with --steps; --epochs gives this row more data and steps).
--temperatures 0 1 measures every row at each temperature (T > 0: SGLang's acceptance rule, eval.acceptance, with
the oracle's tau beside it, a drafter proposing the target's own greedy token, read from ``eval.oracle_cache`` when
an eval measured it before); the keep decision reads T = 0. A sampled regeneration cut short still makes a fair
answers_sampled row with --sampled-subset: every row then trains on the conversations the sampled file holds (the
others are counted, ``conversations_not_sampled``), and --record-as ablations_sampled keeps that run's object (and
its rows, runs/bench-ablations_sampled/) apart from the full-data one.
Rows run in --procs-per-gpu worker processes on every visible GPU; a worker trains each of its rows with the
user's own command (``python -m train``, a process of its own: <row>/train.out) and then measures it. Each row
is written when it ends (<out>/row-<name>.json and "ablations" in the results file), so a killed run keeps the
rows it finished; a rerun skips them (a row cut mid-training resumes from its checkpoint of every 100 steps).
A row whose training prints nothing for --stall-seconds is killed and listed under "rows_failed" with the reason
(side by side on one GPU, trainers have stopped right after loading the target; a rerun retries the row).

<out>/keep.json: the config overrides whose rows beat the baseline's mean tau by more than --margin with a drafter
of at most --max-drafter-mb (what may ship; a larger one is listed under ``not_kept_too_large``), for the final run
to use ("keep what helps"; data rows are reported, not kept: they change regeneration).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bench.results import measured_here, record
from bench.runs import REPO, holdout_at, make_run, run, train_command
from common import parent_death
from common.cli import exit_reason
from common.config import RunConfig
from common.files import write_json_atomic, write_jsonl_atomic
from target_model.aux_layers import resolve_aux_layer_ids
from train.holdout_curve import read_train_log

SHORT_ANSWER_TOKENS = 256
SAMPLED_ROWS = ("answers_sampled", "answers_both")  # the rows that read --sampled-conversations
DATA_ROWS = ("loop_copies_dropped", "first_turn_short_answers", "first_turns_only", *SAMPLED_ROWS, "self_prompts")


def row_overrides(cfg: RunConfig, target_intermediate: int, target_layers: int) -> dict[str, list[str]]:
    """Each row's config overrides (data rows: none; their data differs)."""
    low, mid, _ = resolve_aux_layer_ids(cfg.target.aux_layer_ids, None, target_layers)
    return {"baseline": [], "init_from_target": ["drafter.init=target"], "lr_x3": [f"train.lr={3 * cfg.train.lr:g}"],
            "lr_x10": [f"train.lr={10 * cfg.train.lr:g}"],
            "ttt_3": ["train.ttt_length=3"], "mlp_x3": [f"drafter.intermediate_size={3 * target_intermediate}"],
            "draft_vocab_32k": ["drafter.draft_vocab_size=32000"], "loop_copies_dropped": [],
            "first_turn_short_answers": [], "first_turns_only": [], "aux_scaled": ["drafter.aux_scale=per_state"],
            "sharp_teacher": ["train.teacher_temperature=0.5"],
            "aux_late": [f"target.aux_layer_ids=[{low},{mid},{target_layers - 2}]"],
            "lk_alpha": ["train.loss=lk_alpha"], "lk_lambda": ["train.loss=lk_lambda"], "answers_sampled": [],
            "answers_both": [], "self_prompts": []}


def shorten(text: str, tokenizer: Any, keep: int | None = None, drop: int = 0) -> str:
    """``text`` cut to its first ``keep`` tokens, or without its last ``drop`` tokens."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    end = len(ids) - drop if keep is None else keep
    return text if end >= len(ids) else tokenizer.decode(ids[:max(end, 0)])


def first_turns(recs: list[dict[str, Any]], tokenizer: Any, keep: int | None = SHORT_ANSWER_TOKENS
                ) -> list[dict[str, Any]]:
    """The first user turn and the first answer, cut at ``keep`` tokens (None: whole), of each conversation."""
    out = []
    for rec in recs:
        msgs = rec["messages"]
        first = next(j for j, m in enumerate(msgs) if m["role"] == "assistant")
        answer = msgs[first]["content"] if keep is None else shorten(msgs[first]["content"], tokenizer, keep=keep)
        reasons = rec.get("finish_reasons", [])[:1]
        if reasons and answer != msgs[first]["content"]:
            reasons = ["length"]  # cut here: the target did not end the turn (no loss on an end-of-turn marker)
        out.append(rec | {"messages": msgs[:first] + [{**msgs[first], "content": answer}], "finish_reasons": reasons})
    return out


def loop_copies_dropped(recs: list[dict[str, Any]], tokenizer: Any, copies: int) -> list[dict[str, Any]]:
    """Each answer that ended in a loop (finish reason "loop") without its last ``copies`` tokens: the copies
    regenerate.loop_keep_tokens kept after the loop's first copy. The regenerated answers are the last
    ``len(finish_reasons)`` assistant turns (an opening assistant turn is the source's)."""
    out = []
    for rec in recs:
        reasons = rec.get("finish_reasons", [])
        answers = [j for j, m in enumerate(rec["messages"]) if m["role"] == "assistant"]
        answers = answers[len(answers) - len(reasons):]
        msgs = [dict(m) for m in rec["messages"]]
        for j, reason in zip(answers, reasons, strict=True):
            if reason == "loop":
                msgs[j]["content"] = shorten(msgs[j]["content"], tokenizer, drop=copies)
        out.append(rec | {"messages": msgs})
    return out


def same_conversations(recs: list[dict], sampled: list[dict], path: Path) -> list[dict]:
    """The records of ``sampled`` (the same prompts regenerated at another temperature) for the conversations of
    ``recs``, in their order: the row must differ in its answers alone. A conversation it lacks is an error."""
    by_id = {r["id"]: r for r in sampled}
    if missing := [r["id"] for r in recs if r["id"] not in by_id]:
        raise ValueError(f"{path}: {len(missing)} of the {len(recs)} conversations are missing (first: "
                         f"{missing[0]}); regenerate the same prompts file")
    return [by_id[r["id"]] for r in recs]


def sampled_subset(recs: list[dict], sampled: list[dict]) -> list[dict]:
    """The conversations of ``recs`` that ``sampled`` holds too, in ``recs``' order: what every row trains on when
    the sampled regeneration was cut short, so the answers_sampled row still differs in its answers alone."""
    have = {r["id"] for r in sampled}
    return [r for r in recs if r["id"] in have]


def both_answers(recs: list[dict], sampled: list[dict]) -> list[dict]:
    """Each conversation with its greedy answers, then each with its sampled ones under the id ``<id>@sampled``
    (ids stay unique: resume reads them). The held-out split hashes ids, so a held-out conversation's sampled twin
    may train: this row's held-out figures flatter it; its tau, on the eval sets, does not."""
    return [*recs, *({**r, "id": f"{r['id']}@sampled"} for r in sampled)]


def measure(target: Any, drafter: Any, aux_ids: list[int], prompts: dict, cfg: RunConfig, temperature: float,
            refs: Mapping[str, Any] | None) -> dict[str, Any]:
    """tau and alpha_k per dataset at k = 3 and ``temperature`` (T = 0 also the lossless mismatches)."""
    from eval.batched_eval import acceptance

    stats = acceptance(target, drafter, aux_ids, prompts, 3, temperature, cfg.eval.max_new_tokens,
                       refs if temperature == 0 else None, seed=cfg.eval.seed, rule=cfg.eval.acceptance,
                       tie_epsilon=cfg.eval.tie_epsilon)
    out = {"tau": {n: s["tau"] for n, s in stats.items()},
           "alpha": {n: [round(a, 4) if a == a else None for a in s["alpha_conditional"]]  # NaN: never reached
                     for n, s in stats.items()}}
    if temperature == 0 and refs is not None:
        out["lossless_mismatches"] = {n: len(s["lossless_mismatches"]) for n, s in stats.items()}
    return out


def worker(args: argparse.Namespace) -> int:
    """Train and measure the given rows in this process (on the GPU it was given); rows go to
    <out>/row-<name>.json."""
    from common.config import load_config
    from drafter.sglang_checkpoint import served_bytes
    from eval.batched_eval import GreedyReferences
    from eval.oracle_cache import oracle_acceptance
    from eval.quality import load_drafter, setup

    cfg, target, prompts = setup(args.config, args.limit)
    refs = GreedyReferences(target, prompts, cfg.eval.max_new_tokens)
    any_aux = resolve_aux_layer_ids(cfg.target.aux_layer_ids, None, target.num_layers)  # the oracle reads none
    for t in args.temperatures if args.oracle else ():  # the ceiling at each T > 0, whatever the row: one worker
        oracle = args.out / f"oracle-T{t:g}.json"
        if t > 0 and not oracle.is_file():
            stats = oracle_acceptance(target, any_aux, prompts, 3, t, cfg.eval.max_new_tokens, cfg.eval.acceptance,
                                      cfg.eval.seed)
            write_json_atomic(oracle, {name: s["tau"] for name, s in stats.items()})
    schedule = [f"train.epochs={args.epochs}"] if args.steps is None else [f"train.max_steps={args.steps}"]
    for name in args.rows.split(","):
        overrides = json.loads(args.overrides)[name]
        conv = args.out / f"data-{name if name in DATA_ROWS else 'subset'}.jsonl"
        run_dir = args.out / name
        common = ["train.source=online", *schedule, "train.save_every=100", "train.eval_every=100000",
                  "tracking.report_to=none"]
        config = make_run(args.config, run_dir, conv, [*common, *overrides])
        start = time.time()
        # The user's command, in its own process: this one has used the GPU (the references), and forking a
        # process that holds a CUDA context (training's render pool, its data loader) can hang the children.
        failed = args.out / f"failed-{name}.json"
        failed.unlink(missing_ok=True)  # a retry: an earlier call's failure no longer describes this row
        try:
            run(train_command(config), log=run_dir / "train.out", silent_limit_s=args.stall_seconds)
        except RuntimeError as e:  # this row is reported as failed; the worker's other rows still run
            reason = str(e).splitlines()[0]
            write_json_atomic(failed, {"name": name, "reason": reason})
            print(f"{name}: {reason}", flush=True)
            continue
        trained = time.time() - start
        # the row's own config: its aux ids may differ from the base config's (aux_late)
        drafter, aux_ids = load_drafter(target, load_config(config), run_dir / "checkpoints" / "best")
        at_zero = measure(target, drafter, aux_ids, prompts, cfg, 0.0, refs)
        hotter = {f"{t:g}": measure(target, drafter, aux_ids, prompts, cfg, t, None)
                  for t in args.temperatures if t > 0}
        log = read_train_log(run_dir)
        last = max(r["step"] for r in log if "loss" in r)
        row = {"name": name, "overrides": overrides, "command": f"python -m train --config {config}", **measured_here(),
               "steps": last, "tokens_seen": max((r.get("tokens_seen", 0) for r in log), default=0),
               "train_seconds": round(trained, 1),
               **at_zero, **({"at_temperature": hotter} if hotter else {}),
               "holdout": {k.split("/")[1]: v for k, v in holdout_at(run_dir, last).items() if "/" in k},
               "checkpoint": str(run_dir / "checkpoints" / "best"),
               "drafter_mb": round(served_bytes(run_dir / "checkpoints" / "best") / 1e6, 1)}
        write_json_atomic(args.out / f"row-{name}.json", row)
        print(json.dumps(row), flush=True)
        del drafter
        torch.cuda.empty_cache()
    return 0


def write_data(out: Path, names: list[str], recs: list[dict], sampled: list[dict] | None,
               own: list[dict] | None, tokenizer: Any, copies: int) -> None:
    """What the rows train on: <out>/data-subset.jsonl, and each data row's own file."""
    write_jsonl_atomic(out / "data-subset.jsonl", recs)
    if own is not None:
        if clash := {r["id"] for r in recs} & {r["id"] for r in own}:
            raise ValueError(f"--self-conversations: {len(clash)} ids are in --conversations too (first: "
                             f"{min(clash)}); give conversations of the target's own prompts")
        write_jsonl_atomic(out / "data-self_prompts.jsonl", [*recs, *own])
    if "first_turn_short_answers" in names:
        write_jsonl_atomic(out / "data-first_turn_short_answers.jsonl", first_turns(recs, tokenizer))
    if "first_turns_only" in names:
        write_jsonl_atomic(out / "data-first_turns_only.jsonl", first_turns(recs, tokenizer, keep=None))
    if "loop_copies_dropped" in names:
        write_jsonl_atomic(out / "data-loop_copies_dropped.jsonl", loop_copies_dropped(recs, tokenizer, copies))
    if sampled is not None:
        write_jsonl_atomic(out / "data-answers_sampled.jsonl", sampled)
        if "answers_both" in names:
            write_jsonl_atomic(out / "data-answers_both.jsonl", both_answers(recs, sampled))


def mean_tau(tau: dict[str, float]) -> float:
    return sum(tau.values()) / len(tau)


def summarize(out: Path, names: list[str], margin: float, figures: dict[str, Any], name: str = "ablations",
              max_drafter_mb: float = 32.0) -> list[str]:
    """Record the rows finished so far (each with its tau gain over the baseline) as ``name`` in the results file,
    and write keep.json: the overrides of rows that gain more than ``margin`` and whose drafter stays within
    ``max_drafter_mb`` (a lever that buys tau with a drafter too large to ship is reported, not kept)."""
    rows = [json.loads((out / f"row-{n}.json").read_text()) for n in names if (out / f"row-{n}.json").is_file()]
    base = next((r for r in rows if r["name"] == "baseline"), None)
    keep: list[str] = []
    too_large: dict[str, str] = {}
    if base is not None:
        for r in rows:
            r["delta_mean_tau"] = round(mean_tau(r["tau"]) - mean_tau(base["tau"]), 4)
            for t, at in r.get("at_temperature", {}).items():
                if t in base.get("at_temperature", {}):
                    at["delta_mean_tau"] = round(mean_tau(at["tau"]) - mean_tau(base["at_temperature"][t]["tau"]), 4)
            if r["name"] != "baseline" and r["overrides"] and r["delta_mean_tau"] > margin:
                if r.get("drafter_mb", 0.0) > max_drafter_mb:
                    too_large[r["name"]] = f"{r['drafter_mb']} MB drafter > {max_drafter_mb:g} MB"
                else:
                    keep += r["overrides"]
    (out / "keep.json").write_text(json.dumps(keep))
    missing = [n for n in names if n not in {r["name"] for r in rows}]
    failed = {n: json.loads((out / f"failed-{n}.json").read_text())["reason"] for n in missing
              if (out / f"failed-{n}.json").is_file()}
    oracle = {p.stem.removeprefix("oracle-T"): json.loads(p.read_text()) for p in sorted(out.glob("oracle-T*.json"))}
    figures = figures | ({"oracle_tau": oracle} if oracle else {})
    record(name, figures | {"rows": rows, "rows_missing": missing, "rows_failed": failed, "kept_overrides": keep,
                            "keep_margin": margin, "max_drafter_mb": max_drafter_mb,
                            "not_kept_too_large": too_large})
    return keep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--conversations", required=True, type=Path)
    ap.add_argument("--out", type=Path, help="where rows are kept (default: runs/bench-<--record-as>)")
    ap.add_argument("--samples", type=int, default=3000, help="the first N conversations (0: all)")
    schedule = ap.add_mutually_exclusive_group()
    schedule.add_argument("--steps", type=int, help="train each row this many steps")
    schedule.add_argument("--epochs", type=int, default=1, help="or this many epochs (default)")
    ap.add_argument("--rows", default="all", help="comma-separated row names (default: all)")
    ap.add_argument("--procs-per-gpu", type=int, default=1)
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--max-drafter-mb", type=float, default=32.0,
                    help="a lever whose drafter is larger than this is reported, never kept (what may ship)")
    ap.add_argument("--stall-seconds", type=float, default=240.0,
                    help="a row's training that prints nothing for this long is killed and reported as failed")
    ap.add_argument("--limit", type=int, help="eval prompts per dataset (smoke runs; figures are for all)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                    help="measure every row at each (0 first: the keep decision reads it)")
    ap.add_argument("--sampled-conversations", type=Path,
                    help="the same prompts regenerated at regenerate.temperature > 0: the answers_sampled row")
    ap.add_argument("--sampled-subset", action="store_true",
                    help="every row trains on the conversations the sampled file holds (a regeneration cut short)")
    ap.add_argument("--self-conversations", type=Path,
                    help="conversations of prompts the target wrote itself (data_prep synthesize): row self_prompts")
    ap.add_argument("--record-as", default="ablations", help="the object's name in the results file")
    ap.add_argument("--worker-rows", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", help=argparse.SUPPRESS)
    ap.add_argument("--oracle", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.sampled_subset and args.sampled_conversations is None:
        ap.error("--sampled-subset needs --sampled-conversations")
    args.out = args.out or Path(f"runs/bench-{args.record_as}")
    if args.temperatures[0] != 0 or any(t < 0 for t in args.temperatures):
        ap.error(f"--temperatures {args.temperatures}: the first must be 0 (the keep decision reads T = 0), none below")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker_rows:
        args.rows = args.worker_rows
        return worker(args)

    from common.config import load_config
    from data_prep.capture import read_conversations
    from drafter.sglang_checkpoint import fingerprint
    from target_model.hf_model import load_target

    cfg = load_config(args.config)
    tgt = load_target(cfg.target.name, device="cpu")
    rows = row_overrides(cfg, tgt.model.config.intermediate_size, tgt.model.config.num_hidden_layers)
    names = list(rows) if args.rows == "all" else args.rows.split(",")
    if unknown := [n for n in names if n not in rows]:
        ap.error(f"--rows: unknown {', '.join(unknown)}; rows are {', '.join(rows)}")
    if "init_from_target" in names and cfg.drafter.init == "target":
        print("init_from_target: left out, the config's drafter already starts from the target", file=sys.stderr)
        names.remove("init_from_target")
    for needy, dest in ((SAMPLED_ROWS, "sampled_conversations"), (("self_prompts",), "self_conversations")):
        if (wanted := [n for n in needy if n in names]) and getattr(args, dest) is None:
            option = "--" + dest.replace("_", "-")
            if args.rows != "all":
                ap.error(f"--rows {','.join(wanted)} needs {option}")
            print(f"{', '.join(wanted)}: left out, no {option}", file=sys.stderr)
            names = [n for n in names if n not in wanted]
    copies = cfg.regenerate.loop_keep_tokens
    if "loop_copies_dropped" in names and copies == 0:
        print("loop_copies_dropped: left out, regenerate.loop_keep_tokens is 0 (no copies were kept)", file=sys.stderr)
        names.remove("loop_copies_dropped")
    sampled_rows = [n for n in SAMPLED_ROWS if n in names]
    not_sampled: dict[str, int] = {}
    try:  # validated: a bad line, or a sampled file that lacks a conversation, is one line naming it
        recs = read_conversations(args.conversations)
        sampled_all = (read_conversations(args.sampled_conversations) if args.sampled_conversations is not None
                       and (sampled_rows or args.sampled_subset) else None)
        if args.sampled_subset and sampled_all is not None:
            kept = sampled_subset(recs, sampled_all)
            not_sampled = {"conversations_not_sampled": len(recs) - len(kept)}
            print(f"{args.sampled_conversations}: {len(kept):,} of the {len(recs):,} conversations were sampled; "
                  f"every row trains on those ({len(recs) - len(kept):,} left out)", file=sys.stderr)
            recs = kept
        recs = recs[:args.samples] if args.samples > 0 else recs
        sampled = (same_conversations(recs, sampled_all, args.sampled_conversations)
                   if sampled_rows else None)
        own = read_conversations(args.self_conversations) if "self_prompts" in names else None
        write_data(args.out, names, recs, sampled, own, tgt.tokenizer, copies)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    todo = [n for n in names if not (args.out / f"row-{n}.json").is_file()]
    figures = {"conversations": len(recs), **not_sampled, **({"self_conversations": len(own)} if own else {}),
               "k": 3, "temperatures": args.temperatures, "init_from": cfg.drafter.init_from,
               **({"init_from_fingerprint": fingerprint(cfg.drafter.init_from)} if cfg.drafter.init_from else {}),
               **({"steps": args.steps} if args.steps is not None else {"epochs": args.epochs})}
    slots = max(1, torch.cuda.device_count()) * args.procs_per_gpu
    procs = []
    for s in range(min(slots, len(todo))):
        cmd = [sys.executable, __file__, "--config", args.config, "--conversations", str(args.conversations),
               "--out", str(args.out), "--worker-rows", ",".join(todo[s::slots]), "--overrides", json.dumps(rows),
               "--stall-seconds", str(args.stall_seconds), "--temperatures", *map(str, args.temperatures),
               *(["--steps", str(args.steps)] if args.steps is not None else ["--epochs", str(args.epochs)])]
        cmd += ["--limit", str(args.limit)] if args.limit else []
        cmd += ["--oracle"] if s == 0 else []  # the first worker measures the oracle, once for all rows
        gpu = s % max(1, torch.cuda.device_count())
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)} if torch.cuda.is_available() else dict(os.environ)
        # rows side by side share the cores: each trainer's compiler gets its share of worker processes
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // slots)))
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(args.out / f"worker{s}.log", "w"),
                                      stderr=subprocess.STDOUT, **parent_death.stage_kwargs()))  # die with us
    seen = {n for n in names if (args.out / f"row-{n}.json").is_file()}
    while True:  # record each row as it lands: a killed run keeps what finished
        running = [p.poll() is None for p in procs]
        done = {n for n in names if (args.out / f"row-{n}.json").is_file()}
        if done != seen or not any(running):
            seen = done
            keep = summarize(args.out, names, args.margin, figures, args.record_as, args.max_drafter_mb)
        if not any(running):
            break
        time.sleep(5)
    codes = [p.returncode for p in procs]
    if any(codes) or len(seen) < len(names):
        print(f"ablation workers ended: {', '.join(exit_reason(c) for c in codes)}; see {args.out}/worker*.log",
              file=sys.stderr)
    print(f"kept: {keep}")
    return 0 if not any(codes) and len(seen) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())

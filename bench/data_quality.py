"""How much of the regenerated answers is a degenerate loop, before and after regenerate.stop_loops.

    # a conversations.jsonl already regenerated, measured under a label:
    python bench/data_quality.py --config configs/smollm2-135m-h200.yaml --label before \
        --conversations runs/smollm2-h200/conversations.jsonl
    # on a GPU, one command for the pair: the first N prompts regenerated with the hf backend without
    # stop_loops (before) and with it (after), each measured and timed:
    python bench/data_quality.py --config configs/smollm2-135m-h200.yaml --regenerate 1200 --first-turns
    # a CPU smoke run (figures not for quoting; BENCH_RESULTS keeps them out of bench/results.json):
    BENCH_RESULTS=/tmp/smoke.json python bench/data_quality.py --config configs/smollm2-135m.yaml \
        --prompts runs/smollm2-135m/prompts.jsonl --regenerate 24 --set regenerate.max_new_tokens=256
    # the eval's own greedy answers (label "eval_greedy"): every prompt of the config's eval datasets (their
    # limits lifted, as eval.quality does), first turn, chat-templated, the target in float32 (the eval's
    # precision) on the config's device, eval.max_new_tokens each; --limit N per dataset for smoke runs:
    python bench/data_quality.py --config configs/smollm2-135m-h200.yaml --set target.device=cpu --eval-sets

Per label, under "data_quality" in bench/results.json (a run writing one label keeps the other's figures):
conversations, answers, answer_tokens (the answers' text under the target's tokenizer), capped_share (finish
reason "length"), loop_cut_share ("loop"), loop_token_share (answer tokens inside a loop tail that
engine.loops finds in the answers not already cut, over all answer tokens), after_first_repeat_char_share
(the issue's measure: answer characters from the first 64-character window that already occurred earlier in
the same answer, over all answer characters), mean_answer_tokens, median_answer_tokens. With --regenerate also
seconds, answer_tokens_per_s (kept answer tokens a second) and generated_tokens_per_s (plus the tokens a loop
cut dropped), and the run's loop cuts.

With --eval-sets, per eval dataset under "eval_greedy": answers, answer_tokens (the tokens each greedy answer
generated, its end-of-turn token not counted), loop_answers (answers ending in a loop tail), loop_tokens and
loop_token_share (tokens inside those tails by engine.loops on the generated tokens themselves, over all
answer tokens), capped_share (answers that ran to max_new_tokens without ending), mean_answer_tokens,
median_answer_tokens and seconds (that dataset's greedy pass).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.results import command_line, measured_here, record, recorded
from common.cli import one_line_errors
from common.config import RunConfig, load_config
from data_prep.capture import numbered_conversations
from data_prep.regenerate_files import load_prompt_records
from data_prep.regenerate_loop import regenerate
from data_prep.regenerate_summary import answer_text
from data_prep.step_failed import over_failure_share
from engine.loops import after_first_repeat_chars, loop_tail_tokens, retokenized_loop_start

NAME = "data_quality"
LABELS = ("before", "after", "eval_greedy")
CHAR_WINDOW = 64  # the window


def read_records(path: Path) -> list[dict[str, Any]]:
    """The conversations regenerate wrote to ``path`` (a bad line is an error naming it), each with a finish reason
    per answer: the capped and loop-cut shares are counted from them, so a file without them cannot be measured."""
    numbered = numbered_conversations(path)
    for n, rec in numbered:
        answers = sum(m["role"] == "assistant" for m in rec["messages"])
        reasons = rec.get("finish_reasons")
        if reasons is None or len(reasons) < answers:
            got = "no finish_reasons" if reasons is None else f"{len(reasons)} finish_reasons for {answers} answers"
            raise ValueError(f"{path}:{n}: {got}; measure a conversations.jsonl regenerate wrote (one finish reason "
                             "per answer)")
    return [rec for _, rec in numbered]


def token_figures(lengths: list[int], loop_tokens: int) -> dict[str, Any]:
    """The figures every label shares: answer tokens, the share of them inside loop tails, mean and median."""
    tokens = sum(lengths)
    return {"answers": len(lengths), "answer_tokens": tokens,
            "loop_token_share": round(loop_tokens / max(tokens, 1), 4),
            "mean_answer_tokens": round(tokens / max(len(lengths), 1), 1),
            "median_answer_tokens": statistics.median(lengths) if lengths else 0}


def measure(records: list[dict[str, Any]], tokenizer: Any, min_repeat_tokens: int = 64,
            max_period: int = 256) -> dict[str, Any]:
    """The figures of one set of regenerated conversations (plain numbers)."""
    texts, reasons = [], []
    for rec in records:
        answers = [m for m in rec["messages"] if m["role"] == "assistant"]
        texts += [answer_text(m) for m in answers]
        reasons += rec["finish_reasons"][: len(answers)]
    lengths, loop_tokens = [], 0
    for a in range(0, len(texts), 256):
        for ids, reason in zip(tokenizer(texts[a:a + 256], add_special_tokens=False)["input_ids"],
                               reasons[a:a + 256], strict=True):
            lengths.append(len(ids))
            if reason != "loop":  # a cut answer ends with its loop's first copy
                start = retokenized_loop_start(ids, min_repeat_tokens, max_period)
                loop_tokens += 0 if start is None else len(ids) - start
    chars = sum(map(len, texts))
    n = max(len(texts), 1)
    return {"conversations": len(records), **token_figures(lengths, loop_tokens),
            "capped_share": round(reasons.count("length") / n, 4),
            "loop_cut_share": round(reasons.count("loop") / n, 4),
            "after_first_repeat_char_share": round(sum(after_first_repeat_chars(t, CHAR_WINDOW) for t in texts)
                                                   / max(chars, 1), 4),
            "loop_min_repeat_tokens": min_repeat_tokens, "loop_max_period": max_period}


def measure_answers(answers: list[list[int]], stops: set[int], max_new: int, min_repeat_tokens: int = 64,
                    max_period: int = 256) -> dict[str, Any]:
    """The figures of greedy answers as generated (token ids; one that ended carries its stop token last)."""
    lengths, loop_answers, loop_tokens, capped = [], 0, 0, 0
    for ids in answers:
        ended = bool(ids) and ids[-1] in stops
        ids = ids[:-1] if ended else ids
        tail = loop_tail_tokens(ids, min_repeat_tokens, max_period)
        lengths.append(len(ids))
        loop_answers += tail > 0
        loop_tokens += tail
        capped += not ended and len(ids) >= max_new
    return {**token_figures(lengths, loop_tokens), "loop_answers": loop_answers, "loop_tokens": loop_tokens,
            "capped_share": round(capped / max(len(answers), 1), 4)}


def eval_greedy(config: str, overrides: list[str], limit: int | None = None) -> dict[str, Any]:
    """The eval's own greedy answers (eval.quality's prompts and fp32 target), measured per dataset."""
    from eval.batched_eval import greedy_references
    from eval.quality import setup
    from target_model.hf_model import stop_token_ids

    cfg, target, prompts = setup(config, limit, overrides=overrides)
    stops, max_new, r = set(stop_token_ids(target.tokenizer)), cfg.eval.max_new_tokens, cfg.regenerate
    out: dict[str, Any] = {"max_new_tokens": max_new, "dtype": str(target.dtype).removeprefix("torch."),
                           "limit": limit, "loop_min_repeat_tokens": r.loop_min_repeat_tokens,
                           "loop_max_period": r.loop_max_period}
    for name, ps in prompts.items():
        started = time.perf_counter()
        refs = greedy_references(target, {name: ps}, max_new)[name]
        seconds = time.perf_counter() - started
        out[name] = measure_answers([g.tokens for g in refs], stops, max_new, r.loop_min_repeat_tokens,
                                    r.loop_max_period) | {"seconds": round(seconds, 1)}
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    return out


def first_turns(prompts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each prompt cut after its first user turn (the issue measured first turns)."""
    out = []
    for p in prompts:
        first = next(i for i, m in enumerate(p["messages"]) if m["role"] == "user")
        out.append(p | {"messages": p["messages"][: first + 1]})
    return out


def regenerate_and_measure(cfg: RunConfig, prompts: list[dict[str, Any]], backend: Any, stop_loops: bool,
                           workdir: Path) -> dict[str, Any]:
    """The prompts regenerated by the hf backend (``backend``, reused across runs) with stop_loops on or off,
    into ``workdir``; the figures of what it wrote, and how fast."""
    regen = cfg.regenerate.model_copy(update={"stop_loops": stop_loops})
    backend.cfg = regen  # the backend reads its settings per call: one loaded target serves both runs
    out = workdir / f"conversations-{'on' if stop_loops else 'off'}.jsonl"
    out.unlink(missing_ok=True)  # a benchmark regenerates from scratch: a resumed file would time nothing
    run_cfg = cfg.model_copy(update={"regenerate": regen})
    started = time.perf_counter()
    summary = regenerate(run_cfg, prompts, backend, out)
    seconds = time.perf_counter() - started
    failed = sum(summary.failed.values())
    if over_failure_share(failed, len(prompts), cfg.regenerate.max_failure_share):  # a few are counted, not fatal
        raise ValueError(f"{failed} of {len(prompts)} prompts failed ({dict(summary.failed)}), more than "
                         f"regenerate.max_failure_share={cfg.regenerate.max_failure_share}: nothing recorded")
    figures = measure(read_records(out), backend.tok, regen.loop_min_repeat_tokens, regen.loop_max_period)
    generated = figures["answer_tokens"] + summary.loop_tokens_generated - summary.loop_tokens_kept
    return figures | {
        "regenerated_prompts": len(prompts), "failed_prompts": dict(summary.failed),
        "stop_loops": stop_loops, "max_tokens": regen.max_new_tokens,
        "temperature": regen.temperature, "dtype": cfg.target.dtype, "seconds": round(seconds, 1),
        "answer_tokens_per_s": round(figures["answer_tokens"] / seconds, 1),
        "generated_tokens_per_s": round(generated / seconds, 1), "loop_cuts": summary.loop_cuts,
        "loop_tokens_generated": summary.loop_tokens_generated, "loop_tokens_kept": summary.loop_tokens_kept}


def save(measured: dict[str, dict[str, Any]]) -> None:
    """Write the measured labels into "data_quality", keeping the labels this run did not measure."""
    old = recorded(NAME)
    stamp = {"command": command_line(), **measured_here()}
    labels = {k: v for k, v in old.items() if k in LABELS}
    labels |= {label: stamp | figures for label, figures in measured.items()}
    record(NAME, labels)


@one_line_errors()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument("--conversations", type=Path, help="measure this file (default: the run's conversations.jsonl)")
    ap.add_argument("--label", choices=["before", "after"], help="where a measured file's figures go")
    ap.add_argument("--regenerate", type=int, metavar="N", help="regenerate the first N prompts (hf backend) "
                    "into a temp dir and measure them")
    ap.add_argument("--stop-loops", choices=["on", "off", "both"], default="both",
                    help="--regenerate: without stop_loops (before), with it (after), or both (default)")
    ap.add_argument("--prompts", type=Path, help="--regenerate: the prompts.jsonl (default: the run's)")
    ap.add_argument("--first-turns", action="store_true", help="--regenerate: each prompt's first user turn only")
    ap.add_argument("--keep", type=Path, help="--regenerate: keep the conversations in this dir (before.jsonl, "
                    "after.jsonl) instead of a temp dir, e.g. to measure a drafter on the looping ones")
    ap.add_argument("--eval-sets", action="store_true", help="measure the eval's own greedy answers instead "
                    "(label eval_greedy): every eval prompt, fp32 target, eval.max_new_tokens")
    ap.add_argument("--limit", type=int, metavar="N", help="--eval-sets: the first N prompts per dataset (smoke)")
    args = ap.parse_args()
    if args.eval_sets:
        save({"eval_greedy": eval_greedy(args.config, args.set, args.limit)})
        return 0
    cfg = load_config(args.config, args.set)

    if args.regenerate is None:
        if args.label is None:
            ap.error("--label before|after is needed to measure a file")
        from target_model.hf_model import tokenizer_from_config

        path = args.conversations or cfg.conversations_path
        records = read_records(path)  # before the tokenizer loads: a bad file fails at once
        tok = tokenizer_from_config(cfg.target)
        r = cfg.regenerate
        save({args.label: {"source": str(path), **measure(records, tok, r.loop_min_repeat_tokens, r.loop_max_period)}})
        return 0

    from data_prep.backends import HFChatBackend

    cfg = cfg.model_copy(update={"regenerate": cfg.regenerate.model_copy(update={"backend": "hf"})})
    prompts = load_prompt_records(args.prompts or cfg.prompts_path, args.regenerate)
    prompts = first_turns(prompts) if args.first_turns else prompts
    backend = HFChatBackend(cfg.target, cfg.regenerate)
    runs = {"off": [False], "on": [True], "both": [False, True]}[args.stop_loops]
    measured = {}
    with tempfile.TemporaryDirectory(prefix="data-quality-") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for stop in runs:
            label = args.label if args.label and len(runs) == 1 else ("after" if stop else "before")
            measured[label] = {"first_turns": args.first_turns,
                               **regenerate_and_measure(cfg, prompts, backend, stop, workdir)}
            if args.keep:
                (workdir / f"conversations-{'on' if stop else 'off'}.jsonl").replace(workdir / f"{label}.jsonl")
            print(f"{label}: {json.dumps(measured[label])}", flush=True)
    save(measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())

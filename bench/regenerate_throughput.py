"""Regeneration speed, end to end: the regenerate command over N multi-turn conversations of a run config.

    python bench/regenerate_throughput.py --config configs/smollm2-135m-h200.yaml \
        --prompts-file runs/smollm2-h200/prompts.jsonl --conversations 4000               # one H200
    python bench/regenerate_throughput.py --config configs/smollm2-135m-h200.yaml \
        --prompts-file runs/smollm2-h200/prompts.jsonl --conversations 4000 --gpus 1 2   # and both GPUs of a node
    BENCH_RESULTS=/tmp/smoke.json python bench/regenerate_throughput.py --config configs/smollm2-135m-h200.yaml \
        --prompts-file P --conversations 6 --gpus 1 2 --exact-prompts 2 --exact-max-tokens 8 --ab-prompts 4 \
        --set target.device=cpu --set target.dtype=float32 --set regenerate.max_new_tokens=16   # a CPU smoke run

What runs: the regenerate step as ``python -m data_prep regenerate --config RUN/config.yaml`` runs it, its engine
profiled (bench/regenerate_profiled.py), as a child process, RUN a fresh run dir (under --out) holding the first
--conversations records of --prompts-file (an ingested prompts.jsonl: for the shipped config, ShareGPT with up to 8
turns) and the config with --set applied (its regenerate section as shipped: max_new_tokens 1,024, stop_loops,
max_context_tokens). For --gpus n the config's
``regenerate.devices`` is the first n GPUs (on a machine without one: n CPU processes, a smoke run).

Figures, bench/results.json:
- "regenerate": gen_tokens_per_s = the answer tokens written to conversations.jsonl (the run's summary,
  ``answer_tokens``) / the wall time of the command, start to exit (model load, compile and the tail of the
  last conversations included: not a best window), for the first --gpus entry; gen_tokens, seconds (of them
  ``regenerate_step_s`` inside the regenerate step, ``outside_step_s`` the process's start, model load and exit,
  split by ``process_phases``, the summary's ``phases`` measured in the process: its startup (interpreter and
  imports, prompts read, devices, backend: model load, resume), validate, close, and ``process_s``, its age when
  the step returned; ``exit_s`` = seconds - process_s, the summary's writing and the interpreter's exit, CUDA's
  teardown included; with several devices ``device_phases``, each worker's own),
  conversations, answers, the engine's run (rows, pages, attention kernel, decode and prefill tokens, preemptions, and
  where its seconds went: prefill and decode forwards, its host work, the caller's, decode steps by live rows; printed
  as one line per device; its ``timeline``, second by second: decoded tokens, live rows, prefill seconds, plotted in
  regenerate_timeline.png beside the results file, -gpus-2.png for two); exact_matches of --exact-prompts first turns
  answered in fp32 by the engine against ``model.generate`` token for token; with --ab-prompts N, ``attention_ab``:
  the engine alone (in this process) on N first turns with each paged-attention kernel (flex: each row reads its own
  pages; gather: a rectangle up to the furthest row), flex both with its decode step replayed from CUDA graphs
  (``flex_graphs``, the engine's default on CUDA) and run eagerly (``flex_eager``, ``decode_graphs=False``): generated
  tokens/s, decode steps and those replayed from graphs each, and how many answers agree with ``flex_graphs``'; with
  --baseline-prompts N, plain ``model.generate`` on N first turns in left-padded batches of --baseline-batch.
  ``spans``: when its conversations were open (``data_prep.conversation_spans``): whether the run's end waited
  on one long conversation's turns, which more devices cannot shorten.
- "regenerate_shares" (with --shares N): each device's share of a run over N devices (the prompts
  ``regenerate_devices.device_shares`` gives it), run alone on one GPU, and projected_speedup = the --gpus 1 run's
  seconds / the slowest share's: what N devices can at best give where only one is lent, before a several-device run's
  own costs (a process per device, the merge). A later call with --share-ranks adds the other ranks beside them.
- "regenerate_kept_caches", "regenerate_shares_kept_caches", "ddp_scaling_kept_caches" (with --kept-caches DIR;
  the last with regeneration's fields only): the same, each run compiling over inductor's and Triton's caches in
  DIR, kept from run to run (``compile_caches`` says how many files it held at the start): what a rerun on a
  machine that regenerated before pays, against a fresh machine's.
- "ddp_scaling" (with --gpus 1 2, merged beside bench/ddp_scaling.py's training fields):
  regenerate_tokens_per_s_1gpu/_2gpu and regenerate_speedup_2gpu, the same command and conversations.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from itertools import islice
from pathlib import Path
from typing import Any

import torch

from bench.results import command_line, device_name, measured_here, record, recorded, results_path
from bench.runs import run
from bench.wall_clock import synced
from common.config import load_config, write_config
from common.files import iter_jsonl, json_line
from data_prep.regenerate_devices import device_shares
from data_prep.regenerate_summary import phase_text
from engine.batched import BatchedTarget
from engine.continuous_batching import generate
from eval.prompts import render
from target_model.hf_model import TargetModel, load_target, stop_token_ids


def first_turn_prompts(tok, n: int, prompts_file: Path) -> list[list[int]]:
    """The first user turn of the first ``n`` records of an ingested prompts.jsonl, chat-templated (prompts
    over 2,048 tokens left out)."""
    texts = [next(m["content"] for m in p["messages"] if m["role"] == "user") for p in prompt_records(prompts_file, n)]
    return [ids for ids in (render(tok, t) for t in texts) if len(ids) <= 2048]


def prompt_records(prompts_file: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` records of ``prompts_file``; a line that is not one is an error naming it."""
    return [p for _, p in islice(iter_jsonl(prompts_file, fix="give --prompts-file an ingested prompts.jsonl"), n)]


def share_lines(prompts_file: Path, n: int, share: tuple[int, int] | None) -> list[bytes]:
    """The first ``n`` records of ``prompts_file``; with ``share`` (rank, devices), only those that
    ``regenerate_devices.device_shares`` gives that device of a run over that many."""
    records = prompt_records(prompts_file, n)
    if share is not None:
        rank, devices = share
        records = device_shares(records, devices)[rank]
    return [json_line(p).encode("utf-8") for p in records]


def end_to_end(config: str, overrides: list[str], prompts_file: Path, n: int, gpus: int, out: Path,
               share: tuple[int, int] | None = None, kept_caches: Path | None = None) -> dict[str, Any]:
    """The regenerate command on the first ``n`` prompts (``share``: the part of them one device of a
    several-device run gets) over ``gpus`` devices, in a fresh run dir: its wall time and what its summary says it
    wrote. Its compiles start from empty caches (inductor's and Triton's, in the run dir), as on a fresh machine,
    whatever ran before it there: ``bench/prefill_step.py`` compiles the engine's prefill layers at SmolLM2's
    shape, and a full run after it on the same machine would find them in the caches and compile for less.
    ``kept_caches``: those caches in this
    folder instead, kept from run to run (as torch keeps its own in /tmp on a machine that regenerated before): a
    rerun's compiles, warm."""
    name = f"gpus-{gpus}" if share is None else f"share-{share[0]}-of-{share[1]}"
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "prompts.jsonl").write_bytes(b"".join(share_lines(prompts_file, n, share)))
    devices = [f"cuda:{i}" for i in range(gpus)] if torch.cuda.is_available() else ["cpu"] * gpus
    cfg = load_config(config, [*overrides, f"run_dir={run_dir}", "regenerate.num_prompts=null",
                               f"regenerate.devices={json.dumps(devices)}"])
    cfg_path = write_config(cfg, run_dir / "config.yaml")
    start = time.perf_counter()
    caches = kept_caches or run_dir / "compile-caches"
    cached = f"{sum(1 for f in caches.rglob('*') if f.is_file())} files at start in {caches}" if kept_caches \
        else "empty at start"
    run([sys.executable, "bench/regenerate_profiled.py", str(cfg_path)],
        env={"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"), "TRITON_CACHE_DIR": str(caches / "triton")},
        log=run_dir / "regenerate.log")
    seconds = time.perf_counter() - start
    s = json.loads((run_dir / "data_prep_summary.json").read_text())["regenerate"]
    print(f"regenerate ({name}): {s['written']} conversations, {s['answer_tokens']} answer tokens in "
          f"{seconds:.1f} s = {s['answer_tokens'] / seconds:.0f} tokens/s", flush=True)
    engines = s["engine"] if len(devices) > 1 else {devices[0]: s["engine"]}
    spans = s["spans"] if len(devices) > 1 else {devices[0]: s["spans"]}
    for device, e in engines.items():
        print(f"  {device}: {engine_line(e)}", flush=True)
        print(f"  {device}: conversations {spans_line(spans[device])}", flush=True)
    # After the summary (printed, written), the interpreter's exit and CUDA's teardown: only timed from outside.
    exit_s = round(seconds - s["phases"]["process_s"], 2) if "process_s" in s["phases"] else None
    print(f"  process: {process_line(s['phases'], exit_s)}", flush=True)
    for r, phases in enumerate(s["device_phases"]):
        print(f"  worker {r} ({devices[r]}): {process_line(phases, None)}", flush=True)
    host = host_samples(engines)
    for where in host[0]["own"][:8] if host else []:
        print(f"  host samples (own): {where['share']:.1%} {where['where']}", flush=True)
    png = results_path().with_name(("regenerate_timeline" if name == "gpus-1" else f"regenerate_timeline-{name}")
                                   + ("-kept-caches" if kept_caches else "") + ".png")
    plot_timeline(engines, f"{name}, {s['written']} conversations, {s['answer_tokens'] / seconds:.0f} tok/s "
                  f"end to end ({seconds:.0f} s)", png)
    print(f"  timeline: {png}", flush=True)
    return {"gen_tokens_per_s": round(s["answer_tokens"] / seconds, 1), "gen_tokens": s["answer_tokens"],
            "seconds": round(seconds, 2), "regenerate_step_s": round(s["seconds"], 2),
            "outside_step_s": round(seconds - s["seconds"], 2), "exit_s": exit_s, "process_phases": s["phases"],
            **({"device_phases": s["device_phases"]} if s["device_phases"] else {}),
            "conversations": s["written"], "answers": s["turns"],
            "failed": s["failed"], "finish_reasons": s["finish_reasons"], "devices": devices,
            "engine": s["engine"], "spans": s["spans"], "max_tokens": cfg.regenerate.max_new_tokens,
            "dtype": cfg.target.dtype,
            "host_samples": host,
            "compile_caches": cached}


def plot_timeline(engines: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    """Each engine's run second by second (``Stream.stats``'s ``timeline``): decoded tokens/s, live rows and the
    share of each second spent in prefill forwards. Where a run's time goes over its course: the full-batch start,
    the tail of the longest conversations, and the compiles and prefills that stall the decode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    share = ax2.twinx()
    for device, e in engines.items():
        t = e["timeline"]
        xs = [i * t["bin_s"] for i in range(len(t["tokens"]))]
        ax.plot(xs, [n / t["bin_s"] for n in t["tokens"]], lw=0.8, label=f"{device}: decoded tokens/s")
        ax2.plot(xs, t["live_rows"], lw=0.8, label=f"{device}: live rows (most in the second)")
        share.fill_between(xs, 0, [min(p / t["bin_s"], 1.0) for p in t["prefill_s"]], step="mid", alpha=0.25,
                           color="tab:red", label=f"{device}: share of the second in prefill forwards (right)")
    ax.set(ylabel="tokens/s", title=f"regeneration, second by second: {title}")
    ax2.set(xlabel="seconds since the engine started", ylabel="rows")
    share.set(ylim=(0, 1), ylabel="prefill share")
    ax.legend(fontsize=8)
    ax2.legend(handles=ax2.get_legend_handles_labels()[0] + share.get_legend_handles_labels()[0], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def host_samples(engines: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The regenerate step's host samples (``common.stack_sampler``, one summary per device, from its engine's
    figures): where the main thread of each engine spent its time in the run just timed. A device whose engine has
    none is said, not skipped."""
    for device, e in engines.items():
        if "host_samples" not in e:
            print(f"  host samples: none from {device}", flush=True)
    return [e["host_samples"] for e in engines.values() if "host_samples" in e]


def process_line(phases: dict[str, float], exit_s: float | None) -> str:
    """Where a regenerate process's seconds went (the summary's ``phases``), and its exit, in one line."""
    return phase_text(phases) + (f", exit {exit_s} s (wall minus process)" if exit_s is not None
                                 else "")


def spans_line(spans: dict[str, Any]) -> str:
    """When the conversations were open (``ConversationSpans.summary``), in one line."""
    if not spans:
        return "(none settled)"
    brief = lambda x: (f"opened at {x['opened_s']:.1f} s, open {x['span_s']:.1f} s, {x['turns']} turns, "  # noqa: E731
                       f"{x['answer_tokens']} answer tokens")
    return (f"span s {spans['span_s']}; longest: {brief(spans['longest'])}; written last: "
            f"{brief(spans['settled_last'])}; the last opened at {spans['opened_last_s']:.1f} s")


def shares_figures(previous: dict[str, Any], key: dict[str, Any], ranks: dict[str, Any],
                   full: dict[str, Any] | None) -> dict[str, Any]:
    """The "regenerate_shares" object: the ranks measured now beside those an earlier call measured for the same
    split (``key``: devices, prompts file, conversations, overrides) after the same full run (a call that runs
    the full one starts afresh), the full run's seconds and the projection from them."""
    same = full is None and previous and all(previous.get(k) == v for k, v in key.items())
    ranks = (previous.get("ranks", {}) if same else {}) | ranks
    full = full or (previous.get("full") if same else None)
    out = key | {"ranks": ranks, **({"full": full} if full else {})}
    if full and ranks:
        slowest = max(r["seconds"] for r in ranks.values())
        out |= {"ranks_measured": sorted(ranks), "projected_speedup": round(full["seconds"] / slowest, 3)}
    return out


def engine_line(e: dict[str, Any]) -> str:
    """Where one engine's seconds went (``Stream.stats``), in one line."""
    if "prefill_s" not in e:
        return str(e)
    failed = f", graphs failed: {e['graph_fallback']}" if e.get("graph_fallback") else ""
    per_step = {k: f"{n} ({1000 * e['decode_s_by_live_rows'][k] / n:.0f} ms)"
                for k, n in e["steps_by_live_rows"].items() if n}
    return (f"{e['seconds']} s (first poll at {e.get('first_poll_s', '?')} s, first decode step at "
            f"{e.get('first_step_s', '?')} s): prefill {e['prefill_s']} s ({e['prefill_tokens']} tokens, "
            f"{e.get('reused_prefix_tokens', 0)} reused; {e.get('prefill_forwards', '?')} forwards, of which "
            f"{e.get('continue_forwards', '?')} continuations in {e.get('continue_prefill_s', '?')} s, "
            f"the first {e.get('continue_first_s', '?')} s), "
            f"decode {e['decode_s']} s over {e['steps']} steps ({e.get('decode_device_s', '?')} s on the device) "
            f"(issuing {e['decode_launch_s']} s, first shapes {e['decode_first_shape_s']} s; "
            f"{e.get('graph_steps', 0)} replayed from CUDA graphs, {e.get('graph_captures', 0)} captures in "
            f"{e.get('graph_capture_s', 0)} s{failed}), engine host {e['engine_host_s']} s "
            f"{e.get('engine_host_s_by_phase', '')}, caller {e['caller_s']} s {e.get('caller_s_by_part', '')}; "
            f"steps by live rows {per_step}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the run config (its regenerate and target sections)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    ap.add_argument("--prompts-file", type=Path, required=True, help="an ingested prompts.jsonl")
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--gpus", type=int, nargs="*", default=[1],
                    help="device counts to run on (1 2: the speed-up; none: only --shares' ranks)")
    ap.add_argument("--shares", type=int, default=0, metavar="N",
                    help="then each device's share of a run over N devices, alone on one (the projection)")
    ap.add_argument("--share-ranks", type=int, nargs="+", default=None, metavar="R",
                    help="only these shares of --shares (default all; another call adds the rest)")
    ap.add_argument("--out", type=Path, default=Path("runs/bench-regenerate"))
    ap.add_argument("--kept-caches", type=Path, default=None, metavar="DIR",
                    help="inductor's and Triton's caches in DIR, kept from run to run (default: empty for each "
                         "run); figures go to the *_kept_caches objects")
    ap.add_argument("--exact-prompts", type=int, default=64)
    ap.add_argument("--exact-max-tokens", type=int, default=256)
    ap.add_argument("--ab-prompts", type=int, default=0, help="first turns for the A/B: flex (graphs, eager), gather")
    ap.add_argument("--ab-max-tokens", type=int, default=512)
    ap.add_argument("--baseline-prompts", type=int, default=0, help="first turns for plain generate (0: skip)")
    ap.add_argument("--baseline-batch", type=int, default=128)
    args = ap.parse_args(argv)

    if not args.gpus and not args.shares:
        ap.error("--gpus none and no --shares: nothing to run")
    suffix = "_kept_caches" if args.kept_caches else ""
    runs = {g: end_to_end(args.config, args.set, args.prompts_file, args.conversations, g, args.out,
                          kept_caches=args.kept_caches) for g in args.gpus}
    figures = {"model": "SmolLM2-135M-Instruct", "config": args.config, "overrides": args.set,
               "prompts_file": str(args.prompts_file)}
    if runs:
        figures |= runs[args.gpus[0]]
        record("regenerate" + suffix, figures)  # the end-to-end figures stand even if a check below fails
    if args.shares:
        record_shares(args, runs.get(1), "regenerate_shares" + suffix)
    if 1 in runs and 2 in runs:
        one, two = runs[1]["gen_tokens_per_s"], runs[2]["gen_tokens_per_s"]
        record("ddp_scaling" + suffix,
               {"regenerate_tokens_per_s_1gpu": one, "regenerate_tokens_per_s_2gpu": two,
                "regenerate_speedup_2gpu": round(two / one, 3), "regenerate_conversations": args.conversations,
                "regenerate_command": command_line(), "regenerate_device": device_name(),
                "regenerate_date": time.strftime("%Y-%m-%d")}, merge=True)

    cfg = load_config(args.config, args.set)
    device = cfg.target.device if cfg.target.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if not runs:
        return 0
    if args.ab_prompts or args.baseline_prompts:
        target = load_target(cfg.target.name, dtype=cfg.target.dtype, device=device)
        prompts = first_turn_prompts(target.tokenizer, max(args.ab_prompts, args.baseline_prompts), args.prompts_file)
        if args.ab_prompts:
            figures["attention_ab"] = attention_ab(target, prompts[: args.ab_prompts], args.ab_max_tokens)
        if args.baseline_prompts:
            figures |= baseline(target, prompts[: args.baseline_prompts], cfg.regenerate.max_new_tokens,
                                args.baseline_batch)
        record("regenerate" + suffix, figures)
    if args.exact_prompts:
        target = load_target(cfg.target.name, dtype="float32", device=device)
        prompts = first_turn_prompts(target.tokenizer, args.exact_prompts, args.prompts_file)
        figures |= exactness(target, prompts, args.exact_max_tokens)
        record("regenerate" + suffix, figures)
    return 0


SHARE_FIELDS = ("seconds", "gen_tokens", "gen_tokens_per_s", "conversations", "answers", "outside_step_s",
                "process_phases", "spans", "compile_caches")


def record_shares(args: argparse.Namespace, full: dict[str, Any] | None, name: str) -> None:
    """Each asked-for share of a run over --shares devices, alone on one device, recorded as each finishes: what
    a several-device run would take if each device ran its share as fast as it does alone (before the several-
    device run's own costs: spawning a process per device, merging the part files)."""
    key = {"devices": args.shares, "prompts_file": str(args.prompts_file), "conversations": args.conversations,
           "overrides": args.set}
    whole = {k: full[k] for k in ("seconds", "gen_tokens", "spans")} | {"command": command_line()} if full else None
    for rank in args.share_ranks if args.share_ranks is not None else range(args.shares):
        run_ = end_to_end(args.config, args.set, args.prompts_file, args.conversations, 1, args.out,
                          share=(rank, args.shares), kept_caches=args.kept_caches)
        figures = {k: run_[k] for k in SHARE_FIELDS} | {
            "engine_seconds": run_["engine"]["seconds"], "command": command_line(), **measured_here()}
        record(name, shares_figures(recorded(name), key, {str(rank): figures}, whole))
        whole = None  # recorded: the next rank's merge keeps it


def answer_tokens(row: list[int], stops: list[int]) -> list[int]:
    end = next((i for i, t in enumerate(row) if t in stops), None)
    return row if end is None else row[:end]


def plain_generate(target: TargetModel, prompts: list[list[int]], max_new: int, batch: int) -> list[list[int]]:
    """HF generate, length-sorted left-padded batches; answers in prompt order."""
    tok, stops = target.tokenizer, stop_token_ids(target.tokenizer)
    tok.padding_side = "left"
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int]] = [[] for _ in prompts]
    for a in range(0, len(order), batch):
        idx = order[a:a + batch]
        enc = tok.pad({"input_ids": [prompts[i] for i in idx]}, return_tensors="pt").to(target.device)
        with torch.no_grad():
            gen = target.model.generate(**enc, max_new_tokens=max_new, do_sample=False, eos_token_id=stops,
                                        pad_token_id=tok.pad_token_id)
        for i, row in zip(idx, gen[:, enc["input_ids"].shape[1]:].tolist(), strict=True):
            out[i] = answer_tokens(row, stops)
    tok.padding_side = "right"
    return out


AB_VARIANTS = {"flex_graphs": {"attention": "flex", "decode_graphs": True},
               "flex_eager": {"attention": "flex", "decode_graphs": False},
               "gather": {"attention": "gather"}}  # the engine's options each variant runs with


def attention_ab(target: TargetModel, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """The engine on the same first turns in each of ``AB_VARIANTS`` (warmed up first, so a compile or a
    capture is not timed): generated tokens/s, decode steps replayed from graphs (0 where graphs are off or
    their capture failed: ``*_graph_fallback``), and how many answers agree with ``flex_graphs``'."""
    engine, stops = BatchedTarget(target.model), stop_token_ids(target.tokenizer)
    out: dict[str, Any] = {"prompts": len(prompts), "max_tokens": max_new}
    answers = {}
    for name, options in AB_VARIANTS.items():
        stats: dict[str, Any] = {}
        generate(engine, prompts[:8], 8, stops, desc=f"warm-up {name}", **options)
        timed = synced(lambda n=name, s=stats, o=options: generate(engine, prompts, max_new, stops, desc=n, stats=s,
                                                                   **o), target.device)
        got, seconds = timed.result, timed.finished_s
        answers[name] = [g.tokens for g in got]
        out[f"{name}_tokens_per_s"] = round(sum(len(g.tokens) for g in got) / seconds, 1)
        out[f"{name}_decode_steps"], out[f"{name}_graph_steps"] = stats["steps"], stats["graph_steps"]
        if stats["graph_fallback"]:
            out[f"{name}_graph_fallback"] = stats["graph_fallback"]
    for name in ("flex_eager", "gather"):
        out[f"same_answers_{name}"] = sum(a == b for a, b in zip(answers["flex_graphs"], answers[name], strict=True))
    return out


def baseline(target: TargetModel, prompts: list[list[int]], max_new: int, batch: int) -> dict[str, Any]:
    timed = synced(lambda: plain_generate(target, prompts, max_new, batch), target.device)
    plain, seconds = timed.result, timed.finished_s
    return {"baseline_prompts": len(prompts), "baseline_batch": batch,
            "baseline_gen_tokens_per_s": round(sum(map(len, plain)) / seconds, 1)}


def exactness(target: TargetModel, prompts: list[list[int]], max_new: int) -> dict:
    ref = plain_generate(target, prompts, max_new, len(prompts))
    got = generate(BatchedTarget(target.model), prompts, max_new, stop_token_ids(target.tokenizer), desc="exact")
    return {"exact_prompts": len(prompts), "exact_max_tokens": max_new, "exact_dtype": str(target.dtype),
            "exact_matches": sum(r == g.tokens for r, g in zip(ref, got, strict=True))}


if __name__ == "__main__":
    sys.exit(main())

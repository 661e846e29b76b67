"""The ``python -m eval`` commands as functions of their arguments (the entry point only parses them).

Each returns the exit code (``common.cli``): 0 pass (or promoted), 1 rejected or unresolved by the gate (nothing
promoted either way: a CI job reads both as "not shipped"), 2 an error,
printed as one line on stderr (our errors carry ready messages that name the file or key); a crash is 2
too, never 1. ``run``, ``gate`` (``--live`` too), ``quality`` and ``sweep --config`` hold the run dir's lock
(``common.locking``) while they write there.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

from common.cli import EXIT_OK, EXIT_REJECTED, one_line_errors
from common.config import load_config
from common.files import json_text, write_text_atomic
from common.locking import run_lock
from common.wheels import MissingWheelError
from drafter.sglang_checkpoint import check_checkpoint
from eval import breakeven
from eval.evaluate import evaluate, evaluate_live, save_report
from eval.gate_flow import gate
from eval.live_gate import live_gate, live_prompts, run_live
from eval.quality import DEFAULT_SETTINGS, figures_store, parse_settings, quality, quality_config, target_and_prompts
from eval.serving_sweep import SweepError, markdown, measure_table, read_table, recommend, write_sweep
from eval.sglang_client import ServerError
from eval.vocab_coverage import coverage, coverage_lines
from target_model.hf_model import tokenizer_from_config


def _report_name(checkpoint: str, name: str | None) -> str:
    return name or Path(checkpoint).resolve().name


@one_line_errors(MissingWheelError, ServerError)
def run_command(config: str | Path, checkpoint: str | Path, overrides: Sequence[str] = (),
                name: str | None = None, live: bool = False) -> int:
    """Speculative decoding on the eval datasets, against the HF target or (``live``) the eval.sglang servers;
    the report only. A checkpoint that is not a readable, finite drafter is an error (``_measurable``)."""
    cfg = load_config(config, list(overrides))
    checkpoint = str(checkpoint)
    report_name = _report_name(checkpoint, name)
    _measurable(checkpoint)
    with run_lock(cfg.root, "eval run"):
        if live:
            run_live(cfg, checkpoint, report_name)
        else:
            save_report(cfg, evaluate(cfg, {"candidate": checkpoint}, report_name))
    return EXIT_OK


def _measurable(checkpoint: str) -> None:
    """Refuse what is not a readable, finite drafter checkpoint (``CheckpointError``: exit 2), before any target
    is loaded; warn about what SGLang would serve wrongly (a legacy config is still worth measuring)."""
    for problem in check_checkpoint(checkpoint):
        print(f"warning: {problem}", file=sys.stderr)


@one_line_errors(MissingWheelError, ServerError)
def quality_command(config: str | Path, checkpoint: str | Path, overrides: Sequence[str] = (), name: str | None = None,
                    settings: Sequence[str] = DEFAULT_SETTINGS, timing_prompts: int = 8,
                    limit: int | None = None, context_prompts: int = 80, incumbent: str | None = None) -> int:
    """tau and alpha_k on every prompt of the eval datasets in batched passes, at each k:T of ``settings``, the
    lossless check at T = 0, tau* per k, tau by history length on the held-out conversations (``context_prompts``
    per bucket, ``limit`` in a smoke run) and the gate's decision at the first setting, against the ``incumbent``
    too when given (``eval.quality``); writes run_dir/eval/<name>/quality.json. The target runs in float32 unless
    ``overrides`` set target.dtype. Each drafter's figures per dataset and setting are kept as they land in
    run_dir/eval/measured/, one store for every report of the run: a rerun after a kill measures only the rest, and a
    drafter measured before on the same target and prompts (an incumbent) is read, not measured again."""
    checkpoint = str(checkpoint)
    report_name = _report_name(checkpoint, name)
    pairs = parse_settings(settings)
    _measurable(checkpoint)
    if incumbent is not None:
        _measurable(incumbent)
    cfg = quality_config(config, overrides=overrides)
    with run_lock(cfg.root, "eval quality"):
        target, prompts = target_and_prompts(cfg, limit)
        figures = quality(cfg, target, prompts, checkpoint, pairs, timing_prompts, limit or context_prompts,
                          incumbent=incumbent, keep_dir=figures_store(cfg))
        out = cfg.eval_dir / report_name / "quality.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json_text(figures, indent=1) + "\n")
    print(json_text(figures, indent=1))
    print(f"quality: {out}")
    return EXIT_OK


@one_line_errors(MissingWheelError)
def coverage_command(config: str | Path, checkpoints: Sequence[str], overrides: Sequence[str] = (),
                     conversations: str | None = None, limit: int | None = None) -> int:
    """The share of the run's answer tokens outside each drafter's draft vocab (``eval.vocab_coverage``), no model
    loaded: one line per drafter, the figures in run_dir/draft_vocab_coverage.json."""
    cfg = load_config(config, list(overrides))
    report = coverage(checkpoints, Path(conversations) if conversations else cfg.conversations_path,
                      tokenizer_from_config(cfg.target), limit)
    out = cfg.root / "draft_vocab_coverage.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json_text(report, indent=1) + "\n")
    print("\n".join(coverage_lines(report)))
    print(f"coverage: {out}")
    return EXIT_OK


@one_line_errors(MissingWheelError, ServerError)
def gate_command(config: str | Path, checkpoint: str | Path, overrides: Sequence[str] = (), name: str | None = None,
                 incumbent: str | None = None, promote: bool = False, live: bool = False) -> int:
    """Measure, then the ship decision; ``promote`` makes gate.promoted_dir serve a passing checkpoint. ``live``:
    tau, alpha_k and the timings from the eval.sglang servers (eval/live_gate.py)."""
    cfg = load_config(config, list(overrides))
    checkpoint = str(checkpoint)
    report_name = _report_name(checkpoint, name)
    with run_lock(cfg.root, "eval gate"):
        if live:
            decision = live_gate(cfg, checkpoint, incumbent, promote, report_name)
        else:
            decision = gate(cfg, checkpoint, incumbent, promote, report_name)
    return EXIT_REJECTED if decision in ("rejected", "unresolved") else EXIT_OK  # unresolved: nothing promoted


@one_line_errors(MissingWheelError, ServerError)
def sweep_command(config: str | Path | None = None, table: str | Path | None = None,
                  overrides: Sequence[str] = (), out: str | Path | None = None) -> int:
    """The serving flags with the best tokens/s under the measured cost model: from a cost table file, or
    measured on the eval.sglang servers. Writes sweep.{json,md} (run_dir/eval/sweep, or ``out``); holds the run
    dir's lock when it writes there."""
    if table is None and config is None:
        raise SweepError("eval sweep: give --table FILE or --config FILE")
    cfg = load_config(config, list(overrides)) if config is not None else None
    where = Path(out) if out else (cfg.eval_dir / "sweep" if cfg else Path(table).with_suffix(""))
    with run_lock(cfg.root, "eval sweep") if cfg is not None else nullcontext():
        if table is not None:
            costs, decode, alpha = read_table(Path(table))
        else:
            costs, decode, alpha = measure_table(cfg, live_prompts(cfg))
        result = recommend(costs, decode, alpha)
        write_sweep(where, result)
    print(markdown(result))
    print(f"sweep: {where}/sweep.{{json,md}}")
    return EXIT_OK


@one_line_errors(MissingWheelError, ServerError)
def breakeven_command(decode_ms: float, cycle_ms: float, steps: int = 3, target_tps: float | None = None) -> int:
    """τ* and the α a tok/s goal needs, from given timings, as JSON on stdout."""
    breakeven.tau_star(cycle_ms, decode_ms)  # given timings must be > 0 (a 0 reads as not measured below)
    print(json_text(breakeven.breakeven(decode_ms, cycle_ms, steps, target_tps), indent=2))
    return EXIT_OK


@one_line_errors(MissingWheelError, ServerError)
def sglang_command(config: str | Path, overrides: Sequence[str] = ()) -> int:
    """τ and α_k from a live SGLang server, as JSON on stdout."""
    print(json_text(evaluate_live(load_config(config, list(overrides))), indent=2))
    return EXIT_OK

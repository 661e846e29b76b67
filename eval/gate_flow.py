"""The gate around the pure decision, one frame for both ways of measuring: check the candidate, measure it
(and the incumbent), decide (``eval.gate.decide``), promote on request, and record the decision in the history
and the report. ``gate`` measures with the HF target here (``eval.evaluate``); ``eval.live_gate.live_gate`` on
live SGLang servers. Both hand ``run_gate`` how to measure and how to save the report.

A candidate that is not a readable, finite drafter checkpoint is an error (``CheckpointError``, exit 2): nothing
is recorded, since no drafter was judged. One that ``check_checkpoint`` finds SGLang would serve wrongly is
rejected without measuring; an incumbent that is either is dropped, and the candidate held to break-even only.

The decision's side effects come in the order that keeps a recorded decision backed by its report, and what
serves backed by a record: the report (the measurement and the decision it leads to) is written, then the record
is appended (fsynced), then a promotion switches ``promoted``, and only then does the gate print the decision. The
history is what says a decision was taken: a kill before the record leaves a report of a decision that was never
recorded, and the rerun measures again and overwrites it; a kill after the record leaves its report on disk (and a
switch that ``reconcile`` completes).

The whole gate holds the promotions lock (``promotions/.lock``): the incumbent it measures stays the
incumbent until its decision is recorded, and no second gate promotes in between. It first reconciles the
history with what ``promoted`` serves (``eval.gate.reconcile``); a candidate that is already serving (a
rerun after a kill that came after its promotion) is not measured against itself again: with ``--promote``
the gate ends there; without, the HF gate holds it to break-even only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import RunConfig
from drafter.sglang_checkpoint import CheckpointError, check_checkpoint, fingerprint
from eval.evaluate import evaluate, save_report
from eval.gate import already_serving, append_history, decide, promotion_path, promotions_held, record_decision
from eval.gate_stats import bootstrap, evidence_record, report_evidence
from eval.gate_tries import at_level, tries


@dataclass
class Measured:
    """What a gate's measurement hands the frame: the report (the frame adds ``gate`` and saves it), whether
    the candidate passed, the reasons (the decision's, then any notes), and the history record's measured
    fields (tau, tau*, the incumbent, ...); ``unresolved``: not passed because an interval holds its bar."""

    report: dict
    passed: bool
    reasons: list[str]
    record: dict
    unresolved: bool = False


def run_gate(cfg: RunConfig, checkpoint: str, do_promote: bool, holder: str,
             measure: Callable[[dict | None, str], Measured], save: Callable[[RunConfig, dict], Any],
             record_fields: dict | None = None) -> str:
    """The gate's opening and closing, under the promotions lock (``holder`` names this gate in it).
    ``measure(serving, fp)`` is called with the history record of the candidate when it already serves (else None)
    and the candidate's fingerprint;
    ``save(cfg, report)`` writes the report. ``record_fields`` go into every history record this gate writes.
    Returns "promoted", "passed", "unresolved" (recorded and exiting like a rejection) or "rejected"."""
    with promotions_held(cfg.gate.promoted_dir, cfg.gate.history_file, holder):
        record: dict = {"checkpoint": str(Path(checkpoint).resolve()), "fingerprint": None, "incumbent": None,
                        **(record_fields or {})}
        problems = check_checkpoint(checkpoint)  # a CheckpointError (not a drafter at all) ends the gate here
        if problems:  # nothing to measure: SGLang would serve it wrongly
            d = decide({}, cfg.gate.margin, checkpoint_problems=problems)
            append_history(cfg.gate.history_file, record | {"decision": "rejected", "reasons": d.reasons})
            print("REJECTED\n" + "\n".join(f"  - {r}" for r in d.reasons))
            return "rejected"
        record["fingerprint"] = fingerprint(checkpoint)
        serving = already_serving(cfg.gate.history_file, record["fingerprint"])
        if serving is not None and do_promote:  # promoted by an earlier run, killed before its caller saw the exit code
            print(f"PROMOTED (already: serving since {serving.get('time')}, {cfg.gate.history_file})")
            return "promoted"
        measured = measure(serving, record["fingerprint"])
        decision = (("promoted" if do_promote else "passed") if measured.passed
                    else "unresolved" if measured.unresolved else "rejected")
        reasons = list(measured.reasons)
        if decision == "promoted":
            reasons.append(f"{cfg.gate.promoted_dir} -> {promotion_path(cfg.gate.promoted_dir, record['fingerprint'])}")
        record |= measured.record | {"decision": decision, "reasons": reasons}
        report = measured.report
        report["gate"] = {"decision": decision, "reasons": reasons, "datasets": gate_datasets(cfg),
                          "margin": cfg.gate.margin, "min_delta": cfg.gate.min_delta,
                          "history_file": str(cfg.gate.history_file), "tries": record.get("tries")}
        save(cfg, report)  # before the record: a recorded decision always has its report
        record_decision(checkpoint, record, cfg.gate.promoted_dir, cfg.gate.history_file)  # a promotion switches here
        print(decision.upper())
        return decision


def gate_datasets(cfg: RunConfig) -> list[str]:
    """The datasets the decision reads: gate.datasets, else every eval dataset."""
    return cfg.gate.datasets or [d.name for d in cfg.eval.datasets]


def gate(cfg: RunConfig, checkpoint: str, incumbent: str | None, do_promote: bool, name: str) -> str:
    """The decision: "promoted" (passed and now served from gate.promoted_dir), "passed", "unresolved" or
    "rejected"."""
    def measure(serving: dict | None, fp: str) -> Measured:
        return _measure_hf(cfg, checkpoint, incumbent, serving, name, fp)

    return run_gate(cfg, checkpoint, do_promote, "eval gate", measure, save_report)


def _measure_hf(cfg: RunConfig, checkpoint: str, incumbent: str | None, serving: dict | None, name: str,
                fp: str) -> Measured:
    """The candidate (fingerprint ``fp``) and the incumbent (given, else what ``promoted`` serves) on the HF target,
    read at the level this try calls for (``eval.gate_tries``); a candidate that already serves, or an incumbent that
    fails the checker, is held to break-even only."""
    notes = []
    if serving is not None:
        notes.append("the candidate is the drafter serving now; compared against break-even only")
        incumbent = None
    elif incumbent is None and (Path(cfg.gate.promoted_dir) / "config.json").is_file():
        incumbent = str(Path(cfg.gate.promoted_dir).resolve())  # what is serving now (its immutable copy)
    if incumbent is not None and not _servable(incumbent):
        notes.append(f"incumbent {incumbent} fails check_checkpoint; compared against break-even only")
        incumbent = None
    checkpoints = {"candidate": checkpoint} | ({"incumbent": incumbent} if incumbent else {})
    tried = tries(cfg, fp, fingerprint(incumbent) if incumbent else None, "hf")
    cfg = at_level(cfg, tried.level)
    notes.append(tried.line(cfg.gate.history_file))
    report = evaluate(cfg, checkpoints, name)
    gate_ds = gate_datasets(cfg)
    cand = report["drafters"]["candidate"]
    tau = {ds: cand["datasets"][ds]["tau"] for ds in gate_ds}
    inc_tau = ({ds: report["drafters"]["incumbent"]["datasets"][ds]["tau"] for ds in gate_ds}
               if incumbent else None)
    mismatches = [f"{m['dataset']} prompt {m['prompt']} differs from greedy at token {m['first_divergence']}"
                  for m in cand["lossless"].get("mismatches", [])]
    evidence = report_evidence(report, gate_ds, cfg.gate.margin, bootstrap(cfg.gate))
    d = decide(evidence, cfg.gate.margin, cfg.gate.min_delta, lossless_mismatches=mismatches)
    record = {"incumbent": report["checkpoints"].get("incumbent"), "tau": tau, "incumbent_tau": inc_tau,
              "alpha": {ds: cand["datasets"][ds]["alpha_conditional"] for ds in gate_ds},
              "tau_star": report["breakeven"]["tau_star"], "timings_source": report["breakeven"]["source"],
              "records_skipped_short": {ds: report["records_skipped_short"][ds] for ds in gate_ds},
              "intervals": evidence_record(evidence, d), "tries": tried.record()}
    report["intervals"] = record["intervals"]
    return Measured(report, d.promote, d.reasons + notes, record, d.verdict == "unresolved")


def _servable(incumbent: str) -> bool:
    """Whether the incumbent passes the checker (non-finite weights aside: its measured tau says what they do)."""
    try:
        return not check_checkpoint(incumbent, check_finite=False)
    except CheckpointError:
        return False

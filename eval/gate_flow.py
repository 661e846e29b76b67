"""The gate around the pure decision: check the candidate, find the incumbent, measure both, decide
(``eval.gate.decide``), promote on request, and record the decision in the history and the report.

A checkpoint that fails ``check_checkpoint`` is rejected without measuring (SGLang would serve it
wrongly); an incumbent that fails it is dropped, and the candidate is held to break-even only.

The whole gate holds the promotions lock (``promotions/.lock``): the incumbent it measures stays the
incumbent until its decision is recorded, and no second gate promotes in between. It first reconciles the
history with what ``promoted`` serves (``eval.gate.reconcile``); a candidate that is already serving (a
rerun after a kill that came after its promotion) is not measured against itself again.
"""

from __future__ import annotations

from pathlib import Path

from common.config import RunConfig
from drafter.sglang_checkpoint import check_checkpoint, fingerprint
from eval.evaluate import evaluate, save_report
from eval.gate import already_serving, append_history, decide, promotion_path, promotions_held, record_decision


def gate(cfg: RunConfig, checkpoint: str, incumbent: str | None, do_promote: bool, name: str) -> str:
    """The decision: "promoted" (passed and now served from gate.promoted_dir), "passed" or "rejected"."""
    with promotions_held(cfg.gate.promoted_dir, cfg.gate.history_file, "eval gate"):
        return _gate(cfg, checkpoint, incumbent, do_promote, name)


def _gate(cfg: RunConfig, checkpoint: str, incumbent: str | None, do_promote: bool, name: str) -> str:
    record: dict = {"checkpoint": str(Path(checkpoint).resolve()), "fingerprint": None, "incumbent": None}
    problems = check_checkpoint(checkpoint)
    if problems:  # nothing to measure: SGLang would serve it wrongly
        d = decide({}, float("nan"), cfg.gate.margin, checkpoint_problems=problems)
        append_history(cfg.gate.history_file, record | {"decision": "rejected", "reasons": d.reasons})
        print("REJECTED\n" + "\n".join(f"  - {r}" for r in d.reasons))
        return "rejected"
    record["fingerprint"] = fingerprint(checkpoint)
    notes = []
    serving = already_serving(cfg.gate.history_file, record["fingerprint"])
    if serving is not None:
        if do_promote:  # promoted by an earlier run of this gate, killed before its caller saw the exit code
            print(f"PROMOTED (already: serving since {serving.get('time')}, {cfg.gate.history_file})")
            return "promoted"
        notes.append("the candidate is the drafter serving now; compared against break-even only")
        incumbent = None
    elif incumbent is None and (Path(cfg.gate.promoted_dir) / "config.json").is_file():
        incumbent = str(Path(cfg.gate.promoted_dir).resolve())  # what is serving now (its immutable copy)
    if incumbent is not None and check_checkpoint(incumbent, check_finite=False):
        notes.append(f"incumbent {incumbent} fails check_checkpoint; compared against break-even only")
        incumbent = None
    checkpoints = {"candidate": checkpoint} | ({"incumbent": incumbent} if incumbent else {})
    report = evaluate(cfg, checkpoints, name)
    gate_ds = cfg.gate.datasets or [d.name for d in cfg.eval.datasets]
    cand = report["drafters"]["candidate"]
    tau = {ds: cand["datasets"][ds]["tau"] for ds in gate_ds}
    inc_tau = ({ds: report["drafters"]["incumbent"]["datasets"][ds]["tau"] for ds in gate_ds}
               if incumbent else None)
    mismatches = [f"{m['dataset']} prompt {m['prompt']} differs from greedy at token {m['first_divergence']}"
                  for m in cand["lossless"].get("mismatches", [])]
    d = decide(tau, report["breakeven"]["tau_star"], cfg.gate.margin, inc_tau, cfg.gate.min_delta,
               lossless_mismatches=mismatches)
    decision = ("promoted" if do_promote else "passed") if d.promote else "rejected"
    if decision == "promoted":
        notes.append(f"{cfg.gate.promoted_dir} -> {promotion_path(cfg.gate.promoted_dir, record['fingerprint'])}")
    report["gate"] = {"decision": decision, "reasons": d.reasons + notes, "datasets": gate_ds,
                      "margin": cfg.gate.margin, "min_delta": cfg.gate.min_delta}
    save_report(cfg, report)
    record |= {"incumbent": report["checkpoints"].get("incumbent"), "tau": tau, "incumbent_tau": inc_tau,
               "alpha": {ds: cand["datasets"][ds]["alpha_conditional"] for ds in gate_ds},
               "tau_star": report["breakeven"]["tau_star"], "timings_source": report["breakeven"]["source"],
               "decision": decision, "reasons": d.reasons + notes}
    record_decision(checkpoint, record, cfg.gate.promoted_dir, cfg.gate.history_file)
    print(decision.upper())
    return decision

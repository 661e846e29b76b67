"""The eval report carries the intervals: per-prompt columns from the batch-1 engine (eval.measure), tau's and tau*'s
intervals (eval.gate_stats.annotate), the gate's lines, report.md's columns and the plots, tau per prompt included.
A tiny target and two random drafters on CPU."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from tiny_speculative import TinyTokenizer, tiny_target_and_drafter

from eval import breakeven
from eval.gate import decide
from eval.gate_stats import annotate, evidence_record, report_evidence
from eval.intervals import Bootstrap
from eval.measure import Settings, measure
from eval.report import PLOTS, markdown, prompt_taus, write_report
from eval.speculative import Eagle3Proposer, Engine
from eval.turns import EvalPrompts
from target_model.hf_model import TargetModel

V, AUX, K = 12, (0, 1, 2), 3
BOOT = Bootstrap(0.95, 500, 0)


@pytest.fixture(scope="module")
def report() -> dict:
    """What ``eval.evaluate.evaluate`` assembles, on a tiny target: measured timings, candidate and incumbent."""
    target, drafter = tiny_target_and_drafter(V, AUX)
    other = copy.deepcopy(drafter)
    with torch.no_grad():
        for p in other.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(4)
    prompts = {ds: [torch.randint(2, V, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (6,),
                                                                                             generator=g)]
               for ds in ("mtbench", "humaneval")}
    engine = Engine(TargetModel(target, TinyTokenizer(), "tiny", None), AUX, [1])
    proposers = {"candidate": Eagle3Proposer(drafter, AUX), "incumbent": Eagle3Proposer(other, AUX)}
    r = {"name": "t", "target": "tiny", "device": "cpu", **measure(engine, prompts, proposers, Settings(K, 0.0, 16))}
    cycle = r["drafters"]["candidate"]["cycle_ms"]
    r["breakeven"] = breakeven.breakeven(r["plain"]["decode_ms"], cycle, K) | {"source": "measured"}
    return annotate(r, BOOT)


def test_per_prompt_columns_add_up_to_the_datasets_figures(report):
    for d in report["drafters"].values():
        for st in d["datasets"].values():
            pp = st["per_prompt"]
            assert st["prompts"] == len(pp["tokens"]) == 6 and sum(pp["cycles"]) == st["cycles"]
            assert sum(pp["tokens"]) / sum(pp["cycles"]) == pytest.approx(st["tau"])
            if sum(c > 0 for c in pp["cycles"]) >= 2:
                assert st["ci"][0] <= st["tau"] <= st["ci"][1]
            else:  # humaneval: the tiny target ends all but one answer at its prefill token; one prompt, no interval
                assert all(math.isnan(x) for x in st["ci"])
    be = report["breakeven"]
    assert be["timing_prompts"] == 12 and be["level"] == 0.95  # every prompt of both datasets is timed
    assert be["ci"][0] <= be["tau_star"] <= be["ci"][1] and be["ci"][0] < be["ci"][1]  # timings spread


def test_the_report_carries_the_intervals_and_the_plots(report, tmp_path):
    ev = report_evidence(report, ["mtbench", "humaneval"], 0.0, BOOT)
    d = decide(ev, 0.0, 0.0)
    assert ev["mtbench"].tau_star.point == pytest.approx(report["breakeven"]["tau_star"])
    assert ev["mtbench"].tau.point == pytest.approx(report["drafters"]["candidate"]["datasets"]["mtbench"]["tau"])
    r = dict(report, intervals=evidence_record(ev, d), gate={"decision": d.verdict, "reasons": d.reasons})
    out = write_report(r, tmp_path / "rep")
    written = json.loads((out / "report.json").read_text())
    cycled = [c and i for c, i in zip(*(report["drafters"][n]["datasets"]["mtbench"]["per_prompt"]["cycles"]
                                         for n in ("candidate", "incumbent")), strict=True)]
    assert 0 < sum(map(bool, cycled)) < 6  # one of the random prompts ends at its prefill token: no cycle to pair
    assert written["intervals"]["mtbench"]["vs_incumbent"]["prompts"] == sum(map(bool, cycled))
    assert written["intervals"]["humaneval"]["line"] == d.lines["humaneval"]
    md = (out / "report.md").read_text()
    assert "| dataset | prompts | cycles | tau | interval | alpha_1 |" in md
    assert "95% interval [" in md and "over 12 timing prompts" in md
    assert all(line in md for line in d.lines.values())
    moved = written["intervals"]["mtbench"]["influential_prompts"]
    assert moved and moved == ev["mtbench"].influential  # the prompts the paired difference leans on, named in both
    assert "## What moves the paired difference" in md and f"prompt {moved[0]['prompt']} {moved[0]['shift']:+.3f}" in md
    for stem in PLOTS:
        assert (out / f"{stem}.png").stat().st_size > 1000
    assert markdown(written) == md


def test_prompt_taus_leave_prompts_without_cycles_out():
    taus = prompt_taus({"per_prompt": {"tokens": [6, 0, 4], "cycles": [3, 0, 4]}})
    assert taus[0] == 2.0 and taus[1] != taus[1] and taus[2] == 1.0


def test_records_skipped_as_short_reach_report_json_and_md(tmp_path, monkeypatch):
    """``evaluate`` on a tiny target (the model loads stubbed): the records a dataset skipped for too few user
    turns stand beside its prompts in report.json and report.md."""
    import eval.evaluate as ev
    from common.config import parse_config

    target, drafter = tiny_target_and_drafter(V, AUX)
    prompts = EvalPrompts({"mtbench": [[2, 3, 4], [5, 6]], "mt2": [[7, 8, 9]]}, {"mtbench": 0, "mt2": 2})
    monkeypatch.setattr(ev, "load_target_from_config", lambda _cfg: TargetModel(target, TinyTokenizer(), "tiny", None))
    monkeypatch.setattr(ev, "load_for_target", lambda *_a, **_k: (drafter, AUX))
    monkeypatch.setattr(ev, "eval_prompts", lambda *_a: prompts)
    monkeypatch.setattr(ev, "fingerprint", lambda _p: "0" * 64)
    cfg = parse_config({"run_dir": str(tmp_path / "run"), "target": {"name": "tiny", "device": "cpu"},
                        "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]},
                        "eval": {"num_steps": K, "max_new_tokens": 6,
                                 "datasets": [{"name": "mtbench", "kind": "mtbench"},
                                              {"name": "mt2", "kind": "mtbench", "turn": 2}]}})
    r = ev.evaluate(cfg, {"candidate": str(tmp_path / "ckpt")}, "t")
    assert r["prompts"] == {"mtbench": 2, "mt2": 1} and r["records_skipped_short"] == {"mtbench": 0, "mt2": 2}
    out = write_report(r, tmp_path / "rep")
    assert json.loads((out / "report.json").read_text())["records_skipped_short"] == {"mtbench": 0, "mt2": 2}
    assert "prompts: 2 mtbench, 1 mt2 (2 records with too few user turns skipped)." in (out / "report.md").read_text()


class Killed(BaseException):
    """A kill, simulated: raised where the kill hits, and caught by nothing in the code under test."""


def test_a_kill_while_a_plot_is_written_leaves_the_previous_plot_whole(report, tmp_path, monkeypatch):
    """The plots are written whole or not at all: a kill while a PNG is being written leaves the earlier one as it
    was, and the temp a killed write left behind is cleared by the next report."""
    from matplotlib.figure import Figure

    out = write_report(report, tmp_path / "rep")
    before = {stem: (out / f"{stem}.png").read_bytes() for stem in PLOTS}

    def torn(_fig, fname, *_a, **_k):
        if hasattr(fname, "write"):
            fname.write(b"\x89PNG torn")
        else:
            open(fname, "wb").write(b"\x89PNG torn")
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(Figure, "savefig", torn)
        with pytest.raises(Killed):
            write_report(report, out)
    assert {stem: (out / f"{stem}.png").read_bytes() for stem in PLOTS} == before
    left = out / f".{PLOTS[0]}.png.tmp-999999999"  # what a write killed before its rename leaves
    left.write_bytes(b"\x89PNG torn")
    write_report(dict(report, gate={"decision": "promoted", "reasons": [], "history_file": "h.jsonl"}), out)
    assert not left.exists() and sorted(p.name for p in out.iterdir()) == sorted(
        ["report.json", "report.md", *(f"{s}.png" for s in PLOTS)])
    assert "- takes effect once recorded in `h.jsonl`, which says what serves" in (out / "report.md").read_text()



def test_a_candidate_without_a_verify_cycle_is_rejected_as_unmeasured_not_an_error(report, tmp_path):
    """Every answer ended at its prefill token: no cycle time to divide by, so tau* is not measured; the report
    still renders and the gate rejects the candidate as unmeasured (exit 1), where dividing by zero was an error."""
    r = copy.deepcopy(report)
    cand = r["drafters"]["candidate"]
    for st in cand["datasets"].values():
        st["per_prompt"] = {"tokens": [0] * 6, "cycles": [0] * 6}
        st["tau"], st["cycles"] = float("nan"), 0
    cand["per_prompt_timing"] = {"cycle_s": [0.0] * 12, "cycles": [0] * 12}
    r["breakeven"] = breakeven.breakeven(r["plain"]["decode_ms"], 0.0, K) | {"source": "measured"}
    annotate(r, BOOT)
    assert math.isnan(r["breakeven"]["tau_star"]) and "tau*" in markdown(r)
    d = decide(report_evidence(r, ["mtbench"], 0.0, BOOT), 0.0, 0.0)
    assert d.verdict == "reject" and "not measured (no verify cycle)" in d.lines["mtbench"], d.reasons
    write_report(r, tmp_path / "eval")  # the plots draw without a tau* line

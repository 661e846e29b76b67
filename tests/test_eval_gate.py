"""The gate: decision table, atomic promotion, history, and the CLI's exit codes end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from drafter.sglang_checkpoint import save_checkpoint
from eval.commands import gate_command, run_command
from eval.gate import append_history, decide
from eval.gate_stats import evidence
from eval.intervals import Bootstrap, constant

TAU_STAR = 2.0
REPO = Path(__file__).resolve().parents[1]


def flat(tau: float, n: int = 20) -> tuple[list[float], list[int]]:
    """Per-prompt (tokens, cycles) of ``n`` prompts that all run at ``tau``: an interval of no width (NaN: none
    ran a cycle)."""
    return ([0.0] * n, [0] * n) if tau != tau else ([10 * tau] * n, [10] * n)


def point_gate(tau: dict, tau_star: float, margin: float = 0.0, incumbent: dict | None = None,
               min_delta: float = 0.0, problems=(), mismatches=()):
    boot = Bootstrap(0.95, 200, 0)
    ev = {ds: evidence(flat(t), constant(tau_star, boot), margin, boot, flat(incumbent[ds]) if incumbent else None)
          for ds, t in tau.items()}
    return decide(ev, margin, min_delta, problems, mismatches)


@pytest.mark.parametrize("case, tau, incumbent, problems, mismatches, promote_expected, reason", [
    ("clears break-even, loses to incumbent", {"a": 2.5, "b": 2.4}, {"a": 2.6, "b": 2.3}, [], [], False,
     "a: FAIL (20 prompts, 95% intervals): tau 2.500 [2.500, 2.500]; vs incumbent 2.600 [2.600, 2.600]: difference "
     "-0.100 [-0.100, -0.100] is below min_delta 0 (a real loss)"),
    ("beats break-even and incumbent", {"a": 2.7, "b": 2.4}, {"a": 2.6, "b": 2.3}, [], [], True, None),
    ("no incumbent, clears break-even", {"a": 2.1}, None, [], [], True, None),
    ("below break-even on one dataset", {"a": 2.7, "b": 1.9}, None, [], [], False,
     "b: FAIL (20 prompts, 95% intervals): tau 1.900 [1.900, 1.900]; vs break-even tau* 2.000 (given timings) x "
     "(1 + 0): gap -0.100 [-0.100, -0.100] is below 0 (a real loss)"),
    ("served wrongly", {"a": 3.0}, None, ["ckpt/config.json: tie_word_embeddings must be false"], [], False,
     "tie_word_embeddings"),
    ("lossless mismatch", {"a": 3.0}, None, [], ["mtbench prompt 0 differs at token 5"], False, "lossless"),
    ("no verify cycle", {"a": float("nan")}, None, [], [], False, "not measured (no verify cycle)"),
])
def test_decision_table(case, tau, incumbent, problems, mismatches, promote_expected, reason):
    """Without spread between prompts the intervals have no width, and the rule is the point rule (strict: on a bar
    is a tie)."""
    d = point_gate(tau, TAU_STAR, 0.0, incumbent, 0.0, problems, mismatches)
    assert d.promote is promote_expected, (case, d.reasons)
    assert d.verdict == ("promote" if promote_expected else "reject")
    if reason:
        assert any(reason in r for r in d.reasons), d.reasons


def test_margin_and_min_delta_are_applied():
    assert point_gate({"a": 2.05}, 2.0, 0.05).verdict == "reject"  # needs more than 2.1
    assert point_gate({"a": 2.1}, 2.0, 0.05).verdict == "unresolved"  # on the bar: a tie decides nothing
    assert point_gate({"a": 2.11}, 2.0, 0.05).promote
    assert not point_gate({"a": 2.5}, 2.0, 0.0, {"a": 2.48}, 0.05).promote
    assert point_gate({"a": 2.55}, 2.0, 0.0, {"a": 2.48}, 0.05).promote


def test_history_appends_whole_lines(tmp_path):
    h = tmp_path / "sub" / "promotions.jsonl"
    append_history(h, {"decision": "rejected"})
    append_history(h, {"decision": "promoted"})
    rows = [json.loads(line) for line in h.read_text().splitlines()]
    assert [r["decision"] for r in rows] == ["rejected", "promoted"] and all("time" in r for r in rows)


def test_history_is_strict_json_with_null_for_a_non_finite_figure(tmp_path):
    """An alpha of a dataset without cycles is NaN: the record holds null, which jq and JSON.parse read."""
    h = tmp_path / "promotions.jsonl"
    append_history(h, {"decision": "rejected", "alpha": {"mtbench": [float("nan"), 0.5]}, "tau_star": float("inf")})
    row = json.loads(h.read_text(), parse_constant=pytest.fail)
    assert row["alpha"] == {"mtbench": [None, 0.5]} and row["tau_star"] is None


def write_config(tmp_path: Path, tracking: dict | None = None, **eval_extra) -> Path:
    cfg = {"run_dir": str(tmp_path / "run"), "tracking": tracking or {},
           "target": {"name": "smollm2-135m-instruct", "device": "cpu", "aux_layer_ids": [2, 15, 27]},
           "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]},
           "eval": {"num_steps": 3, "max_new_tokens": 8,
                    "datasets": [{"name": "mtbench", "kind": "mtbench", "path": "builtin", "limit": 1}], **eval_extra},
           "gate": {"promoted_dir": str(tmp_path / "promoted"), "history_file": str(tmp_path / "promotions.jsonl")}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_cli_rejects_a_drafter_sglang_would_serve_wrongly_and_errors_are_exit_2(tmp_path, tiny_drafter, capsys):
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    cfg = write_config(tmp_path)
    assert gate_command(cfg, ckpt) == 1  # a readable drafter, judged without measuring: recorded
    row = json.loads((tmp_path / "promotions.jsonl").read_text())
    assert row["decision"] == "rejected" and any("tie_word_embeddings" in r for r in row["reasons"])
    assert gate_command(cfg, tmp_path / "nope") == 2
    assert run_command(tmp_path / "missing.yaml", ckpt) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text(cfg.read_text().replace("num_steps: 3", "num_steps: 0"))
    assert gate_command(bad, ckpt) == 2
    assert "eval.num_steps" in capsys.readouterr().err
    # The same through the command line (python -m eval parses the arguments, eval.commands runs them).
    r = subprocess.run([sys.executable, "-m", "eval", "gate", "--config", str(bad), "--checkpoint", str(ckpt)],
                       capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and "eval.num_steps" in r.stderr, r.stderr


@pytest.mark.real
def test_cli_gate_promotes_then_rejects_against_measured_breakeven(tmp_path, smollm2):
    from drafter.factory import fresh_drafter, shape_for_target
    from drafter.vocab_map import build_vocab_map

    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 1024)
    drafter = fresh_drafter(shape_for_target(smollm2.hf_config, 1024, (2, 15, 27)), smollm2.embed_weight().detach(),
                            d2t, t2d)
    ckpt = save_checkpoint(drafter, tmp_path / "step-1", dtype="float32")
    # Given timings with tau* = 0.5: even a random drafter clears break-even, and there is no incumbent.
    two = [{"name": "mtbench", "kind": "mtbench", "path": "builtin", "limit": 2}]  # one prompt gives no interval
    easy = write_config(tmp_path, tracking={"report_to": ["tensorboard"], "project": "gate"},
                        timings={"decode_ms": 100.0, "cycle_ms": {3: 50.0}}, datasets=two)
    assert gate_command(easy, ckpt, promote=True) == 0
    assert (tmp_path / "promoted" / "model.safetensors").is_file()
    report = json.loads((tmp_path / "run" / "eval" / "step-1" / "report.json").read_text())
    assert report["gate"]["decision"] == "promoted" and report["breakeven"]["tau_star"] == 0.5
    # The report's figures and plots reach the configured tracker (one eval run per report).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tracking" / "eval-step-1" / "gate"))
    events.Reload()
    assert events.Scalars("eval/tau_star")[0].value == 0.5
    tau = events.Scalars("eval/candidate/mtbench/tau")[0].value
    assert abs(tau - report["drafters"]["candidate"]["datasets"]["mtbench"]["tau"]) < 1e-6
    assert {"alpha", "tau"} <= set(events.Tags()["images"])
    assert report["drafters"]["candidate"]["lossless"]["ok"] is True
    for f in ("report.md", "alpha.png", "tau.png"):
        assert (tmp_path / "run" / "eval" / "step-1" / f).is_file()
    assert (tmp_path / "promoted").is_symlink()  # -> promotions/<fingerprint>/, immutable
    # Gating the serving drafter again with --promote (a rerun after a kill) does not measure it against itself.
    assert gate_command(easy, ckpt, name="rerun", promote=True) == 0
    assert not (tmp_path / "run" / "eval" / "rerun").exists()
    # Measured timings: another random drafter (tau ~ 1) cannot pay for its cycle; the promoted one is the
    # incumbent.
    other = save_checkpoint(fresh_drafter(shape_for_target(smollm2.hf_config, 1024, (2, 15, 27)),
                                          smollm2.embed_weight().detach(), d2t, t2d, seed=1),
                            tmp_path / "step-2", dtype="float32")
    # Four timing prompts of 32 new tokens each: each run's time is its steps times their lower quartile
    # (eval.stall_free), so a burst of another process on the shared cores during a few of its 31 steps does not
    # stretch the tau* interval over the loss.
    four = [two[0] | {"limit": 4}]
    measured = write_config(tmp_path, datasets=four, max_new_tokens=32)
    assert gate_command(measured, other, name="again") == 1
    report = json.loads((tmp_path / "run" / "eval" / "again" / "report.json").read_text())
    assert set(report["drafters"]) == {"candidate", "incumbent"} and report["breakeven"]["source"] == "measured"
    assert report["breakeven"]["tau_star"] > 1.0
    rows = [json.loads(x) for x in (tmp_path / "promotions.jsonl").read_text().splitlines()]
    assert [r["decision"] for r in rows] == ["promoted", "rejected"]
    assert rows[1]["incumbent"]["fingerprint"] == rows[0]["fingerprint"]


def test_a_crash_inside_the_gate_exits_2_not_1(tmp_path, tiny_drafter, monkeypatch, capsys):
    import eval.gate_flow

    def boom(*_a, **_k):
        raise RuntimeError("boom")

    monkeypatch.setattr(eval.gate_flow, "evaluate", boom)
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    assert gate_command(write_config(tmp_path), ckpt, promote=True) == 2
    err = capsys.readouterr().err
    assert "error: unexpected RuntimeError: boom" in err.splitlines()[-1]
    assert not (tmp_path / "promotions.jsonl").exists() and not (tmp_path / "promoted").exists()


def two_prompt_report(tau: float, alpha: float, tokens: int) -> dict:
    """An evaluation report of the candidate alone on two MT-Bench prompts of 10 verify cycles and ``tokens`` tokens
    each (no spread: the point rule), break-even 1.0 from the config; the shape ``eval.gate_flow.evaluate`` returns."""
    per_prompt = {"tokens": [tokens, tokens], "cycles": [10, 10]}
    return {"drafters": {"candidate": {"datasets": {"mtbench": {"tau": tau, "alpha_conditional": [alpha],
                                                                "per_prompt": per_prompt}},
                                       "lossless": {"ok": True}}},
            "breakeven": {"tau_star": 1.0, "source": "config"}, "checkpoints": {},
            "records_skipped_short": {"mtbench": 0}}


def test_an_unwritable_history_is_exit_2_before_anything_is_promoted(tmp_path, tiny_drafter, monkeypatch, capsys):
    import eval.gate_flow

    report = two_prompt_report(tau=9.0, alpha=1.0, tokens=90)
    monkeypatch.setattr(eval.gate_flow, "evaluate", lambda *_a: report)
    monkeypatch.setattr(eval.gate_flow, "save_report", lambda *_a: None)
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    (tmp_path / "promotions.jsonl").mkdir()  # the record cannot be written
    assert gate_command(write_config(tmp_path), ckpt, promote=True) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {tmp_path / 'promotions.jsonl'}: Is a directory"]
    assert not (tmp_path / "promoted").exists()  # the record comes first: no record, no promotion


def test_eval_run_refuses_nan_weights_and_a_truncated_checkpoint_in_one_line(tmp_path, tiny_drafter, capsys):
    cfg = write_config(tmp_path)
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    weights = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert run_command(cfg, ckpt) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {ckpt / 'model.safetensors'}: unreadable safetensors file")
    state = load_file(save_checkpoint(tiny_drafter, ckpt, dtype="float32") / "model.safetensors")
    state["midlayer.mlp.up_proj.weight"][1, 2] = float("inf")
    save_file(state, ckpt / "model.safetensors")
    assert run_command(cfg, ckpt) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {ckpt / 'model.safetensors'}: non-finite weights (NaN/inf) in midlayer.mlp.up_proj.weight; "
                   "pick an earlier checkpoint (training skips non-finite steps, so this one was damaged after it was "
                   "saved)"]


def test_eval_unusable_run_dir_and_full_disk_are_one_line(tmp_path, tiny_drafter, monkeypatch, capsys):
    import errno

    import eval.commands

    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert run_command(write_config(tmp_path), ckpt, [f"run_dir={blocker / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {blocker / 'run'}") and "not a directory" in err[0], err

    def full(*_a):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / "eval" / "x" / "report.json"))

    monkeypatch.setattr(eval.commands, "evaluate", lambda *_a: {"name": "x"})
    monkeypatch.setattr(eval.commands, "save_report", full)
    assert run_command(write_config(tmp_path), ckpt) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'run' / 'eval' / 'x' / 'report.json'}: no space left on the device: free some, "
                   "or point run_dir at a bigger disk (--set run_dir=/big/disk/run), then rerun (stages resume)"]


def test_a_rerun_of_a_promoting_gate_does_not_measure_the_serving_drafter_against_itself(tmp_path, tiny_drafter,
                                                                                           monkeypatch, capsys):
    """The pipeline was killed after its gate promoted, before it marked the round done; the rerun gates the
    same candidate with min_delta 0.05: it must not reject what is serving."""
    import eval.gate_flow

    calls = []
    report = two_prompt_report(tau=3.0, alpha=0.9, tokens=30)
    monkeypatch.setattr(eval.gate_flow, "evaluate", lambda *a: calls.append(a) or report)
    monkeypatch.setattr(eval.gate_flow, "save_report", lambda *_a: None)
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    cfg = write_config(tmp_path)
    assert gate_command(cfg, ckpt, ["gate.min_delta=0.05"], promote=True) == 0
    assert len(calls) == 1 and (tmp_path / "promoted").is_symlink()
    assert gate_command(cfg, ckpt, ["gate.min_delta=0.05"], incumbent=str(tmp_path / "promoted"), promote=True) == 0
    assert len(calls) == 1 and "PROMOTED (already: serving since" in capsys.readouterr().out
    rows = [json.loads(x) for x in (tmp_path / "promotions.jsonl").read_text().splitlines()]
    assert [r["decision"] for r in rows] == ["promoted"]


def test_an_unresolved_gate_exits_1_records_it_and_promotes_nothing(tmp_path, tiny_drafter, monkeypatch, capsys):
    """The candidate and the incumbent differ by less than 5 prompts can tell: nothing is promoted, the history
    records "unresolved" with the dataset's line and the records skipped for too few user turns, the exit code is
    1 (a CI job reads it as not shipped)."""
    import eval.gate_flow

    def ds(tokens: list[int]) -> dict:
        return {"tau": sum(tokens) / 50, "alpha_conditional": [0.5],
                "per_prompt": {"tokens": tokens, "cycles": [10] * 5}}

    report = {"drafters": {"candidate": {"datasets": {"mtbench": ds([26, 18, 31, 21, 27])}, "lossless": {"ok": True}},
                           "incumbent": {"datasets": {"mtbench": ds([25, 21, 29, 23, 24])}}},
              "breakeven": {"tau_star": 1.2, "source": "config"}, "checkpoints": {"incumbent": {"path": "x"}},
              "records_skipped_short": {"mtbench": 3}}
    monkeypatch.setattr(eval.gate_flow, "evaluate", lambda *a: report)
    monkeypatch.setattr(eval.gate_flow, "save_report", lambda *_a: None)
    cand = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    inc = save_checkpoint(tiny_drafter, tmp_path / "inc", dtype="float32")
    assert gate_command(write_config(tmp_path), cand, incumbent=str(inc), promote=True) == 1
    assert capsys.readouterr().out.strip().endswith("UNRESOLVED") and not (tmp_path / "promoted").exists()
    row = json.loads((tmp_path / "promotions.jsonl").read_text())
    assert row["decision"] == "unresolved" and row["intervals"]["mtbench"]["vs_incumbent"]["prompts"] == 5
    assert row["records_skipped_short"] == {"mtbench": 3}  # records the measured prompts leave out
    assert row["reasons"][0].startswith("mtbench: UNRESOLVED (5 prompts, 95% intervals)")
    assert report["intervals"] == row["intervals"]  # the report carries them too


class Killed(BaseException):
    """A kill, simulated: raised where the kill hits, and caught by nothing in the code under test."""


def test_a_decision_on_disk_has_its_report_and_a_rerun_after_a_kill_at_the_switch_records_nothing_more(
        tmp_path, tiny_drafter, monkeypatch, capsys):
    """The report is written before the decision is recorded and before ``promoted`` switches, so a kill at the
    switch leaves a recorded promotion with its report; the rerun completes the switch, measures nothing and
    records nothing more."""
    import eval.gate
    import eval.gate_flow

    calls, saved = [], []
    report = two_prompt_report(tau=3.0, alpha=0.9, tokens=30)
    history, promoted = tmp_path / "promotions.jsonl", tmp_path / "promoted"

    def save(_cfg, r):
        saved.append((r["gate"]["decision"], history.exists(), promoted.exists()))

    real_switch, switches = eval.gate._switch, []

    def switch_killed_once(*a):
        switches.append(a)
        if len(switches) == 1:
            raise Killed
        real_switch(*a)

    monkeypatch.setattr(eval.gate_flow, "evaluate", lambda *a: calls.append(a) or report)
    monkeypatch.setattr(eval.gate_flow, "save_report", save)
    monkeypatch.setattr(eval.gate, "_switch", switch_killed_once)
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    cfg = write_config(tmp_path)
    with pytest.raises(Killed):
        gate_command(cfg, ckpt, promote=True)
    assert saved == [("promoted", False, False)]  # the report came before the record and the switch
    assert [json.loads(x)["decision"] for x in history.read_text().splitlines()] == ["promoted"]
    assert not promoted.exists()
    assert gate_command(cfg, ckpt, promote=True) == 0
    out = capsys.readouterr().out
    assert "completed the promotion of" in out and "PROMOTED (already: serving since" in out
    assert len(calls) == 1 and len(saved) == 1
    assert [json.loads(x)["decision"] for x in history.read_text().splitlines()] == ["promoted"]
    assert (promoted / "config.json").is_file() and promoted.resolve().parent.name == "promotions"


def test_a_kill_before_the_record_leaves_no_decision_and_the_rerun_decides_once(tmp_path, tiny_drafter,
                                                                               monkeypatch):
    """A kill between the report and the record: nothing is recorded (the report's decision never took effect);
    the rerun measures again, rewrites the report and records one decision."""
    import eval.gate_flow

    saved = []
    report = two_prompt_report(tau=0.5, alpha=0.1, tokens=5)
    real_record = eval.gate_flow.record_decision

    def record_killed_once(*a):
        if len(saved) == 1:
            raise Killed
        real_record(*a)

    monkeypatch.setattr(eval.gate_flow, "evaluate", lambda *a: report)
    monkeypatch.setattr(eval.gate_flow, "save_report", lambda _c, r: saved.append(r["gate"]["decision"]))
    monkeypatch.setattr(eval.gate_flow, "record_decision", record_killed_once)
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    cfg = write_config(tmp_path)
    with pytest.raises(Killed):
        gate_command(cfg, ckpt, promote=True)
    assert saved == ["rejected"] and not (tmp_path / "promotions.jsonl").exists()
    assert gate_command(cfg, ckpt, promote=True) == 1
    assert saved == ["rejected", "rejected"]
    rows = [json.loads(x) for x in (tmp_path / "promotions.jsonl").read_text().splitlines()]
    assert [r["decision"] for r in rows] == ["rejected"]


def test_tries_count_the_other_candidates_gated_against_the_same_incumbent_on_the_same_prompts(tmp_path) -> None:
    """Try c is read at 1 - 5 %/c: the same candidate again is the same try, and another incumbent, other prompts
    or a record without a family are another family."""
    from common.config import load_config
    from eval.gate_tries import family_key, tries

    cfg = load_config(write_config(tmp_path))
    same = family_key(cfg, "inc", "hf")
    (tmp_path / "b").mkdir()
    other_prompts = load_config(write_config(tmp_path / "b", num_steps=5))
    assert family_key(other_prompts, "inc", "hf") != same != family_key(cfg, "inc-2", "hf")
    assert family_key(cfg, "inc", "live") != same
    for fp, family in (("a", same), ("b", same), ("a", same), ("c", family_key(cfg, "inc-2", "hf")), ("d", None)):
        append_history(cfg.gate.history_file, {"decision": "unresolved", "fingerprint": fp,
                                               "tries": {"family": family} if family else None})
    t = tries(cfg, "e", "inc", "hf")
    assert t.earlier == ("a", "b") and t.count == 3 and t.level == pytest.approx(1 - 0.05 / 3)
    assert tries(cfg, "a", "inc", "hf").count == 2  # "a" again: one other candidate ("b") was tried
    assert tries(cfg, "e", "inc-3", "hf").level == pytest.approx(0.95)


def test_the_second_candidate_against_an_incumbent_is_gated_at_the_level_two_tries_call_for(tmp_path, tiny_drafter,
                                                                                             monkeypatch, capsys):
    """Two candidates gated in turn against one incumbent on the same prompts: the second reads its intervals at
    97.5 %, the history and the report say so, and gating the first again stays the second try."""
    import eval.gate_flow

    def ds(tokens: list[int]) -> dict:
        return {"tau": sum(tokens) / 50, "alpha_conditional": [0.5],
                "per_prompt": {"tokens": tokens, "cycles": [10] * 5}}

    levels = []
    report = {"drafters": {"candidate": {"datasets": {"mtbench": ds([26, 18, 31, 21, 27])}, "lossless": {"ok": True}},
                           "incumbent": {"datasets": {"mtbench": ds([25, 21, 29, 23, 24])}}},
              "breakeven": {"tau_star": 1.2, "source": "config"}, "checkpoints": {"incumbent": {"path": "x"}},
              "records_skipped_short": {"mtbench": 0}}
    monkeypatch.setattr(eval.gate_flow, "evaluate", lambda cfg, *a: levels.append(cfg.gate.confidence) or report)
    monkeypatch.setattr(eval.gate_flow, "save_report", lambda *_a: None)
    inc = save_checkpoint(tiny_drafter, tmp_path / "inc", dtype="float32")
    first = save_checkpoint(tiny_drafter, tmp_path / "first", dtype="float32")
    with torch.no_grad():
        tiny_drafter.fc.weight.add_(0.01)
    second = save_checkpoint(tiny_drafter, tmp_path / "second", dtype="float32")
    cfg = write_config(tmp_path)
    for ckpt in (first, second, first):
        assert gate_command(cfg, ckpt, incumbent=str(inc)) == 1
    rows = [json.loads(x) for x in (tmp_path / "promotions.jsonl").read_text().splitlines()]
    assert levels == [0.95, pytest.approx(0.975), pytest.approx(0.975)]
    assert [r["tries"]["count"] for r in rows] == [1, 2, 2] and rows[0]["tries"]["family"] == rows[1]["tries"]["family"]
    assert rows[1]["reasons"][0].startswith("mtbench: UNRESOLVED (5 prompts, 97.5% intervals)")
    assert any(r.startswith("tries: candidate 2 against this incumbent on these prompts (1 earlier in")
               for r in rows[1]["reasons"])
    assert report["gate"]["tries"]["level"] == pytest.approx(0.975)

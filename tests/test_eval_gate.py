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

from drafter.checkpoint import save_checkpoint
from eval.commands import gate_command, run_command
from eval.gate import append_history, decide, promote

TAU_STAR = 2.0
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("case, tau, incumbent, problems, mismatches, promote_expected, reason", [
    ("clears break-even, loses to incumbent", {"a": 2.5, "b": 2.4}, {"a": 2.6, "b": 2.3}, [], [], False,
     "a: tau 2.500 < incumbent 2.600"),
    ("beats break-even and incumbent", {"a": 2.7, "b": 2.4}, {"a": 2.6, "b": 2.3}, [], [], True, None),
    ("no incumbent, clears break-even", {"a": 2.1}, None, [], [], True, None),
    ("below break-even on one dataset", {"a": 2.7, "b": 1.9}, None, [], [], False, "b: tau 1.900 < break-even"),
    ("NaN weights", {"a": 3.0}, None, ["ckpt: fc.weight holds non-finite values"], [], False, "non-finite"),
    ("lossless mismatch", {"a": 3.0}, None, [], ["mtbench prompt 0 differs at token 5"], False, "lossless"),
    ("NaN tau", {"a": float("nan")}, None, [], [], False, "< break-even"),
])
def test_decision_table(case, tau, incumbent, problems, mismatches, promote_expected, reason):
    d = decide(tau, TAU_STAR, 0.0, incumbent, 0.0, problems, mismatches)
    assert d.promote is promote_expected, (case, d.reasons)
    if reason:
        assert any(reason in r for r in d.reasons), d.reasons


def test_margin_and_min_delta_are_applied():
    assert not decide({"a": 2.05}, 2.0, 0.05).promote  # needs 2.1
    assert decide({"a": 2.1}, 2.0, 0.05).promote
    assert not decide({"a": 2.5}, 2.0, 0.0, {"a": 2.48}, 0.05).promote
    assert decide({"a": 2.55}, 2.0, 0.0, {"a": 2.48}, 0.05).promote


def test_promote_replaces_atomically_and_skips_training_state(tmp_path):
    src = tmp_path / "step-1"
    (src / "training_state").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"new")
    dst = tmp_path / "promoted"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"old")
    (dst / "stale.txt").write_text("x")
    promote(src, dst)
    assert (dst / "model.safetensors").read_bytes() == b"new"
    assert not (dst / "stale.txt").exists() and not (dst / "training_state").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["promoted", "step-1"]  # no temp dirs left


def test_history_appends_whole_lines(tmp_path):
    h = tmp_path / "sub" / "promotions.jsonl"
    append_history(h, {"decision": "rejected"})
    append_history(h, {"decision": "promoted"})
    rows = [json.loads(line) for line in h.read_text().splitlines()]
    assert [r["decision"] for r in rows] == ["rejected", "promoted"] and all("time" in r for r in rows)


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


def test_cli_rejects_nan_weights_and_errors_are_exit_2(tmp_path, tiny_drafter, capsys):
    ckpt = save_checkpoint(tiny_drafter, tmp_path / "step-1", dtype="float32")
    state = load_file(ckpt / "model.safetensors")
    state["fc.weight"][0, 0] = float("nan")
    save_file(state, ckpt / "model.safetensors")
    cfg = write_config(tmp_path)
    assert gate_command(cfg, ckpt) == 1
    row = json.loads((tmp_path / "promotions.jsonl").read_text())
    assert row["decision"] == "rejected" and any("non-finite" in r for r in row["reasons"])
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
    easy = write_config(tmp_path, tracking={"report_to": ["tensorboard"], "project": "gate"},
                        timings={"decode_ms": 100.0, "cycle_ms": {3: 50.0}})
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
    # Measured timings: a random drafter (tau ~ 1) cannot pay for its cycle; the promoted copy is the incumbent.
    measured = write_config(tmp_path)
    assert gate_command(measured, ckpt, name="again") == 1
    report = json.loads((tmp_path / "run" / "eval" / "again" / "report.json").read_text())
    assert set(report["drafters"]) == {"candidate", "incumbent"} and report["breakeven"]["source"] == "measured"
    assert report["breakeven"]["tau_star"] > 1.0
    rows = [json.loads(x) for x in (tmp_path / "promotions.jsonl").read_text().splitlines()]
    assert [r["decision"] for r in rows] == ["promoted", "rejected"]
    assert rows[1]["incumbent"]["fingerprint"] == rows[0]["fingerprint"]

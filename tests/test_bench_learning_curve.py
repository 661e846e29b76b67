"""bench/drafter_quality.py curve: a point per kept checkpoint, measured once. A cut run (a device call's end)
keeps its points, and the rerun measures only the checkpoints it had not reached, or one retrained since."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from bench import drafter_quality
from drafter.sglang_checkpoint import save_checkpoint
from train.run_checkpoints import STATE_DIR, TRAINER_FILE


def fake_checkpoint(root: Path, drafter, step: int, tokens: int) -> Path:
    ckpt = save_checkpoint(drafter, root / f"step-{step:06d}", dtype="float32")
    (ckpt / STATE_DIR).mkdir()
    (ckpt / STATE_DIR / TRAINER_FILE).write_text(json.dumps({"position": {"step": step, "tokens_seen": tokens}}))
    return ckpt


@pytest.mark.real
def test_a_rerun_measures_only_new_or_retrained_checkpoints(bench_results, tmp_path, smollm2, monkeypatch):
    from drafter.factory import fresh_drafter, shape_for_target
    from drafter.vocab_map import build_vocab_map

    d2t, t2d = build_vocab_map(torch.zeros(smollm2.vocab_size), 512)
    drafter = fresh_drafter(shape_for_target(smollm2.hf_config, 512, (2, 15, 27)), smollm2.embed_weight().detach(),
                            d2t, t2d)
    run = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "run_dir": str(run), "target": {"name": "smollm2-135m-instruct", "device": "cpu", "aux_layer_ids": [2, 15, 27]},
        "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]},
        "eval": {"num_steps": 3, "max_new_tokens": 6,
                 "datasets": [{"name": "mtbench", "kind": "mtbench", "path": "builtin"}]}}))
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    (run / "train_log.jsonl").write_text(json.dumps({"step": 10, "holdout/acc_0": 0.25}) + "\n")
    fake_checkpoint(ckpts, drafter, 10, 1000)
    fake_checkpoint(ckpts, drafter, 20, 2000)
    (ckpts / "step-000030.tmp-x").mkdir()  # a killed save: not a checkpoint
    measured = []
    real = drafter_quality.acceptance

    def counting(*a, **kw):
        measured.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(drafter_quality, "acceptance", counting)
    args = drafter_quality.parser().parse_args(["curve", "--config", str(cfg), "--run-dir", str(run), "--limit", "1"])

    assert drafter_quality.cmd_curve(args) == 0 and len(measured) == 2
    first = json.loads(bench_results.read_text())["learning_curve"]
    assert [p["step"] for p in first["points"]] == [10, 20] and first["checkpoints"] == 2
    assert [p["tokens"] for p in first["points"]] == [1000, 2000]
    assert first["points"][0]["holdout"] == {"acc_0": 0.25} and first["points"][1]["holdout"] == {}
    assert (tmp_path / "learning_curve.png").is_file()

    fake_checkpoint(ckpts, drafter, 30, 3000)  # training went on
    trainer = ckpts / "step-000010" / STATE_DIR / TRAINER_FILE  # and step 10 was trained again
    trainer.write_text(json.dumps({"position": {"step": 10, "tokens_seen": 1001}}))
    assert drafter_quality.cmd_curve(args) == 0 and len(measured) == 4
    again = json.loads(bench_results.read_text())["learning_curve"]["points"]
    assert [p["step"] for p in again] == [10, 20, 30] and again[0]["tokens"] == 1001
    assert again[1] == first["points"][1]  # kept, not measured again

"""Online training (train.source: online) trains on exactly what the store path trains on: the same
batches and the same TTT loss, with the target's states computed per batch instead of read from shards.
Checked with the real SmolLM2 target in fp32: every per-step loss of the two runs agrees within 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from common.config import load_config
from data_prep.capture import run_capture
from train.loop import run as run_training

CHATS = [
    ["Name three primary colours.", "Red, yellow and blue.", "And secondary ones?", "Green, orange and purple."],
    ["What is 12 times 12?", "12 times 12 is 144."],
    ["Write a haiku about rain.", "Soft rain on the roof,\nthe garden drinks quietly,\nclouds hum their grey song."],
    ["Translate 'good morning' to French.", "Bonjour.", "And to Spanish?", "Buenos días."],
    ["List the planets.", "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune."],
    ["Give me a synonym for happy.", "Joyful."],
    ["How many legs does a spider have?", "Eight."],
    ["What is the boiling point of water?", "100 degrees Celsius at sea level.", "In Fahrenheit?", "212 °F."],
]


def write_run(root: Path, source: str) -> Path:
    root.mkdir(parents=True)
    with open(root / "conversations.jsonl", "w") as f:
        for i, turns in enumerate(CHATS):
            msgs = [{"role": "user" if j % 2 == 0 else "assistant", "content": t} for j, t in enumerate(turns)]
            f.write(json.dumps({"id": f"c{i}", "source": "test", "messages": msgs,
                                "finish_reasons": ["stop"] * (len(turns) // 2),
                                "backend": "test"}) + "\n")
    tree = {
        "run_dir": str(root),
        "target": {"name": "smollm2-135m-instruct", "dtype": "float32", "device": "cpu", "aux_layer_ids": [2, 15, 27]},
        "drafter": {"draft_vocab_size": 512},
        "data": {"sources": [{"kind": "lines", "path": "unused"}]},
        "capture": {"max_length": 128, "dtype": "float32", "shard_samples": 3, "batch_tokens": 256},
        "train": {"source": source, "max_steps": 6, "epochs": 3, "batch_tokens": 160, "lr": 3e-3, "ttt_length": 3,
                  "holdout_fraction": 0.2, "eval_every": 3, "save_every": 1000, "log_every": 1,
                  "mixed_precision": "no"},
        "eval": {"datasets": [{"name": "x", "kind": "lines"}]},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def step_losses(root: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in (root / "train_log.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in recs if "loss" in r}


def step_fields(root: Path, key: str) -> list[float]:
    recs = [json.loads(line) for line in (root / "train_log.jsonl").read_text().splitlines()]
    return [r[key] for r in recs if "tokens_per_s" in r]


def holdout(root: Path) -> list[dict[str, float]]:
    recs = [json.loads(line) for line in (root / "train_log.jsonl").read_text().splitlines()]
    return [r for r in recs if "holdout/acc_0" in r]


@pytest.mark.real
def test_online_and_store_training_give_the_same_losses(smollm2, tmp_path: Path) -> None:
    offline_cfg = write_run(tmp_path / "store", "store")
    online_cfg = write_run(tmp_path / "online", "online")
    run_capture(load_config(offline_cfg), target=smollm2)
    assert run_training(offline_cfg) == 0
    assert run_training(online_cfg) == 0
    assert not (tmp_path / "online" / "store").exists(), "online training wrote a store"
    assert (tmp_path / "online" / ".lock").is_file()  # it trained under the run dir's lock, as the store path does
    offline, online = step_losses(tmp_path / "store"), step_losses(tmp_path / "online")
    assert sorted(offline) == sorted(online) == list(range(1, 7))
    # Online, the target's states come from the training batches' forward, not capture's: the same sums in another
    # order, equal to eps * sqrt(1536 terms * 30 layers) = 2.6e-5 of their scale (tests/test_data_prep_capture.py),
    # and the loss, a smooth function of them, to that share of itself (seen: 7e-7 of it, 2 threads on AVX-512).
    rel = torch.finfo(torch.float32).eps * (1536 * 30) ** 0.5
    assert all(abs(offline[s] - online[s]) <= rel * abs(offline[s]) for s in offline), (offline, online)
    # the log splits each step: online, the target's forward is real time; from the store, there is none to run
    stored, live = step_fields(tmp_path / "store", "target_ms"), step_fields(tmp_path / "online", "target_ms")
    assert len(stored) == len(live) == 6 and min(live) > max(stored)
    assert min(step_fields(tmp_path / "online", "drafter_ms")) > 0
    a, b = holdout(tmp_path / "store"), holdout(tmp_path / "online")
    assert len(a) == len(b) == 2
    # the finished run drew its held-out curve
    assert (tmp_path / "online" / "holdout_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for x, y in zip(a, b, strict=True):
        assert x["holdout/acc_0"] == pytest.approx(y["holdout/acc_0"], abs=1e-6)
        assert x["holdout/loss_0"] == pytest.approx(y["holdout/loss_0"], rel=rel)


@pytest.mark.real
def test_online_training_runs_the_lk_objective(smollm2, tmp_path: Path) -> None:
    """train.loss lk_lambda through the real loop: the target's whole lm_head gives the mass on the draft vocab,
    every step's loss is finite and a checkpoint is saved."""
    cfg = write_run(tmp_path / "lk", "online")
    tree = yaml.safe_load(cfg.read_text())
    tree["train"] |= {"loss": "lk_lambda", "max_steps": 2}
    cfg.write_text(yaml.safe_dump(tree))
    assert run_training(cfg) == 0
    losses = step_losses(tmp_path / "lk")
    assert sorted(losses) == [1, 2] and all(v is not None and v == v for v in losses.values())
    assert list((tmp_path / "lk" / "checkpoints").glob("step-000002"))

"""The stages chained on the real SmolLM2 target: regenerate → capture → train → speculative eval.

A drafter trained on the target's own answers must (a) pass `drafter check`, (b) accept well on those
prompts — a real threshold, far above the τ = 1 of an untrained drafter — and (c) stay lossless: at T=0
its speculative output equals the target's greedy output token for token.
"""

from __future__ import annotations

import json

import pytest
import yaml

from common.config import load_config
from data_prep.capture import run_capture
from data_prep.regenerate import run_regenerate
from drafter.sglang_checkpoint import check_checkpoint, load_checkpoint
from engine.batched import BatchedTarget
from eval import metrics
from eval.batched_speculative import speculative_batch
from eval.prompts import render
from eval.speculative import Eagle3Proposer, Engine
from target_model.hf_model import stop_token_ids
from train.loop import run as run_training

PROMPTS = ["Count from 1 to 12.", "List the days of the week.", "Name the months of the year.",
           "Write the alphabet from A to L.", "Say hello in three languages.", "List five colours."]
K, NEW = 3, 24


@pytest.mark.real
def test_trained_drafter_accepts_and_stays_lossless(smollm2, tmp_path):
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"p{i}", "source": "test", "messages": [{"role": "user", "content": p}]}) + "\n"
        for i, p in enumerate(PROMPTS)))
    tree = {
        "run_dir": str(tmp_path),
        "target": {"name": "smollm2-135m-instruct", "dtype": "float32", "device": "cpu", "aux_layer_ids": [2, 15, 27]},
        "drafter": {"draft_vocab_size": 256},
        "data": {"sources": [{"kind": "lines", "path": "unused"}]},
        "regenerate": {"backend": "hf", "batch_size": 6, "max_new_tokens": 40},
        "capture": {"max_length": 96, "dtype": "float32", "shard_samples": 4},
        "train": {"epochs": 40, "batch_tokens": 1024, "lr": 3e-3, "ttt_length": 3, "holdout_fraction": 0.0,
                  "save_every": 1000, "eval_every": 1000, "log_every": 50},
        "eval": {"datasets": [{"name": "x", "kind": "lines"}]},
    }
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(tree))
    cfg = load_config(cfg_path)
    run_regenerate(cfg)
    run_capture(cfg, target=smollm2)
    assert run_training(cfg_path) == 0

    best = cfg.checkpoints_dir / "best"
    assert check_checkpoint(best) == []
    drafter = load_checkpoint(best, smollm2.num_layers)
    drafter.set_embeddings(smollm2.embed_weight())
    proposer = Eagle3Proposer(drafter, [2, 15, 27])
    engine = Engine(smollm2, [2, 15, 27], stop_token_ids(smollm2.tokenizer))
    accepted, rows = [], [render(smollm2.tokenizer, p) for p in PROMPTS]
    batched = speculative_batch(BatchedTarget(smollm2.model, [2, 15, 27]), drafter, rows, K, NEW,
                                stop_token_ids(smollm2.tokenizer))
    for p, ids, row in zip(PROMPTS, rows, batched, strict=True):
        greedy = engine.plain(ids, NEW, 0.0, None)
        spec = engine.speculative(proposer, ids, K, NEW, 0.0, None)
        assert spec.tokens == greedy.tokens, p
        assert (row.tokens, row.accepted) == (spec.tokens, spec.accepted), f"batched eval differs on {p!r}"
        accepted += spec.accepted
    tau = metrics.tau_from_histogram(metrics.histogram(accepted, K))
    assert tau >= 2.0, f"a drafter trained on these very answers should accept well, got tau {tau:.2f}"

"""What training leaves out is counted and reported: the conversations rendering skipped and what the length and
answer caps cut (online: this run's render_all; store: capture's, from the manifest), and the batches of each epoch
no process reads (after the last whole accumulation window, past an even share over the processes, held-out ones
too). All in the set-up lines and the step-0 setup record of train_log.jsonl."""

from __future__ import annotations

import json
import types
from dataclasses import asdict
from pathlib import Path

import torch
from train_fixtures import make_config, make_store

from common.config import parse_config
from data_prep.dataset import LeftOutBatches, TokenBudgetSampler
from data_prep.loss_mask import Cuts, render_with_mask
from train.loop import left_out_line, run

COUNT = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"},
         {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"}]
SHORT = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there, friend."}]


def _log(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "run" / "train_log.jsonl").read_text().splitlines()]


def test_online_data_keeps_what_rendering_skipped_and_cut(tmp_path, monkeypatch) -> None:
    from target_model.hf_model import load_tokenizer, resolve_source
    from train import data

    tok = load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)
    recs = [("count", COUNT), ("short", SHORT), ("none", SHORT[:1]), ("short", SHORT)]  # no answer; a duplicate id
    (tmp_path / "conversations.jsonl").write_text("".join(json.dumps({"id": i, "messages": m}) + "\n" for i, m in recs))
    stub = types.SimpleNamespace(tokenizer=tok, num_layers=30, name="stub", hidden_size=8, vocab_size=4,
                                 embed_weight=lambda: torch.zeros(4, 8), lm_head_weight=lambda: torch.zeros(4, 8),
                                 fingerprint=lambda: "0")
    cfg = parse_config({"run_dir": str(tmp_path), "target": {"name": "smollm2-135m-instruct", "device": "cpu"},
                        "data": {"sources": [{"kind": "lines", "path": "unused"}]}, "capture": {"max_length": 64},
                        "train": {"source": "online", "max_answer_tokens": 5, "holdout_fraction": 0.0},
                        "eval": {"datasets": [{"name": "x", "kind": "lines"}]}})
    monkeypatch.setattr(data, "load_target_from_config", lambda cfg: stub)
    td = data.online_data(cfg, torch.device("cpu"))
    assert len(td.train) == 2 and td.left_out.skipped == {"duplicate_id": 1, "no_loss_tokens": 1}
    cuts = [render_with_mask(tok, c, 64, max_answer_tokens=5).cuts for c in (COUNT, SHORT)]
    assert td.left_out.cuts == cuts[0] + cuts[1] and td.left_out.cuts.truncated_samples == 1
    assert str(td.left_out).startswith("skipped: duplicate_id: 1, no_loss_tokens: 1; samples cut at "
                                       "capture.max_length: 1 (25 tokens, ")


def test_token_budget_sampler_names_the_batches_no_process_reads() -> None:
    # 5 one-sample batches over 2 processes: ranks read [0, 2] and [1, 3]; batch 4 goes to none
    five = [TokenBudgetSampler([40] * 5, 40, shuffle=False, num_replicas=2, rank=r) for r in (0, 1)]
    assert [s.batches() for s in five] == [[[0], [2]], [[1], [3]]]
    assert five[0].left_out() == five[1].left_out() == LeftOutBatches(1, 1, 40, 5)
    assert TokenBudgetSampler([40] * 5, 40, shuffle=False).left_out() == LeftOutBatches(0, 0, 0, 5)
    lengths = [5 + (i * 7) % 30 for i in range(61)]
    for replicas in (1, 2, 3):
        for per_process in (1, 4, 1000):
            ranks = [TokenBudgetSampler(lengths, 60, seed=3, num_replicas=replicas, rank=r) for r in range(replicas)]
            for s in ranks:
                s.set_epoch(2)
            read = [b for s in ranks for b in s.batches()[:per_process]]
            unread = sum(lengths) - sum(lengths[i] for b in read for i in b)
            left = ranks[0].left_out(per_process)
            assert left.formed == len(read) + left.batches and left.samples == 61 - sum(map(len, read))
            assert left.tokens == unread and all(s.left_out(per_process) == left for s in ranks)


def test_training_reports_left_out_batches_and_the_stores_skips(tmp_path, capsys) -> None:
    """17 training samples of 16 tokens, 3 a batch: 6 batches, one window of 4 (train.grad_accum) an epoch; the
    last 2 batches are never read. The store's manifest says what capture skipped and cut."""
    cfg = make_config(tmp_path, epochs=1, grad_accum=4, batch_tokens=48, holdout_fraction=0.15, eval_every=1000,
                      save_every=1000, log_every=1)
    store = make_store(tmp_path / "run" / "store", n_samples=20, length=16)
    manifest = json.loads((store / "manifest.json").read_text())
    cuts = Cuts(2, 30, 7, 11)
    manifest |= {"skipped": {"no_loss_tokens": 1, "loss_past_max_length": 2}, "cuts": asdict(cuts)}
    (store / "manifest.json").write_text(json.dumps(manifest))
    assert run(cfg) == 0
    out = capsys.readouterr().out
    setup = _log(tmp_path)[0]["setup"]
    n_train, n_held = setup["train_samples"], setup["holdout_samples"]
    assert n_train + n_held == 20 and f"{n_train} train / {n_held} held-out samples (store {store}; skipped: " \
        f"loss_past_max_length: 2, no_loss_tokens: 1; {cuts}); " in out
    batches = -(-n_train // 3)
    left = setup["left_out_per_epoch"]["train"]
    assert left["formed"] == batches and left["batches"] == batches % 4 > 0
    # what the steps saw and what was left out make up the whole training split
    tokens_seen = max(r["tokens_seen"] for r in _log(tmp_path) if "tokens_seen" in r)
    assert tokens_seen + left["tokens"] == 16 * n_train and left["samples"] * 16 == left["tokens"]
    assert f"left out of each epoch: training {LeftOutBatches(**left)} (after each process's last whole window of " \
           "train.grad_accum=4; reshuffled each epoch: epoch 0's samples and tokens); held-out 0 of " in out
    assert setup["skipped"] == {"loss_past_max_length": 2, "no_loss_tokens": 1} and setup["cuts"] == asdict(cuts)
    # a resume keeps the run's one setup record
    assert run(cfg) == 0
    assert [r["step"] for r in _log(tmp_path) if "setup" in r] == [0]


def test_the_left_out_line_names_the_even_share_over_processes() -> None:
    line = left_out_line({"train": LeftOutBatches(3, 5, 80, 11), "holdout": LeftOutBatches(1, 1, 40, 5)}, 2, 2)
    assert line == ("left out of each epoch: training 3 of 11 batches: 5 samples, 80 tokens (after each process's "
                    "last whole window of train.grad_accum=2; past an even share over 2 processes; reshuffled each "
                    "epoch: epoch 0's samples and tokens); held-out 1 of 5 batches: 1 samples, 40 tokens (past an "
                    "even share over 2 processes)")

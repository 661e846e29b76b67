"""tau by history length (eval/context_buckets.py, eval.quality.tau_by_context): every assistant turn of the held-out
conversations as a prompt, bucketed by its history's tokens, each bucket's interval over conversations."""

from __future__ import annotations

import json
import math

import torch
from tiny_speculative import tiny_target_and_drafter

from common.config import parse_config
from data_prep.dataset import in_holdout
from eval.context_buckets import BUCKETS, TurnPrompt, bucketed, by_conversation, holdout_turns
from eval.gate_stats import bootstrap
from eval.quality import tau_by_context
from target_model.hf_model import TargetModel

V = 12


class WordTokenizer:
    """A chat template that joins the turns, one token per word (ids 2..V-1): history length = words."""

    eos_token_id, unk_token_id, pad_token_id = 1, None, 0

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
        return " ".join(m["content"] for m in messages) + (" <a>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        class Out:
            input_ids = [2 + len(w) % (V - 2) for w in text.split()]
        return Out()

    def convert_tokens_to_ids(self, token):
        return None


def conversation(cid: str, words: list[int]) -> dict:
    """user, assistant, user, assistant, ...: turn i has words[i] words."""
    roles = ["user", "assistant"] * len(words)
    return {"id": cid, "messages": [{"role": r, "content": " ".join(["w"] * n)}
                                    for r, n in zip(roles, words, strict=False)]}


HELD = [c for c in (f"c{i}" for i in range(40)) if in_holdout(c, 0.5)][:3]
TRAIN = next(c for c in (f"c{i}" for i in range(40)) if not in_holdout(c, 0.5))


def test_every_assistant_turn_of_held_out_conversations_is_a_prompt():
    convs = [conversation(HELD[0], [10, 1010, 20, 30]), conversation(TRAIN, [5, 5]), conversation(HELD[1], [1500, 3])]
    turns, held = holdout_turns(convs, 0.5, WordTokenizer())
    assert held == 2  # the training conversation is never measured
    # HELD[0]: before answer 1: 10 words + the generation prompt; before answer 2: 10 + 1010 + 20 + 1
    assert [(t.conversation, len(t.ids)) for t in turns] == [(HELD[0], 11), (HELD[0], 1041), (HELD[1], 1501)]
    buckets, left = bucketed(turns + [TurnPrompt("x", [2] * 5000)])
    assert [len(buckets[name]) for name, _, _ in BUCKETS] == [1, 2, 0] and left == {"beyond": 1, "capped": 0}
    assert bucketed(turns, per_bucket=1)[1] == {"beyond": 0, "capped": 1}


def test_a_buckets_interval_resamples_conversations():
    ps = [TurnPrompt("a", []), TurnPrompt("b", []), TurnPrompt("a", [])]
    assert by_conversation(ps, [4, 6, 2], [2, 3, 1]) == ([6, 6], [3, 3])


def test_tau_by_context_on_a_tiny_target(tmp_path):
    target, drafter = tiny_target_and_drafter(V, (0, 1, 2))
    tm = TargetModel(target, WordTokenizer(), "tiny", None)
    cfg = parse_config({"run_dir": str(tmp_path), "target": {"name": "tiny"},
                        "data": {"sources": [{"kind": "lines", "path": "unused"}]},
                        "train": {"holdout_fraction": 0.5},
                        "eval": {"max_new_tokens": 12, "datasets": [{"name": "m", "kind": "mtbench"}]}})
    boot = bootstrap(cfg.gate)
    assert "not found" in tau_by_context(cfg, tm, drafter, (0, 1, 2), 3, 0.0, None, boot)["skipped"]
    convs = [conversation(HELD[0], [10, 20, 30, 40]), conversation(HELD[1], [1100, 5]),
             conversation(HELD[2], [7, 8]), conversation(TRAIN, [3, 3])]
    cfg.conversations_path.write_text("".join(json.dumps(c) + "\n" for c in convs))
    with torch.no_grad():
        out = tau_by_context(cfg, tm, drafter, (0, 1, 2), 3, 0.0, None, boot)
    assert out["holdout_conversations"] == 3 and out["beyond_last_bucket"] == 0
    short, mid, long = (out["buckets"][name] for name, _, _ in BUCKETS)
    assert (short["prompts"], short["conversations"], short["history_tokens"]) == (3, 2, [8, 61])
    assert (mid["prompts"], mid["conversations"]) == (1, 1)
    assert long["prompts"] == 0 and long["tau"] != long["tau"] and long["history_tokens"] is None  # NaN: none measured
    assert 1.0 <= short["tau"] <= 4.0 and short["ci"][0] <= short["tau"] <= short["ci"][1]
    assert all(math.isnan(x) for x in mid["ci"])  # one conversation: no interval

"""Later turns (eval/turns.py): MT-Bench's second turns after the target's own first answer, rendered as the server
renders the chat. SmolLM2's real tokenizer and chat template, a tiny random Llama over its vocabulary."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common.config import DatasetConfig
from engine.batched import BatchedTarget
from engine.continuous_batching import generate
from eval.prompts import PromptError, load_eval_turns, render, rendered_datasets
from eval.turns import EvalPrompts, eval_prompts, records_skipped_short
from target_model.hf_model import TargetModel, load_tokenizer, resolve_source, stop_token_ids


@pytest.fixture(scope="module")
def target() -> TargetModel:
    tok = load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=1024)
    return TargetModel(LlamaForCausalLM(cfg).eval(), tokenizer=tok, name="tiny", source_dir=None)


def test_mtbench_has_two_turns_and_short_records_are_counted(tmp_path):
    turns, short = load_eval_turns(DatasetConfig(name="t2", kind="mtbench", turn=2))
    assert len(turns) == 80 and short == 0 and all(len(t) == 2 for t in turns)
    assert turns[0][0].startswith("Compose an engaging travel blog post") and turns[0][1] != turns[0][0]
    f = tmp_path / "q.jsonl"
    f.write_text("".join(json.dumps({"turns": t}) + "\n" for t in (["a", "b"], ["c"], ["d", "e", "f"])))
    assert load_eval_turns(DatasetConfig(name="x", kind="mtbench", path=str(f), turn=2)) == ([["a", "b"], ["d", "e"]],
                                                                                            1)


def test_a_tokenizer_alone_refuses_later_turns(target):
    with pytest.raises(PromptError, match=r"eval.datasets 't2' \(turn 2\): a later turn's history is the target's"):
        rendered_datasets(target.tokenizer, [DatasetConfig(name="t2", kind="mtbench", turn=2, limit=1)])


def test_turn_2_follows_the_targets_own_greedy_answer(target):
    tok = target.tokenizer
    t1 = DatasetConfig(name="mtbench", kind="mtbench", limit=2)
    t2 = DatasetConfig(name="mtbench_turn2", kind="mtbench", turn=2, limit=2)
    prompts = eval_prompts(target, [t1, t2], max_new=6)
    turns, _ = load_eval_turns(t2)
    assert prompts["mtbench"] == [render(tok, t[0]) for t in turns]  # turn 1 as before
    answers = generate(BatchedTarget(target.model), prompts["mtbench"], 6, stop_token_ids(tok))
    for ids, t, a in zip(prompts["mtbench_turn2"], turns, answers, strict=True):
        assert a.tokens  # the history holds an answer
        first = tok.decode(a.tokens, skip_special_tokens=True)
        text = tok.decode(ids)
        history = tok.apply_chat_template([{"role": "user", "content": t[0]}, {"role": "assistant", "content": first},
                                           {"role": "user", "content": t[1]}], tokenize=False,
                                          add_generation_prompt=True)
        assert text == history and text.endswith(f"{t[1]}<|im_end|>\n<|im_start|>assistant\n")
        assert len(ids) > len(prompts["mtbench"][0])


def test_records_skipped_as_short_are_counted_per_dataset_and_noted(target, tmp_path, capsys):
    """A record with fewer user turns than the dataset's turn is a prompt not measured: the count travels with the
    prompts to the reports (``records_skipped_short``), and stderr still says so."""
    f = tmp_path / "q.jsonl"
    f.write_text("".join(json.dumps({"turns": t}) + "\n" for t in (["a", "b"], ["c"], ["d", "e"])))
    prompts = eval_prompts(target, [DatasetConfig(name="t1", kind="mtbench", path=str(f)),
                                    DatasetConfig(name="t2", kind="mtbench", path=str(f), turn=2)], max_new=2)
    assert isinstance(prompts, EvalPrompts) and {k: len(v) for k, v in prompts.items()} == {"t1": 3, "t2": 2}
    assert prompts.records_skipped_short == records_skipped_short(prompts) == {"t1": 0, "t2": 1}
    assert "note: eval dataset 't2': 1 records have fewer than 2 user turns; skipped" in capsys.readouterr().err
    assert records_skipped_short({"given": [[1, 2]]}) == {"given": 0}  # prompts not loaded here skipped none


def test_a_later_turns_history_is_kept_for_the_next_eval_of_the_target(target, tmp_path, monkeypatch, capsys):
    """The turn-2 prompts (the target's own first answers) are made once per target, turns, budget and template:
    the next eval reads them, equal, without generating; another budget is made again."""
    import eval.turns as turns_module

    t2 = DatasetConfig(name="mtbench_turn2", kind="mtbench", turn=2, limit=2)
    first = eval_prompts(target, [t2], max_new=5, cache_dir=tmp_path)

    def no_generating(*args, **kwargs):
        raise AssertionError("generated a kept history again")

    monkeypatch.setattr(turns_module, "generate", no_generating)
    capsys.readouterr()
    assert eval_prompts(target, [t2], max_new=5, cache_dir=tmp_path) == first
    assert f"history: 2 prompts read from {tmp_path}" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="generated a kept history"):
        eval_prompts(target, [t2], max_new=4, cache_dir=tmp_path)

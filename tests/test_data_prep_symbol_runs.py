"""Symbol runs: which tokens make runs, what a sample is given and trained on, and the real SmolLM2 continuing runs
inside its own answers, resumed after a kill."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from table_tokenizer import Table

from common.config import ConfigError, RunConfig, parse_config
from data_prep.loss_mask import LossMaskError, render_with_mask
from data_prep.steps import run_steps
from data_prep.symbol_runs import (
    KEPT_FILE,
    SKIPPED_FILE,
    Answer,
    Sample,
    SymbolRunsError,
    build_sample,
    continued,
    proposable,
    read_answers,
    read_done,
    record,
    run_symbol_runs,
    run_tokens,
    symbol_tokens,
)
from drafter.sglang_checkpoint import load_tensors
from engine.batched import BatchedTarget
from engine.continuous_batching import generate
from target_model.hf_model import load_tokenizer, resolve_source, stop_token_ids

# Conversations as regenerate writes them (SmolLM2-135M-Instruct's own greedy answers, abridged).
CONVERSATIONS = [
    {"id": "openai-0", "source": "openai", "finish_reasons": ["stop"],
     "messages": [{"role": "user", "content": "Write a Python function that shifts bits left."},
                  {"role": "assistant", "content": "Here is a function:\n\n```python\ndef shift(x, n):\n    return x "
                   "<< n\n```\n\nIt shifts x left by n bits."}]},
    {"id": "openai-1", "source": "openai", "finish_reasons": ["stop", "loop"],
     "messages": [{"role": "user", "content": "Make a table of three fruits."},
                  {"role": "assistant",
                   "content": "| Fruit | Colour |\n|---|---|\n| Apple | Red |\n| Banana | Yellow |"},
                  {"role": "user", "content": "Add a heading."},
                  {"role": "assistant", "content": "Fruits\n======\n\nHere they are again."}]},
]


def test_symbol_tokens_are_short_punctuation_that_encodes_back_to_itself() -> None:
    texts = ["a", "=", " <<", "<<", "::", "a=", "....", " ", "=\n", "<", "==", " ="]
    got = [texts[i] for i in symbol_tokens(Table(texts))]
    assert got == ["=", " <<", "<<", "::", "<", "==", " ="]


def test_a_continuation_keeps_the_run_when_nine_in_ten_of_its_tokens_are_the_runs() -> None:
    assert continued([7] * 10 + [5], 7) is True
    assert continued([7] * 8 + [5, 5], 7) is False
    assert continued([], 7) is False


@pytest.fixture(scope="module")
def tok() -> Any:
    return load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)


def make_cfg(tmp_path: Path, **keys: Any) -> RunConfig:
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    return parse_config({
        "run_dir": str(tmp_path / "run"), "target": {"name": "smollm2-135m-instruct", "device": "cpu"},
        "data": {"sources": [{"kind": "sharegpt", "path": "builtin"}],
                 "symbol_runs": {"conversations": str(path), "count": 6, "max_new_tokens": 12} | keys},
        "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench"}]}})


def test_a_run_token_is_punctuation_whose_run_encodes_to_its_copies(tok: Any) -> None:
    tokens = run_tokens(tok)
    assert tok.encode("<<", add_special_tokens=False)[0] in tokens
    for t in tokens:
        text = tok.decode([t])
        assert set(text.strip()) <= set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") and 1 <= len(text.strip()) <= 3
        assert tok.encode(text * 5, add_special_tokens=False) == [t] * 5
    # a symbol token whose copies merge into another token makes no run: "=" twice is not two "="
    equals = tok.encode("=", add_special_tokens=False)
    assert len(equals) == 1 and tok.encode("==", add_special_tokens=False) != equals * 2
    assert equals[0] not in tokens


def test_a_warm_start_gets_runs_only_of_tokens_in_its_draft_vocab(tok: Any) -> None:
    tokens = run_tokens(tok)
    shipped = proposable(tokens, "drafters/smollm2-135m-eagle3")
    t2d = load_tensors("drafters/smollm2-135m-eagle3", ["t2d"])["t2d"].bool()
    assert shipped == [t for t in tokens if t2d[t]] and 0 < len(shipped) < len(tokens)
    assert tok.encode("<<", add_special_tokens=False)[0] in shipped
    assert proposable(tokens, None) == tokens  # a fresh drafter builds its vocab from the data


def test_each_conversations_first_text_answer_is_a_candidate(tmp_path: Path) -> None:
    answers = read_answers(Path(make_cfg(tmp_path).data.symbol_runs.conversations))
    assert [(a.messages, a.content) for a in answers] == [(c["messages"][:1], c["messages"][1]["content"])
                                                        for c in CONVERSATIONS]
    (tmp_path / "bad.jsonl").write_text(json.dumps(CONVERSATIONS[0]) + "\n" + '{"id": "x", "messages": 3}\n')
    with pytest.raises(SymbolRunsError, match=r"bad.jsonl:2: not a conversation"):
        read_answers(tmp_path / "bad.jsonl")


def test_a_sample_is_its_own_seeds_cut_answer_then_the_run_as_the_target_reads_it(tmp_path: Path, tok: Any) -> None:
    s = make_cfg(tmp_path).data.symbol_runs
    answers = read_answers(Path(s.conversations))
    tokens = run_tokens(tok)
    a, b = (build_sample(tok, answers, tokens, s, None, 3) for _ in range(2))
    assert a == b  # drawn from the sample's own seed: a resumed run makes the same sample
    assert build_sample(tok, answers, tokens, s, None, 4) != a
    run = a.given[len(a.given.rstrip(tok.decode([a.run_token]))):]
    copies = len(run) // len(tok.decode([a.run_token]))
    assert s.min_run <= copies <= s.max_run and a.answer.content.startswith(a.given[:len(a.given) - len(run)])
    assert a.round_trips and a.prompt_ids[-copies:] == [a.run_token] * copies
    # the prompt is the conversation as the template renders it, up to the given part of the answer
    text = tok.decode(a.prompt_ids)
    assert text.endswith("<|im_start|>assistant\n" + a.given) and a.answer.messages[-1]["content"] in text


def test_only_what_the_target_wrote_after_the_given_part_is_trained(tok: Any) -> None:
    answer = Answer([{"role": "user", "content": "Draw a line."}], "Here:\n")
    given = "Here:\n" + "<<" * 6
    sample = Sample("runs-0-00000000", answer, given, tok.encode("<<", add_special_tokens=False)[0], [], True)
    for reason, trained in (("length", "<<<< done"), ("stop", "<<<< done<|im_end|>")):
        rec = record(sample, "<<<< done", reason)
        assert rec["messages"][-1]["given_chars"] == len(given)
        r = render_with_mask(tok, rec["messages"], 4096, finish_reasons=rec["finish_reasons"])
        masked = [t for t, m in zip(r.input_ids, r.loss_mask, strict=True) if m]
        assert tok.decode(masked) == trained
    bad = [*rec["messages"][:-1], {**rec["messages"][-1], "given_chars": len(given) + 100}]
    with pytest.raises(LossMaskError, match="given_chars"):
        render_with_mask(tok, bad, 4096, finish_reasons=["length"])


def test_the_config_says_what_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="min_run 30 > max_run 24"):
        make_cfg(tmp_path, min_run=30)


def test_samples_of_another_seed_are_an_error_naming_the_line(tmp_path: Path) -> None:
    (tmp_path / KEPT_FILE).write_text('{"id": "runs-1-00000000"}\n')
    with pytest.raises(SymbolRunsError, match=rf"{KEPT_FILE}:1: sample runs-1-00000000 is not of "
                                              r"data.symbol_runs.seed 0"):
        read_done(tmp_path / KEPT_FILE, tmp_path / SKIPPED_FILE, 0)


@pytest.mark.real
def test_the_real_target_continues_runs_greedily_and_a_kill_loses_none(tmp_path: Path, smollm2: Any) -> None:
    cfg = make_cfg(tmp_path)
    summary = run_symbol_runs(cfg)
    assert summary.made == 6 == summary.kept + sum(summary.skipped.values()) and summary.kept >= 4
    kept = [json.loads(x) for x in (cfg.root / KEPT_FILE).read_text().splitlines()]
    tok = smollm2.tokenizer
    s = cfg.data.symbol_runs
    answers, tokens = read_answers(Path(s.conversations)), run_tokens(tok)
    samples = [build_sample(tok, answers, tokens, s, None, int(r["id"][-8:])) for r in kept]
    # each continuation is the target's own greedy one (fp32 here, bf16 in the step: compare the first tokens)
    again = generate(BatchedTarget(smollm2.model), [x.prompt_ids for x in samples], s.max_new_tokens,
                     stop_token_ids(tok))
    for rec, sample, g in zip(kept, samples, again, strict=True):
        answer = rec["messages"][-1]
        assert answer["content"].startswith(sample.given) and answer["given_chars"] == len(sample.given)
        written = tok.encode(answer["content"][len(sample.given):], add_special_tokens=False)
        assert written[:4] == g.tokens[:4]
    # killed after two samples were written and mid-way through a third line: the rest is made again, once each
    lines = (cfg.root / KEPT_FILE).read_text().splitlines(keepends=True)
    (cfg.root / KEPT_FILE).write_text("".join(lines[:2]) + lines[2][:20])
    (cfg.root / SKIPPED_FILE).unlink()
    assert run_steps("symbol-runs", tmp_path / "cfg.yaml") == 2  # no config file: a one-line error, not a crash
    (tmp_path / "cfg.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    assert run_steps("symbol-runs", tmp_path / "cfg.yaml") == 0
    after = (cfg.root / KEPT_FILE).read_text().splitlines(keepends=True)
    assert after[:2] == lines[:2]
    assert sorted(json.loads(x)["id"] for x in after) == sorted(json.loads(x)["id"] for x in lines)

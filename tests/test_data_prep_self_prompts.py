"""Synthesize (Magpie): the template's prefix before a user's words, the draws a resumed run makes, the reasons a
draw is dropped, and the real SmolLM2 writing prompts that ingest then reads, resumed after a kill."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from llama_server import LlamaServer, free_port

from common.config import ConfigError, RunConfig, SynthesizeConfig, parse_config
from data_prep.decontaminate import turn_key
from data_prep.follow_ups import FollowUps
from data_prep.self_prompts import (
    DROPPED_FILE,
    KEPT_FILE,
    Draws,
    FirstTurns,
    continuation,
    fitting,
    read_draws,
    run_synthesize,
    verdict,
)
from data_prep.step_failed import StepFailed
from data_prep.steps import run_steps
from data_prep.user_turn import SynthesizeError, follow_up_prefix, query_prefix, query_stop, server_prompt

CODING = "You are a Python coding assistant. Users ask you to write or complete Python functions."


FIRST = FirstTurns([None], None)


def make_cfg(tmp_path: Path, regenerate: dict[str, Any] | None = None, follow_up: Path | None = None,
             **synthesize_keys: Any) -> RunConfig:
    run = tmp_path / "run"
    synthesize = ({"count": 5, "max_new_tokens": 96, "systems": [None, CODING]} if follow_up is None
                  else {"count": 2, "max_new_tokens": 96, "follow_up": str(follow_up)}) | synthesize_keys
    return parse_config({
        "run_dir": str(run), "target": {"name": "smollm2-135m-instruct", "device": "cpu"},
        "data": {"sources": [{"kind": "openai", "path": str(run / KEPT_FILE)}], "synthesize": synthesize},
        "regenerate": regenerate or {}, "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench"}]}})


# Conversations as regenerate writes them (the answers are SmolLM2-135M-Instruct's own greedy ones, abridged).
CONVERSATIONS = [
    {"id": f"openai-{i:016x}", "source": "openai",
     "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    for i, (question, answer) in enumerate([
        ("What is the capital of France?", "The capital of France is Paris."),
        ("Write a Python function that reverses a string.",
         "Here is a simple function:\n\n```python\ndef reverse_string(s):\n    return s[::-1]\n```"),
        ("Give me three tips for sleeping better.",
         "1. Keep a regular schedule.\n2. Avoid screens before bed.\n3. Keep your bedroom cool and dark."),
        ("Explain photosynthesis in one sentence.",
         "Photosynthesis is how plants turn sunlight, water and carbon dioxide into sugar and oxygen."),
        ("Name a famous painting by Leonardo da Vinci.", "The Mona Lisa is Leonardo da Vinci's most famous painting."),
        ("How many legs does a spider have?", "A spider has eight legs."),
    ])]


def write_conversations(path: Path, records: list[dict[str, Any]] = CONVERSATIONS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_query_prefix_is_the_template_up_to_the_users_words() -> None:
    from target_model.hf_model import load_tokenizer, resolve_source

    tok = load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)
    prefix = query_prefix(tok)
    assert prefix.endswith("<|im_start|>user\n")
    assert prefix.startswith("<|im_start|>system\n")  # the template's own default system turn, as it serves
    coding = query_prefix(tok, system="You are a Python coding assistant.")
    assert coding == "<|im_start|>system\nYou are a Python coding assistant.<|im_end|>\n<|im_start|>user\n"


class _DroppingTemplate:
    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return "<s>user: [redacted]</s>"


def test_a_template_that_does_not_write_the_users_words_is_an_error() -> None:
    with pytest.raises(SynthesizeError, match="does not appear once"):
        query_prefix(_DroppingTemplate())


def test_a_resumed_run_redraws_what_was_in_flight_before_new_draws() -> None:
    draws = Draws(done={0, 1, 3}, next_index=5)
    assert draws.keys(7, 4) == ["self-7-00000002", "self-7-00000004", "self-7-00000005", "self-7-00000006"]
    assert draws.next_index == 7
    assert draws.keys(7, 1) == ["self-7-00000002"]  # not written yet: still owed
    follow_ups = Draws(done={0, 1, 3}, next_index=5)  # no new draw past the last conversation to follow up
    assert follow_ups.keys(7, 4, limit=6) == ["self-7-00000002", "self-7-00000004", "self-7-00000005"]
    follow_ups.done |= {2, 4, 5}
    assert follow_ups.keys(7, 4, limit=6) == [] and follow_ups.next_index == 6


@pytest.mark.parametrize(("text", "reason", "why"), [
    ("Plan a three-day trip to Kyoto for me.", "stop", None),
    ("Plan a three-day trip to Kyoto", "length", "unfinished"),
    ("again again again again again", "loop", "loop"),
    ("  Hi there  ", "stop", "short"),
    ("What is  the capital of\nFrance?", "stop", "duplicate"),
    ("", "context", "context"),
])
def test_each_dropped_draw_has_one_reason(text: str, reason: str, why: str | None) -> None:
    kept = {turn_key("What is the capital of France?")}
    assert verdict(text, reason, SynthesizeConfig(count=1, min_chars=16), kept, turn_key(text)) == why


@pytest.mark.parametrize("second", [{"no": "id"}, {"id": 5},
                                    {"id": "self-0-00000001", "messages": [{"content": None}]}])
def test_a_damaged_line_is_an_error_naming_it(tmp_path: Path, second: dict[str, Any]) -> None:
    kept = tmp_path / KEPT_FILE
    kept.write_text(json.dumps({"id": "self-0-00000000", "messages": [{"role": "user", "content": "x"}]}) + "\n"
                    + json.dumps(second) + "\n")
    with pytest.raises(SynthesizeError, match=rf"{KEPT_FILE}:2: .*damaged"):
        read_draws(kept, tmp_path / DROPPED_FILE, 0, FIRST)


def test_draws_of_another_seed_are_an_error_not_counted(tmp_path: Path) -> None:
    dropped = tmp_path / DROPPED_FILE
    dropped.write_text(json.dumps({"id": "self-0-00000003", "reason": "short"}) + "\n")
    assert read_draws(tmp_path / KEPT_FILE, dropped, 0, FIRST).next_index == 4
    with pytest.raises(SynthesizeError, match=rf"{DROPPED_FILE}:1: draw self-0-00000003 is not of data.synthesize.s"):
        read_draws(tmp_path / KEPT_FILE, dropped, 7, FIRST)


class _BosTemplate:
    bos_token = "<s>"

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return "<s>" + "".join(f"[{m['role']}] {m['content']}<eot>\n" for m in messages)


def test_a_server_gets_the_prefix_without_the_templates_bos_and_stops_at_its_marker() -> None:
    tok = _BosTemplate()
    assert server_prompt(tok, query_prefix(tok)) == "[user] "
    assert server_prompt(tok, query_prefix(tok, system="Be brief.")) == "[system] Be brief.<eot>\n[user] "
    assert query_stop(tok) == "<eot>"


def test_the_config_says_what_to_fix() -> None:
    with pytest.raises(ConfigError, match=r"data.synthesize.count: Input should be greater than 0"):
        parse_config({"run_dir": "r", "target": {"name": "t"}, "data": {"sources": [{"kind": "lines", "path": "p"}],
                      "synthesize": {"count": 0}}, "eval": {"datasets": [{"name": "m", "kind": "mtbench"}]}})


def test_a_turn_start_ends_at_a_word() -> None:
    with pytest.raises(ConfigError, match=r"data.synthesize.turn_starts: .*turn_starts\[1\] 'Make it ': begins or "
                                          r"ends in whitespace; end it at a word"):
        parse_config({"run_dir": "r", "target": {"name": "t"}, "data": {"sources": [{"kind": "lines", "path": "p"}],
                      "synthesize": {"count": 1, "turn_starts": ["", "Make it "]}},
                      "eval": {"datasets": [{"name": "m", "kind": "mtbench"}]}})


def test_the_words_after_a_turn_start_keep_their_space() -> None:
    from target_model.hf_model import load_tokenizer, resolve_source

    tok = load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)
    ids = tok("<|im_start|>user\nMake it shorter, please.", add_special_tokens=False)["input_ids"]
    cut = len(tok("<|im_start|>user\nMake it", add_special_tokens=False)["input_ids"])
    assert continuation(tok, ids[cut - 1:cut], ids[cut:]) == " shorter, please."
    assert continuation(tok, [], ids[cut:]) == tok.decode(ids[cut:])


def test_a_resumed_run_with_other_turn_starts_is_an_error_naming_the_line(tmp_path: Path) -> None:
    follow_ups = FollowUps(write_conversations(tmp_path / "conversations.jsonl"), None)
    kept = tmp_path / KEPT_FILE
    kept.write_text(json.dumps(follow_ups.record("self-0-00000001", 1, "Now in JavaScript.")) + "\n")
    assert read_draws(kept, tmp_path / DROPPED_FILE, 0, follow_ups, ["Make it", "Now"]).done == {1}
    with pytest.raises(SynthesizeError, match=rf"{KEPT_FILE}:1: draw self-0-00000001 does not start with 'Make it', "
                                              r"data.synthesize.turn_starts\[1\]; move the files away"):
        read_draws(kept, tmp_path / DROPPED_FILE, 0, follow_ups, ["Now", "Make it"])


def test_a_server_stops_at_the_templates_end_of_turn() -> None:
    from target_model.hf_model import load_tokenizer, resolve_source

    assert query_stop(load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)) == "<|im_end|>"


def test_draws_a_dead_server_failed_are_not_written_and_the_step_fails(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, {"backend": "openai", "server_urls": [f"http://127.0.0.1:{free_port()}"],
                              "max_retries": 1})
    with pytest.raises(StepFailed, match=r"5 of 5 draws failed \({'connection_refused': 5}; first: connection_ref"):
        run_synthesize(cfg)
    assert (cfg.root / KEPT_FILE).read_text() == (cfg.root / DROPPED_FILE).read_text() == ""


def kept_prompts(cfg: RunConfig) -> dict[str, str]:
    lines = (cfg.root / KEPT_FILE).read_text().splitlines()
    return {r["id"]: r["messages"][0]["content"] for r in map(json.loads, lines)}


@pytest.mark.real
def test_the_real_target_writes_prompts_that_ingest_reads_and_a_kill_loses_none(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    summary = run_synthesize(cfg)
    prompts = kept_prompts(cfg)
    assert summary.kept == len(prompts) == 5
    assert summary.drawn == 5 + sum(summary.dropped.values())
    assert all(len(t) >= 16 and "<|im_" not in t for t in prompts.values()), prompts
    # the same config elsewhere, killed after two prompts were written and mid-way through a third line
    again = make_cfg(tmp_path / "again")
    again.root.mkdir(parents=True)
    lines = (cfg.root / KEPT_FILE).read_text().splitlines(keepends=True)
    (again.root / KEPT_FILE).write_text("".join(lines[:2]) + lines[2][:20])
    resumed = run_synthesize(again)
    assert resumed.kept_before == 2 and resumed.kept == 5
    after = (again.root / KEPT_FILE).read_text().splitlines(keepends=True)
    assert after[:2] == lines[:2]  # what was written stays; the torn line is cut and its draw made again
    assert len(after) == len(set(kept_prompts(again))) == 5  # each draw once
    # the draws in flight are made again from their own seeds: the same prompts, up to the rounding that another
    # batch brings (a prompt near max_new_tokens may end up unfinished and be replaced by a new draw)
    assert len(set(kept_prompts(again).values()) & set(prompts.values())) >= 4
    # ingest reads them as any OpenAI-messages source
    assert run_steps("ingest", tmp_path / "cfg.yaml") == 2  # no config file yet: a one-line error, not a crash
    (tmp_path / "cfg.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    assert run_steps("ingest", tmp_path / "cfg.yaml") == 0
    ingested = [json.loads(x) for x in cfg.prompts_path.read_text().splitlines()]
    assert sorted(r["messages"][0]["content"] for r in ingested) == sorted(prompts.values())


@pytest.mark.real
@pytest.mark.server
def test_a_real_llama_cpp_server_writes_the_same_prompts_from_the_same_seeds(tmp_path: Path) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama_cpp is not importable in this venv: pip install 'llama-cpp-python[server]'")
    server = LlamaServer(tmp_path / "server.log")
    try:
        server.wait_ready()
        regen = {"backend": "openai", "server_urls": [server.url], "timeout_s": 120, "max_retries": 1}
        first = make_cfg(tmp_path / "first", regen)
        summary = run_synthesize(first)
        prompts = kept_prompts(first)
        assert summary.kept == 5 and summary.generated_tokens > 0 and not summary.failed
        assert all(len(t) >= 16 and "<|im_" not in t for t in prompts.values()), prompts
        again = make_cfg(tmp_path / "again", regen)  # the draws' own seeds: the same prompts under the same keys
        run_synthesize(again)
        assert kept_prompts(again) == prompts
        # follow-ups: the conversation rendered by the target's template, continued as raw text by the server
        follow = make_cfg(tmp_path / "follow", regen, write_conversations(tmp_path / "conversations.jsonl"))
        assert run_synthesize(follow).kept == 2
        assert_follow_ups(follow)
        assert_turn_starts(make_cfg(tmp_path / "started", regen, write_conversations(tmp_path / "conversations.jsonl"),
                                    turn_starts=STARTS))
    finally:
        server.kill()


def test_a_follow_up_prefix_is_the_conversation_then_a_new_user_turn() -> None:
    from target_model.hf_model import load_tokenizer, resolve_source

    tok = load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)
    conversation = CONVERSATIONS[0]["messages"]
    prefix = follow_up_prefix(tok, None, conversation)
    assert prefix == tok.apply_chat_template(conversation, tokenize=False) + "<|im_start|>user\n"
    assert prefix.startswith(query_prefix(tok) + "What is the capital of France?<|im_end|>")


def test_a_line_that_is_not_a_conversation_to_follow_up_is_an_error_naming_it(tmp_path: Path) -> None:
    unanswered = {"id": "x", "messages": [{"role": "user", "content": "Hi"}]}
    path = write_conversations(tmp_path / "conversations.jsonl", [CONVERSATIONS[0], unanswered])
    with pytest.raises(SynthesizeError, match=r"conversations.jsonl:2: not a conversation to follow up"):
        FollowUps(path, None)
    with pytest.raises(SynthesizeError, match=r"follow_up: .*nowhere.jsonl is not a file"):
        FollowUps(tmp_path / "nowhere.jsonl", None)


def test_follow_ups_ask_no_more_than_the_conversations_and_keep_their_own_systems(tmp_path: Path) -> None:
    path = write_conversations(tmp_path / "conversations.jsonl", CONVERSATIONS[:1])
    with pytest.raises(SynthesizeError, match=r"count: 2 follow-ups asked of the 1 conv"):
        run_synthesize(make_cfg(tmp_path, follow_up=path))
    with pytest.raises(ConfigError, match=r"data.synthesize: .*systems: a follow-up continues its conversation as"):
        parse_config({"run_dir": "r", "target": {"name": "t"}, "data": {"sources": [{"kind": "lines", "path": "p"}],
                      "synthesize": {"count": 1, "follow_up": str(path), "systems": [CODING]}},
                      "eval": {"datasets": [{"name": "m", "kind": "mtbench"}]}})


@pytest.mark.real
def test_follow_ups_short_of_count_once_every_conversation_was_drawn_say_how_to_keep_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One draw per conversation: when drops leave fewer than count, no rerun can draw more, and the error says the
    count that keeps what was kept; with that count the rerun draws nothing and keeps them."""
    import data_prep.self_prompts

    keep_all = data_prep.self_prompts.verdict
    calls = []
    monkeypatch.setattr(data_prep.self_prompts, "verdict",  # the first draw is dropped as short
                        lambda *a: "short" if not calls.append(1) and len(calls) == 1 else keep_all(*a))
    cfg = make_cfg(tmp_path, follow_up=write_conversations(tmp_path / "conversations.jsonl", CONVERSATIONS[:2]))
    with pytest.raises(StepFailed, match=r"1 of 2 follow-ups: each of the 2 conversations of follow_up was drawn once "
                                         r"\(dropped: {'short': 1}\); set data.synthesize.count to 1 to keep these"):
        run_synthesize(cfg)
    synthesize = cfg.data.synthesize.model_copy(update={"count": 1})
    summary = run_synthesize(cfg.model_copy(update={"data": cfg.data.model_copy(update={"synthesize": synthesize})}))
    assert summary.kept == summary.kept_before == 1 and summary.drawn == 0


def test_a_resumed_follow_up_run_is_of_the_same_conversations(tmp_path: Path) -> None:
    follow_ups = FollowUps(write_conversations(tmp_path / "conversations.jsonl"), None)
    kept = tmp_path / KEPT_FILE
    kept.write_text(json.dumps(follow_ups.record("self-0-00000001", 1, "And in JavaScript?")) + "\n")
    draws = read_draws(kept, tmp_path / DROPPED_FILE, 0, follow_ups)
    assert draws.done == {1} and draws.kept == {f"{CONVERSATIONS[1]['id']}\nand in javascript?"}
    other = FollowUps(write_conversations(tmp_path / "other.jsonl", CONVERSATIONS[::-1]), None)
    with pytest.raises(SynthesizeError, match=rf"{KEPT_FILE}:1: draw self-0-00000001 follows 'openai-0+1', not "):
        read_draws(kept, tmp_path / DROPPED_FILE, 0, other)
    short = FollowUps(write_conversations(tmp_path / "short.jsonl", CONVERSATIONS[:1]), None)
    with pytest.raises(SynthesizeError, match=rf"{KEPT_FILE}:1: draw self-0-00000001 is past the 1 conversations of"):
        read_draws(kept, tmp_path / DROPPED_FILE, 0, short)


def test_a_prefix_that_leaves_no_room_in_the_context_is_dropped_not_sent() -> None:
    room, no_room = fitting(["a", "b", "c"], [100, 900, 924], 100, 1024)
    assert room == [0, 1, 2] and no_room == []
    room, no_room = fitting(["a", "b", "c"], [100, 925, 3000], 100, 1024)
    assert room == [0] and no_room == [("b", "", "context", 0, None), ("c", "", "context", 0, None)]
    assert fitting(["a"], [10**6], 100, None) == ([0], [])  # no context known: the server says


def assert_follow_ups(cfg: RunConfig) -> list[dict[str, Any]]:
    """Each kept record is the conversation it follows with one new user turn of the target's own words."""
    records = [json.loads(x) for x in (cfg.root / KEPT_FILE).read_text().splitlines()]
    by_id = {c["id"]: c for c in CONVERSATIONS}
    assert len(records) == cfg.data.synthesize.count
    for rec in records:
        *before, new = rec["messages"]
        assert before == by_id[rec["follows"]]["messages"] and new["role"] == "user"
        assert len(new["content"]) >= 16 and "<|im_" not in new["content"], new
    return records


@pytest.mark.real
def test_the_real_target_writes_follow_ups_that_ingest_reads_as_second_turns(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, follow_up=write_conversations(tmp_path / "conversations.jsonl"))
    summary = run_synthesize(cfg)
    assert summary.kept == 2 and summary.follow_up == cfg.data.synthesize.follow_up
    records = assert_follow_ups(cfg)
    (tmp_path / "cfg.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    assert run_steps("ingest", tmp_path / "cfg.yaml") == 0
    ingested = [json.loads(x) for x in cfg.prompts_path.read_text().splitlines()]
    assert sorted([m["content"] for m in r["messages"] if m["role"] == "user"] for r in ingested) == sorted(
        [m["content"] for m in r["messages"] if m["role"] == "user"] for r in records)


STARTS = ["Make it", "Now"]


def assert_turn_starts(cfg: RunConfig) -> None:
    """Two follow-ups kept, each turn its draw's start and the target's words after it (whichever the sampled words
    are: the space between is checked on fixed tokens by test_the_words_after_a_turn_start_keep_their_space)."""
    assert run_synthesize(cfg).kept == 2
    for rec in assert_follow_ups(cfg):
        start, turn = STARTS[int(rec["id"].rsplit("-", 1)[1]) % 2], rec["messages"][-1]["content"]
        assert turn.startswith(start) and len(turn) > len(start), turn


@pytest.mark.real
def test_the_real_target_goes_on_from_each_draws_turn_start(tmp_path: Path) -> None:
    assert_turn_starts(make_cfg(tmp_path, follow_up=write_conversations(tmp_path / "conversations.jsonl"),
                                turn_starts=STARTS))

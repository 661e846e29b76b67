"""bench/prompt_tokenize.py with the real SmolLM2 tokenizer on a few multi-turn conversations (one .gz): every
follow-up's shortcut ids equal the whole text's, the object records both timings, and a bad line is one error."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import prompt_tokenize  # noqa: E402

SMOL = "configs/smollm2-135m.yaml"


def chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Question {i}: what is {i} squared?"},
            {"role": "assistant", "content": f"{i} squared is {i * i}.\n\nAnything else?"},
            {"role": "user", "content": "  And cubed?\n"},
            {"role": "assistant", "content": f"```\n{i}**3 == {i ** 3}\n```"}]


def test_follow_ups_equal_whole_tokenization_and_are_recorded(bench_results, tmp_path) -> None:
    convs = tmp_path / "conversations.jsonl.gz"
    with gzip.open(convs, "wt") as f:
        f.write(json.dumps({"id": "q", "messages": [{"role": "user", "content": "no answer yet"}]}) + "\n")
        for i in range(12):
            f.write(json.dumps({"id": str(i), "messages": chat(i)}) + "\n")
    assert prompt_tokenize.main(["--config", SMOL, "--conversations", str(convs), "--limit", "10",
                                 "--repeats", "1"]) == 0
    obj = json.loads(bench_results.read_text())["prompt_tokenize"]
    assert obj["follow_ups"] == obj["equal_ids"] == obj["prompt_shortcuts"] == 10  # the one without an answer: out
    assert obj["whole_ms"] > 0 and obj["shortcut_ms"] > 0 and obj["prompt_shortcut_off"] is None
    # (speedup is rounded to 2 decimals: below 1, that alone is more than 1 % of it)
    assert obj["speedup"] == pytest.approx(obj["whole_ms"] / obj["shortcut_ms"], rel=0.01, abs=0.006)


def test_a_line_that_is_no_conversation_names_file_and_line(tmp_path) -> None:
    convs = tmp_path / "conversations.jsonl"
    convs.write_text(json.dumps({"id": "0", "messages": chat(0)}) + "\n{\"id\": 1}\n")
    with pytest.raises(SystemExit, match=rf"{convs}:2: not a conversation record"):
        prompt_tokenize.read_chats(convs, 10)

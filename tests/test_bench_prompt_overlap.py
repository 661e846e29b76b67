"""bench/prompt_overlap.py: an eval prompt reworded around a copied passage is found by its shared run of words,
per training file, while prompts that only share short phrases are not; a bad line or config is one line naming
it, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PASSAGE = "the quick brown fox jumps over the lazy dog while the farmer counts thirteen sheep in the field"


def chat(*turns: str) -> str:
    return json.dumps({"id": turns[0][:8], "messages": [{"role": r, "content": t} for t in turns
                                                        for r in ("user", "assistant")]}) + "\n"


def run(tmp_path: Path, *files: Path, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    evals = tmp_path / "eval.jsonl"
    evals.write_text(chat(f"Summarise this: {PASSAGE}.") + chat("Write a poem about the sea.") +
                     chat("Name a colour.", "Now name two more."))
    cfg = {"run_dir": str(tmp_path / "run"), "target": {"name": "smollm2-135m-instruct"},
           "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]},
           "eval": {"datasets": [{"name": "first", "kind": "openai", "path": str(evals)},
                                 {"name": "second", "kind": "openai", "path": str(evals), "turn": 2}]}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "bench/prompt_overlap.py", "--config", str(tmp_path / "cfg.yaml"),
                           "--ngram", "13", "4", "--conversations", *map(str, files), *extra], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, "BENCH_RESULTS": str(tmp_path / "r.json")})


def test_a_copied_passage_is_found_and_short_shared_phrases_only_at_short_runs(tmp_path: Path) -> None:
    copied, clean = tmp_path / "copied.jsonl", tmp_path / "clean.jsonl"
    copied.write_text(chat(f"Hi! Could you tell me: {PASSAGE.upper()}?") + chat("Write a poem about the moon."))
    clean.write_text(chat("What is the capital of France?"))

    done = run(tmp_path, copied, clean)

    assert done.returncode == 0, done.stderr
    fig = json.loads((tmp_path / "r.json").read_text())["prompt_overlap"]
    first13 = fig["ngram"]["13"]["first"]
    assert first13[str(copied)]["sharing"] == 1 and first13[str(copied)]["examples"][0]["index"] == 0
    assert first13[str(clean)]["sharing"] == 0 and first13[str(copied)]["prompts"] == 3
    first4 = fig["ngram"]["4"]["first"][str(copied)]
    assert [e["index"] for e in first4["examples"]] == [0, 1]  # "write a poem about" is shared at 4 words
    assert first4["examples"][1]["run"] == "write a poem about"
    assert fig["ngram"]["13"]["second"][str(copied)]["prompts"] == 1  # only one record has a second user turn
    assert fig["training_turns"] == {str(copied): 2, str(clean): 1}


def test_another_name_keeps_the_earlier_object(tmp_path: Path) -> None:
    first, later = tmp_path / "first.jsonl", tmp_path / "later.jsonl"
    first.write_text(chat(f"Please: {PASSAGE}"))
    later.write_text(chat("What is the capital of France?"))

    assert run(tmp_path, first).returncode == 0
    done = run(tmp_path, later, extra=("--name", "prompt_overlap_later"))

    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["prompt_overlap"]["ngram"]["13"]["first"][str(first)]["sharing"] == 1
    assert data["prompt_overlap_later"]["ngram"]["13"]["first"][str(later)]["sharing"] == 0


def test_a_line_that_is_not_a_conversation_names_its_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(chat("Hello there.") + '{"id": "x"}\n')
    done = run(tmp_path, bad)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: {bad}:2: not a conversation with messages"), line


def test_a_missing_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Exit 2 with one line, as every command errs: not a traceback and exit 1."""
    conversations = tmp_path / "c.jsonl"
    conversations.write_text(chat("Hello there."))
    done = subprocess.run([sys.executable, "bench/prompt_overlap.py", "--config", str(tmp_path / "none.yaml"),
                           "--conversations", str(conversations)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "BENCH_RESULTS": str(tmp_path / "r.json")})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: {tmp_path / 'none.yaml'}: no such config file"), line

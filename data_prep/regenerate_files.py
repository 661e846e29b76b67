"""The files regenerate reads: prompts.jsonl (ingest's output, checked line by line) and what of
conversations.jsonl (or a device's part file) is already written, so a rerun resumes where a kill left it."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from common.files import cut_torn_tail, iter_jsonl


class RegenerateError(ValueError):
    """Unusable input or output file; the message names it."""


def _json_type(value: Any) -> str:
    """What a value read from JSON is, in words for an error line."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def load_prompt_records(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` prompts of prompts.jsonl (written by ingest, so a bad line is an error)."""
    if not path.is_file():
        raise RegenerateError(f"{path}: no prompts file; run `python -m data_prep ingest` first")
    prompts: list[dict[str, Any]] = []
    seen: set[str] = set()
    for lineno, p in islice(iter_jsonl(path, RegenerateError, fix="rerun ingest"), limit):
        try:
            pid, messages = p["id"], p["messages"]
            roles = [m["role"] for m in messages] if isinstance(messages, list) else []
        except (KeyError, TypeError) as e:
            raise RegenerateError(f"{path}:{lineno}: not a prompt record ({type(e).__name__}: {e}); "
                                  "rerun ingest") from None
        # Ingest writes these types; another would fail far from this line (an id is a set key).
        if not isinstance(pid, str):
            raise RegenerateError(f"{path}:{lineno}: id must be a string, not {_json_type(pid)}; rerun ingest")
        if not isinstance(messages, list):
            raise RegenerateError(f"{path}:{lineno}: messages must be a list, not {_json_type(messages)}; "
                                  "rerun ingest")
        if pid in seen:
            raise RegenerateError(f"{path}:{lineno}: id {pid} appears twice; rerun ingest")
        if "user" not in roles:
            raise RegenerateError(f"{path}:{lineno}: prompt {pid} has no user turn; rerun ingest")
        if (unanswered := unanswered_role(roles)) is not None:
            raise RegenerateError(f"{path}:{lineno}: prompt {pid} has a {unanswered} turn after its last user "
                                  "turn or tool result, which no answer would follow; rerun ingest")
        seen.add(pid)
        prompts.append(p)
    if not prompts:
        raise RegenerateError(f"{path}: no prompts in it; rerun ingest with data.sources that hold some")
    return prompts


def unanswered_role(roles: list[str]) -> str | None:
    """The role of a turn after the last user turn or tool result other than the source's answers, else None:
    ``Conversation`` answers only after those, so such a turn would be left out of the conversation (ingest drops
    and counts it, ``data_prep.ingest.drop_unanswered``). ``roles`` holds a user turn."""
    last = max(i for i, r in enumerate(roles) if r in ("user", "tool"))
    return next((r for r in roles[last + 1:] if r != "assistant"), None)


def resume(path: Path) -> tuple[set[str], int]:
    """Ids already written, after cutting a torn last line off the file; returns (ids, bytes cut)."""
    if not path.exists():
        return set(), 0
    torn = cut_torn_tail(path)
    return {rec["id"] for rec in whole_records(path)}, torn


DAMAGED = "the file is damaged: move it away and rerun"


def whole_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a conversations file whose torn tail is cut: what is left are whole lines, so a bad one is
    damage, never an interrupted append."""
    for lineno, rec in iter_jsonl(path, RegenerateError, fix=DAMAGED):
        if not isinstance(rec.get("id"), str):
            raise RegenerateError(f"{path}:{lineno}: a whole line that is not a conversation record; {DAMAGED}")
        yield rec

"""Follow-up turns the target writes itself: the user's next message after the target's own answer.

A second user turn is conditioned on the first answer; a drafter that saw second turns only from a prompt corpus
(a person's follow-up to another model's answer) sees few that follow its target's own words. Given a conversation
regenerate wrote (``data.synthesize.follow_up``), the target continues it from the start of a new user turn
(data_prep/user_turn.py) and writes that turn; regenerate then answers the conversation with it, every turn by the
target. Draw ``i`` continues conversation ``i`` of the file, so the draws there can be are its conversations.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common.files import iter_jsonl
from data_prep.decontaminate import turn_key
from data_prep.user_turn import SynthesizeError, follow_up_prefix

ROLES = ("system", "user", "assistant")


def _conversation(rec: dict[str, Any]) -> tuple[str, list[dict[str, str]]] | None:
    """(its id, its turns) when ``rec`` is a conversation that ends in an answer, else None."""
    cid, messages = rec.get("id"), rec.get("messages")
    if not isinstance(cid, str) or not isinstance(messages, list) or not messages:
        return None
    if not all(isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages):
        return None
    if messages[-1]["role"] != "assistant" or not any(m["role"] == "user" for m in messages):
        return None
    return cid, [{"role": m["role"], "content": m["content"]} for m in messages]


class FollowUps:
    """The conversations of ``path`` (regenerate's conversations.jsonl), draw ``i`` continuing the ``i``-th. A line
    that is not a conversation of system, user and assistant text turns ending in an answer is an error naming it."""

    def __init__(self, path: str | Path, template_kwargs: dict[str, Any] | None):
        self.path, self.template_kwargs = Path(path), template_kwargs
        if not self.path.is_file():
            raise SynthesizeError(f"data.synthesize.follow_up: {self.path} is not a file; name a conversations.jsonl "
                                  "regenerate wrote")
        self.ids: list[str] = []
        self.conversations: list[list[dict[str, str]]] = []
        for lineno, rec in iter_jsonl(self.path, SynthesizeError, fix="name a conversations.jsonl regenerate wrote"):
            if (conv := _conversation(rec)) is None:
                raise SynthesizeError(f"{self.path}:{lineno}: not a conversation to follow up (an id, and messages of "
                                      f"{'/'.join(ROLES)} text turns ending in an answer)")
            self.ids.append(conv[0])
            self.conversations.append(conv[1])
        self.limit = len(self.ids)

    def prefix(self, tokenizer: Any, index: int) -> str:
        return follow_up_prefix(tokenizer, self.template_kwargs, self.conversations[index])

    def follows(self, index: int) -> str:
        return self.ids[index]

    def record(self, key: str, index: int, text: str) -> dict[str, Any]:
        """The kept line: the conversation with the new user turn, for ingest (kind openai) and regenerate."""
        return {"id": key, "source": "self", "follows": self.ids[index],
                "messages": [*self.conversations[index], {"role": "user", "content": text}]}

    def kept_key(self, index: int, text: str) -> str:
        """Different conversations may well be followed by the same words and each is followed once, so a follow-up
        is a duplicate only of the same words after the same conversation."""
        return f"{self.ids[index]}\n{turn_key(text)}"

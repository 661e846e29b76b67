"""One prompt's regeneration, turn by turn: which chat the target answers next and what it has answered."""

from __future__ import annotations

from typing import Any

from data_prep.backends import CONTEXT_FULL, Chat, Completion


class Conversation:
    """One prompt being regenerated: the target answers after each user turn and after each run of tool results.

    The source's assistant turns are dropped; its tool results stay, since no tool is run here. A run of tool
    results answers the source's tool calls, so it is fed only when the target's own previous answer made the
    same calls (function names in order); they are then attached to the target's call ids. When the target
    chose otherwise (other calls, or calls where the source made none), the conversation ends after its answer
    (``diverged``): a result for a call never made would teach the drafter a conversation that cannot happen."""

    def __init__(self, prompt: dict[str, Any]):
        self.prompt = prompt
        self.tools = prompt.get("tools")
        self.segments: list[Chat] = []  # the non-assistant turns before each answer
        self.answers_calls: list[list[dict[str, Any]] | None] = []  # per segment: the source calls it answers
        pending: Chat = []
        calls = None
        msgs = prompt["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                calls = m.get("tool_calls")
                continue
            pending.append(dict(m))
            after = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
            if m["role"] == "user" or (m["role"] == "tool" and after != "tool"):
                self.segments.append(pending)
                self.answers_calls.append(calls if m["role"] == "tool" else None)
                pending = []
        self.chat: Chat = []
        self.finish_reasons: list[str] = []
        self.error: str | None = None
        self.detail = ""
        self.diverged = False
        self.turns_dropped = 0  # prompt turns (a user turn, or a run of tool results) left out: context full
        self.answer_tokens = 0  # tokens of its answers, as the backend counted them
        self.loop_cuts: list[tuple[int, int]] = []  # per answer cut at a loop: (tokens generated, tokens kept)

    def wants_more(self) -> bool:
        return self.error is None and not self.diverged and len(self.finish_reasons) < len(self.segments)

    def request(self) -> Chat:
        n = len(self.finish_reasons)
        segment = self.segments[n]
        if self.answers_calls[n] is not None:
            segment = self._attach(segment, self.answers_calls[n])
        self.chat += segment
        return list(self.chat)

    def _attach(self, results: Chat, source_calls: list[dict[str, Any]]) -> Chat:
        """Tool results re-addressed to the target's own calls (by position among the source's calls)."""
        own = self.chat[-1].get("tool_calls") or [] if self.chat and self.chat[-1]["role"] == "assistant" else []
        position = {c.get("id"): i for i, c in enumerate(source_calls)}
        out = []
        for j, r in enumerate(results):
            i = position.get(r.get("tool_call_id"), j)
            out.append(r | ({"tool_call_id": own[i]["id"]} if i < len(own) and "id" in own[i] else {}))
        return out

    def _can_continue(self, n: int) -> bool:
        """Whether segment n can follow the target's last answer: its tool results answer exactly the calls the
        target made (same function names in order, one result each), or it has no tool results and the target
        made no call. SGLang refuses a chat with an unanswered call (``_tool_call_pairing_error`` in sglang
        srt/entrypoints/openai/serving_chat.py), and a result for a call never made would be fiction."""
        own = [c["function"]["name"] for c in self.chat[-1].get("tool_calls") or ()]
        source = self.answers_calls[n]
        if source is None:
            return not own
        results = [m for m in self.segments[n] if m["role"] == "tool"]
        return own == [c["function"]["name"] for c in source] and len(results) == len(own)

    def accept(self, c: Completion) -> None:
        if c.error:
            self.error, self.detail = c.error, c.detail
            return
        if c.finish_reason == CONTEXT_FULL:  # the target's context is full: the conversation ends here
            done = len(self.finish_reasons)
            if done == 0:
                self.error, self.detail = "prompt_exceeds_context", "the first user turn alone fills the context"
                return
            self.chat = self.chat[: len(self.chat) - len(self.segments[done])]
            self.turns_dropped = len(self.segments) - done
            self.segments = self.segments[:done]
            self.answers_calls = self.answers_calls[:done]
            return
        self.chat.append(c.message())
        self.finish_reasons.append(c.finish_reason)
        self.answer_tokens += c.tokens or 0
        if c.loop_tokens:
            self.loop_cuts.append(c.loop_tokens)
        n = len(self.finish_reasons)
        if n < len(self.segments) and not self._can_continue(n):
            self.diverged = True

    def record(self, backend: str) -> dict[str, Any]:
        return ({"id": self.prompt["id"], "source": self.prompt["source"], "messages": self.chat,
                 "finish_reasons": self.finish_reasons, "backend": backend}
                | ({"tools": self.tools} if self.tools else {}))

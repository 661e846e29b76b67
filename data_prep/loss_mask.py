"""Token ids and the loss mask of one conversation, derived from the target's own chat template.

No per-model regexes: each assistant turn's span is what rendering ``messages[:i+1]`` adds to rendering
``messages[:i]`` with the generation prompt, i.e. exactly the text the target produces for that turn.
Trailing whitespace of that span (ChatML's newline after ``<|im_end|>``) is template glue, not output,
so it is left out; the end-of-turn marker is kept (the drafter must learn to predict it).
Character spans map to tokens through the prefix tokenization when it is a token prefix of the whole
(the usual case), else through the offsets mapping.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any


class LossMaskError(ValueError):
    """The template cannot be split into turns (e.g. it rewrites earlier turns); ``reason`` is a short key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    prefix_fallbacks: int  # turn boundaries that needed the offsets mapping

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def as_server_renders(messages: list[dict]) -> list[dict]:
    """The messages as SGLang's chat endpoint hands them to the chat template: an assistant's tool-call
    ``function.arguments`` parsed from its JSON string into an object, a null content as "" (sglang
    srt/entrypoints/openai/serving_chat.py, ``normalize_assistant_tool_call_arguments``). Rendering our
    stored turns this way gives the tokens the server rendered when it produced them."""
    out = copy.deepcopy(messages)
    for m in out:
        if m.get("content") is None:
            m["content"] = ""
        for call in m.get("tool_calls") or () if m.get("role") == "assistant" else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    parsed = json.loads(fn["arguments"])
                except ValueError:
                    continue  # not JSON: the template gets the string, as a lenient server would pass it
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
    return out


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool, kwargs: dict) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                         **kwargs)


def _ids(tokenizer: Any, text: str) -> list[int]:
    # The template already wrote BOS and every special marker; the tokenizer must not add more.
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _boundary(tokenizer: Any, text: str, char_pos: int, full_ids: list[int], offsets: list[tuple[int, int]],
              side: str) -> tuple[int, bool]:
    """Token index of a character boundary; True when the offsets fallback was needed."""
    head = _ids(tokenizer, text[:char_pos])
    if full_ids[: len(head)] == head:
        return len(head), False
    if side == "start":  # first token ending after the boundary
        return next((i for i, (_, e) in enumerate(offsets) if e > char_pos), len(offsets)), True
    return next((i for i, (s, _) in enumerate(offsets) if s >= char_pos), len(offsets)), True


def render_with_mask(tokenizer: Any, messages: list[dict], max_length: int,
                     template_kwargs: dict | None = None) -> Rendered:
    """Render ``messages`` with the tokenizer's chat template; mask = each assistant turn (its reasoning, content
    and tool calls, as the template renders them) + end-of-turn. ``template_kwargs``: the target's
    chat_template_kwargs and the chat's ``tools``."""
    kwargs = template_kwargs or {}
    messages = as_server_renders(messages)
    text = _render(tokenizer, messages, False, kwargs)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [0] * len(ids)
    fallbacks = 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or i == 0:  # an opening assistant turn answers nothing: not trained on
            continue
        before = _render(tokenizer, messages[:i], True, kwargs)
        through = _render(tokenizer, messages[: i + 1], False, kwargs)
        if not (through.startswith(before) and text.startswith(through)):
            raise LossMaskError("template_not_prefix_stable",
                                f"rendering turn {i} changes the text of earlier turns; cannot locate it")
        end_char = len(before) + len(through[len(before):].rstrip())
        start, f1 = _boundary(tokenizer, text, len(before), ids, offsets, "start")
        end, f2 = _boundary(tokenizer, text, end_char, ids, offsets, "end")
        fallbacks += f1 + f2
        for t in range(start, end):
            mask[t] = 1
    return Rendered(ids[:max_length], mask[:max_length], fallbacks)

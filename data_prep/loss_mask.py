"""Token ids and the loss mask of one conversation, derived from the target's own chat template.

No per-model regexes: each assistant turn's span is what rendering ``messages[:i+1]`` adds to rendering
``messages[:i]`` with the generation prompt, i.e. exactly the text the target produces for that turn.
Trailing whitespace of that span (ChatML's newline after ``<|im_end|>``) is template glue, not output,
so it is left out; the end-of-turn marker is kept (the drafter must learn to predict it) when the target
ended the turn itself: finish reason ``stop`` or ``tool_calls``, or no finish reasons recorded (source data
never regenerated). An answer regenerate cut (``length``, ``loop``) never produced that marker: its span ends
where its text does, and the marker stays in the ids as context only (else the drafter learns "after a loop's
first copy the answer ends"). A cut answer whose text end cannot be found keeps its whole span and is counted;
a chat whose reasons do not match its answers is refused (``finish_reasons_mismatch``). An answer whose first
``given_chars`` characters of content the target was given rather than wrote (data_prep/symbol_runs.py) has its span
start after them: they stay in the ids as context only.
Character spans map to tokens through the whole text's offsets (one tokenization per conversation: a
prefix tokenization per turn made long chats quadratic); a token straddling a boundary is counted.
``max_answer_tokens`` (``train.max_answer_tokens``) keeps the loss on each turn's first N tokens only: the
rest of a long answer (often a loop's copies) stays in the sample as context. What the two caps take is counted
where they apply (``Cuts``), so the stages that render can report it.
"""

from __future__ import annotations

import bisect
import copy
import json
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from typing import Any

ENDED = frozenset({"stop", "tool_calls"})  # finish reasons of an answer that ended in its end-of-turn marker
# Put into an answer's text to find where the template puts that point of it (a cut answer's end, the end of what
# it was given); no real answer holds it.
MARK = "\u2063[answer-text-mark]\u2063"


class LossMaskError(ValueError):
    """A chat that cannot be masked: the template cannot be split into turns (e.g. it rewrites earlier turns), or
    its finish reasons do not match its answers; ``reason`` is a short key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Cuts:
    """What the two caps took from rendered samples, summed with ``+``: ``capture.max_length`` cut the tail of
    ``truncated_samples`` (``truncated_tokens`` tokens, ``truncated_loss_tokens`` of them under the capped mask),
    and ``train.max_answer_tokens`` took ``capped_loss_tokens`` answer tokens out of the loss (anywhere in the
    rendering; they stay as context where they are kept). So a sample's loss tokens plus the last two are what
    it would carry under neither cap."""

    truncated_samples: int = 0
    truncated_tokens: int = 0
    truncated_loss_tokens: int = 0
    capped_loss_tokens: int = 0

    def __add__(self, other: Cuts) -> Cuts:
        return Cuts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __str__(self) -> str:
        return (f"samples cut at capture.max_length: {self.truncated_samples} ({self.truncated_tokens} tokens, "
                f"{self.truncated_loss_tokens} loss tokens); tokens out of the loss by train.max_answer_tokens: "
                f"{self.capped_loss_tokens}")


@dataclass
class Rendered:
    input_ids: list[int]
    loss_mask: list[int]
    prefix_fallbacks: int  # turn boundaries that needed the offsets mapping
    unlocated_ends: int = 0  # cut answers whose text end was not found: loss on their whole span, marker too
    cuts: Cuts = field(default_factory=Cuts)  # what max_length and max_answer_tokens took from this chat

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


def prompt_text(tokenizer: Any, messages: list[dict], template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> str:
    """A chat rendered for the target's next answer exactly as capture renders the text before each answer:
    as the server renders it, with the target's chat_template_kwargs and the chat's tools."""
    kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
    return _render(tokenizer, as_server_renders(messages), True, kwargs)


def conversation_text(tokenizer: Any, messages: list[dict], template_kwargs: dict | None = None,
                      tools: list[dict] | None = None) -> str:
    """A whole chat rendered as the server renders it (no generation prompt): the text capture tokenizes."""
    kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools is not None else {})}
    return _render(tokenizer, as_server_renders(messages), False, kwargs)


def _boundary(offsets: list[tuple[int, int]], starts: list[int], char_pos: int, side: str) -> tuple[int, bool]:
    """Token index of a character boundary, from the whole text's offsets; True when a token straddles
    the boundary (the prefix does not tokenize as a prefix of the whole), where the span is widened to
    whole tokens: "start" takes the first token ending after the boundary, "end" the first starting at
    or after it."""
    i = bisect.bisect_left(starts, char_pos)  # first token starting at or after the boundary
    if i == 0 or offsets[i - 1][1] <= char_pos:
        return i, False
    if side == "start":  # token i-1 straddles: it ends after the boundary
        return i - 1, True
    return i, True


def _turn_ends(messages: list[dict], finish_reasons: Sequence[str] | None) -> list[bool]:
    """Per trained assistant turn (after the first message), whether the target ended it itself. Regenerate
    records one reason per answer it wrote, and it never writes an opening assistant turn (not trained on);
    without reasons (data never regenerated) every turn counts as ended."""
    turns = sum(m["role"] == "assistant" for m in messages[1:])
    if finish_reasons is None:
        return [True] * turns
    if len(finish_reasons) != turns:
        raise LossMaskError("finish_reasons_mismatch",
                            f"{len(finish_reasons)} finish reasons for {turns} assistant turns after the first message")
    return [r in ENDED for r in finish_reasons]


def _marked_at(tokenizer: Any, messages: list[dict], i: int, part: str, marked_text: str, through: str,
               kwargs: dict) -> int | None:
    """Where ``MARK`` lands in ``through`` (the chat rendered through answer i) when answer i's ``part`` is
    ``marked_text`` (its text with ``MARK`` put in once); None when that rendering is not ``through`` with the
    marker inserted once (the template changes the text)."""
    marked = _render(tokenizer, [*messages[:i], {**messages[i], part: marked_text}], False, kwargs)
    p = marked.find(MARK)
    return p if p >= 0 and marked[:p] + marked[p + len(MARK):] == through else None


def _text_end(tokenizer: Any, messages: list[dict], i: int, through: str, kwargs: dict) -> int | None:
    """Where answer i's generated text ends in ``through``: the end of its content, or of its reasoning when it has
    no content (where regenerate cuts a loop); the marker goes after that text (or after it right-stripped, for
    templates that trim). None when it cannot be found or the answer made tool calls (its text is not the end of
    what it generated)."""
    msg = messages[i]
    part = "content" if msg.get("content") else "reasoning_content"
    text = msg.get(part) or ""
    if not text or msg.get("tool_calls"):
        return None
    for candidate in dict.fromkeys((text, text.rstrip())):
        if (p := _marked_at(tokenizer, messages, i, part, candidate + MARK, through, kwargs)) is not None:
            return p
    return None


def _given_end(tokenizer: Any, messages: list[dict], i: int, through: str, kwargs: dict) -> int:
    """Where the ``given_chars`` characters of answer i's content that the target was given end in ``through``;
    a count that is not one of its content's positions, or a point the template moves, is an error."""
    msg = messages[i]
    given, content = msg["given_chars"], msg.get("content")
    if isinstance(given, bool) or not isinstance(given, int) or not isinstance(content, str) \
            or not 0 <= given <= len(content) or msg.get("tool_calls"):
        raise LossMaskError("given_chars_invalid", f"turn {i}: given_chars {given!r} is not a position in the "
                            "answer's content (an int from 0 to its length, on an answer without tool calls)")
    p = _marked_at(tokenizer, messages, i, "content", content[:given] + MARK + content[given:], through, kwargs)
    if p is None:
        raise LossMaskError("given_chars_unlocated", f"turn {i}: the template changes the answer's text, so where "
                            "its given_chars end cannot be found")
    return p


def assistant_spans(tokenizer: Any, messages: list[dict], template_kwargs: dict | None = None,
                    finish_reasons: Sequence[str] | None = None) -> tuple[str, list[tuple[int, int]], int]:
    """The rendered chat, the character span of each assistant turn after the first message (its reasoning,
    content and tool calls, as the template renders them, and the end-of-turn marker when the target ended the
    turn (``finish_reasons``, one per such turn); trailing template whitespace left out), and how many cut
    answers' text ends were not found (their span kept whole). The messages are rendered as the server renders
    them (``as_server_renders``); ``template_kwargs``: the target's chat_template_kwargs and the chat's ``tools``."""
    kwargs = template_kwargs or {}
    messages = as_server_renders(messages)
    ended = iter(_turn_ends(messages, finish_reasons))
    text = _render(tokenizer, messages, False, kwargs)
    spans, unlocated = [], 0
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant" or i == 0:  # an opening assistant turn answers nothing: not trained on
            continue
        before = _render(tokenizer, messages[:i], True, kwargs)
        through = _render(tokenizer, messages[: i + 1], False, kwargs)
        if not (through.startswith(before) and text.startswith(through)):
            raise LossMaskError("template_not_prefix_stable",
                                f"rendering turn {i} changes the text of earlier turns; cannot locate it")
        start = len(before) if msg.get("given_chars") is None else _given_end(tokenizer, messages, i, through, kwargs)
        end = len(before) + len(through[len(before):].rstrip())
        if not next(ended):
            text_end = _text_end(tokenizer, messages, i, through, kwargs)
            unlocated += text_end is None
            end = end if text_end is None else min(end, max(text_end, start))
        spans.append((start, max(start, end)))
    return text, spans, unlocated


def mask_tokens(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]],
                max_length: int, max_answer_tokens: int | None = None, unlocated_ends: int = 0) -> Rendered:
    """Ids and mask (cut at ``max_length``) with 1 on the tokens of each assistant span, only its first
    ``max_answer_tokens`` when given; ``cuts`` counts what each cap took."""
    starts = [a for a, _ in offsets]
    mask, uncapped = [0] * len(ids), [0] * len(ids)
    fallbacks = 0
    for a, b in spans:
        start, f1 = _boundary(offsets, starts, a, "start")
        end, f2 = _boundary(offsets, starts, b, "end")
        fallbacks += f1 + f2
        uncapped[start:end] = [1] * (end - start)
        if max_answer_tokens is not None:
            end = min(end, start + max_answer_tokens)
        mask[start:end] = [1] * (end - start)
    cut = max(0, len(ids) - max_length)
    cuts = Cuts(int(cut > 0), cut, sum(mask[max_length:]), sum(uncapped) - sum(mask))
    return Rendered(ids[:max_length], mask[:max_length], fallbacks, unlocated_ends, cuts)


def render_with_mask(tokenizer: Any, messages: list[dict], max_length: int,
                     template_kwargs: dict | None = None, max_answer_tokens: int | None = None,
                     finish_reasons: Sequence[str] | None = None) -> Rendered:
    """Render ``messages`` with the tokenizer's chat template; mask = each assistant turn (its reasoning, content
    and tool calls, as the template renders them) + end-of-turn when ``finish_reasons`` (the record's, one per
    answer) say the target ended it, its first ``max_answer_tokens`` when given.
    ``template_kwargs``: the target's chat_template_kwargs and the chat's ``tools``."""
    r = render_many(tokenizer, [messages], max_length, template_kwargs, max_answer_tokens=max_answer_tokens,
                    finish_reasons=[finish_reasons])[0]
    if isinstance(r, LossMaskError):
        raise r
    return r


def render_many(tokenizer: Any, conversations: list[list[dict]], max_length: int,
                template_kwargs: dict | None = None, tools: Sequence[list[dict] | None] | None = None,
                chunk: int = 512, max_answer_tokens: int | None = None,
                finish_reasons: Sequence[Sequence[str] | None] | None = None) -> list[Rendered | LossMaskError]:
    """``render_with_mask`` for many chats: the texts are tokenized in batches, which a fast tokenizer spreads
    over every core. A chat that cannot be split into turns comes back as its ``LossMaskError``.
    ``tools[i]`` / ``finish_reasons[i]`` (when given): the tools offered to chat i, rendered into its prompt by
    the template, and the finish reasons of its answers."""
    for name, per_chat in (("tool lists", tools), ("finish reason lists", finish_reasons)):
        if per_chat is not None and len(per_chat) != len(conversations):
            raise ValueError(f"{len(per_chat)} {name} for {len(conversations)} conversations")
    out: list[Rendered | LossMaskError] = []
    for c in range(0, len(conversations), chunk):
        rendered: list[tuple[str, list[tuple[int, int]], int] | LossMaskError] = []
        for j, messages in enumerate(conversations[c:c + chunk], start=c):
            kwargs = {**(template_kwargs or {}), **({"tools": tools[j]} if tools is not None else {})}
            try:
                rendered.append(assistant_spans(tokenizer, messages, kwargs,
                                                finish_reasons[j] if finish_reasons is not None else None))
            except LossMaskError as e:
                rendered.append(e)
        texts = [r[0] for r in rendered if not isinstance(r, LossMaskError)]
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
        k = 0
        for r in rendered:
            if isinstance(r, LossMaskError):
                out.append(r)
                continue
            out.append(mask_tokens(enc["input_ids"][k], enc["offset_mapping"][k], r[1], max_length,
                                   max_answer_tokens, r[2]))
            k += 1
    return out

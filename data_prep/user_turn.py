"""Where a user's words go in the target's chat template: the text a model continues to write a user turn itself.

Synthesize (data_prep/self_prompts.py) renders a chat up to the start of a user turn and lets the target go on;
what it writes before the template's end of turn is a user's message in the style its instruction tuning taught
it. The chat may be empty (a first turn, under a system turn or the template's own) or a whole conversation (a
follow-up turn after the target's own answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SENTINEL = "\u2063SELF-PROMPT\u2063"  # text no template writes: where the user's words would go


class SynthesizeError(ValueError):
    pass


def around_users_words(tokenizer: Any, template_kwargs: dict[str, Any] | None,
                       before: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """The chat template's rendering of ``before`` and one more user turn, split where that turn's words go: (the
    text before them, the text after)."""
    text = tokenizer.apply_chat_template([*before, {"role": "user", "content": SENTINEL}], tokenize=False,
                                         add_generation_prompt=False, **(template_kwargs or {}))
    if text.count(SENTINEL) != 1:
        raise SynthesizeError("target chat template: a user turn's text does not appear once in its rendering; "
                              "synthesize needs a template that writes the user's words as given")
    before_words, after = text.split(SENTINEL)
    return before_words, after


def query_prefix(tokenizer: Any, template_kwargs: dict[str, Any] | None = None, system: str | None = None) -> str:
    """The chat template's text before a first user turn's words, under ``system`` (None: the template's own system
    turn, as it serves)."""
    chat = [{"role": "system", "content": system}] if system is not None else []
    return around_users_words(tokenizer, template_kwargs, chat)[0]


def follow_up_prefix(tokenizer: Any, template_kwargs: dict[str, Any] | None,
                     conversation: Sequence[dict[str, Any]]) -> str:
    """The chat template's text before the words of the user turn that follows ``conversation`` (its own system
    turn, if any, included as it was answered)."""
    return around_users_words(tokenizer, template_kwargs, conversation)[0]


def query_stop(tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> str:
    """The text the template writes right after a user's words (its end-of-turn marker): where a server that
    continues the prefix as raw text is to stop."""
    after = around_users_words(tokenizer, template_kwargs, [])[1]
    stop = next(iter(after.split()), "")  # the marker itself, without what may follow it
    if not stop:
        raise SynthesizeError("target chat template: nothing follows a user turn's text, so a server cannot be told "
                              "where the turn ends; use regenerate.backend hf")
    return stop


def server_prompt(tokenizer: Any, prefix: str) -> str:
    """The prefix as a server's text completion takes it: without the BOS text a template writes itself (Llama 3,
    Mistral, Gemma), since the server adds its special tokens when it tokenizes the prompt."""
    bos = getattr(tokenizer, "bos_token", None)
    return prefix.removeprefix(bos) if bos else prefix

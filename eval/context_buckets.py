"""tau by the length of the history, from the run's held-out conversations (pure, but for the tokenizer).

Users' traffic is multi-turn with long histories, while the eval sets are first turns. The run's own regenerated
conversations (run_dir/conversations.jsonl: the target's own answers) that training held out
(``data_prep.dataset.in_holdout`` at train.holdout_fraction: never trained on) give every assistant turn as a
prompt: the conversation before it, rendered as the server renders it, bucketed by its length in tokens. Turns of
one conversation are not independent, so a bucket's interval resamples conversations, not turns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from data_prep.dataset import in_holdout
from data_prep.loss_mask import prompt_text

BUCKETS = (("<1k", 0, 1024), ("1-2k", 1024, 2048), ("2-4k", 2048, 4096))  # (name, from, to) tokens of history


@dataclass(frozen=True)
class TurnPrompt:
    conversation: str  # its id: the unit a bucket's interval resamples
    ids: list[int]  # the history before one assistant turn, ready for that answer


def holdout_turns(conversations: Iterable[Mapping[str, Any]], fraction: float, tokenizer: Any,
                  template_kwargs: dict[str, Any] | None = None) -> tuple[list[TurnPrompt], int]:
    """Every assistant turn of the held-out conversations as a prompt, and how many conversations were held out."""
    out, held = [], 0
    for rec in conversations:
        if not in_holdout(rec["id"], fraction):
            continue
        held += 1
        msgs = rec["messages"]
        for j, m in enumerate(msgs):
            if m["role"] == "assistant" and j:
                text = prompt_text(tokenizer, msgs[:j], template_kwargs, rec.get("tools") or None)
                out.append(TurnPrompt(rec["id"], tokenizer(text, add_special_tokens=False).input_ids))
    return out, held


def bucketed(prompts: Sequence[TurnPrompt], per_bucket: int | None = None) -> tuple[dict[str, list[TurnPrompt]], dict]:
    """Bucket name -> its prompts (the first ``per_bucket`` in order), and the counts left out: ``beyond`` the last
    bucket, ``capped`` over ``per_bucket``."""
    out: dict[str, list[TurnPrompt]] = {name: [] for name, _, _ in BUCKETS}
    left = {"beyond": 0, "capped": 0}
    for p in prompts:
        name = next((b for b, lo, hi in BUCKETS if lo <= len(p.ids) < hi), None)
        if name is None:
            left["beyond"] += 1
        elif per_bucket is not None and len(out[name]) >= per_bucket:
            left["capped"] += 1
        else:
            out[name].append(p)
    return out, left


def by_conversation(prompts: Sequence[TurnPrompt], tokens: Sequence[int], cycles: Sequence[int]
                    ) -> tuple[list[int], list[int]]:
    """Per-prompt (tokens, cycles) summed per conversation, in first-seen order: the columns a bucket's interval
    resamples."""
    sums: dict[str, list[int]] = {}
    for p, t, c in zip(prompts, tokens, cycles, strict=True):
        s = sums.setdefault(p.conversation, [0, 0])
        s[0] += t
        s[1] += c
    return [s[0] for s in sums.values()], [s[1] for s in sums.values()]

"""tau by the length of the history, from the run's held-out conversations (pure, but for the tokenizer).

Users' traffic is multi-turn with long histories, while the eval sets are first turns. The run's own regenerated
conversations (run_dir/conversations.jsonl: the target's own answers) that training held out
(``data_prep.dataset.in_holdout`` at train.holdout_fraction: never trained on) give every assistant turn as a
prompt: the conversation before it, rendered as the server renders it, bucketed by its length in tokens. Turns of
one conversation are not independent, so a bucket's interval resamples conversations, not turns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from data_prep.capture import read_conversations
from data_prep.dataset import in_holdout
from data_prep.loss_mask import prompt_text
from eval.intervals import Bootstrap, ratio_estimate

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


@dataclass(frozen=True)
class HeldOutBuckets:
    """The held-out turns of a run, bucketed, ready to measure; or why there are none (``skipped``)."""

    source: str
    holdout_fraction: float
    per_bucket: int | None
    holdout_conversations: int = 0
    prompts: dict[str, list[TurnPrompt]] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=lambda: {"beyond": 0, "capped": 0})
    skipped: str | None = None

    def ids(self) -> dict[str, list[list[int]]]:
        """Bucket -> its prompts' ids, the empty buckets left out: what a drafter is measured on."""
        return {name: [p.ids for p in ps] for name, ps in self.prompts.items() if ps}

    def figures(self, measured: Mapping[str, tuple[Sequence[int], Sequence[int]]], boot: Bootstrap) -> dict:
        """Per bucket, from its (tokens, cycles) per prompt in ``ids`` order: tau with its interval (resampling
        conversations), prompts, conversations and the history lengths; an unmeasured bucket's tau is NaN."""
        out = {}
        for name, ps in self.prompts.items():
            per_conv = by_conversation(ps, *measured[name]) if name in measured else ([], [])
            iv = ratio_estimate(*per_conv, boot).interval(boot.level)
            out[name] = {"tau": iv.point, "ci": [iv.low, iv.high], "prompts": len(ps),
                         "conversations": len(per_conv[0]),
                         "history_tokens": [min(len(p.ids) for p in ps), max(len(p.ids) for p in ps)] if ps else None}
        return out

    def header(self) -> dict:
        """Where the buckets came from and what they left out (or the reason there are none)."""
        if self.skipped:
            return {"skipped": self.skipped}
        return {"source": self.source, "holdout_fraction": self.holdout_fraction,
                "holdout_conversations": self.holdout_conversations, "beyond_last_bucket": self.left["beyond"],
                "over_per_bucket": self.left["capped"], "per_bucket": self.per_bucket}


def holdout_buckets(path: Path, fraction: float, per_bucket: int | None, load_tokenizer: Any,
                    template_kwargs: dict[str, Any] | None = None) -> HeldOutBuckets:
    """The run's held-out turns (``path``: its conversations.jsonl) bucketed, at most ``per_bucket`` each (0: none
    asked for). ``load_tokenizer()`` is called only when there is something to render."""
    held = HeldOutBuckets(str(path), fraction, per_bucket)
    if per_bucket == 0:
        return replace(held, skipped="not asked for (0 prompts per bucket)")
    if not path.is_file():
        return replace(held, skipped=f"{path}: not found; the buckets come from the run's held-out conversations "
                                     "(run `python -m data_prep regenerate` first)")
    turns, n = holdout_turns(read_conversations(path), fraction, load_tokenizer(), template_kwargs)
    prompts, left = bucketed(turns, per_bucket)
    return HeldOutBuckets(str(path), fraction, per_bucket, n, prompts, left)

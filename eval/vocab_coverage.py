"""How much of a target's own answers each drafter's draft vocab can reach, from a run's conversations alone.

    python -m eval coverage --config configs/kimi-k25-from-k2.yaml --checkpoint DIR [DIR ...]

No model is loaded: the answers of ``conversations.jsonl`` (what regenerate wrote: the target's own text) are
tokenized with the target's tokenizer, and each drafter's ``t2d`` is read from its checkpoint. A token outside it is
never an accepted draft, so its share is a cycle end at T = 0 that no fine-tuning with the map kept removes: the
first, cheapest look at whether a drafter made for another target (the K2 drafter on Kimi-K2.5) can follow what the
new one writes, before any server runs. Answers (and their reasoning) are tokenized on their own, not in the chat
template, so a token that would merge across an answer's edge is counted as its parts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from data_prep.capture import read_conversations
from drafter.sglang_checkpoint import CheckpointError, load_draft_vocab
from drafter.vocab_map import outside_draft_vocab


def answer_tokens(conversations: Sequence[dict[str, Any]], tokenizer: Any) -> list[list[int]]:
    """Each assistant answer's tokens (its reasoning's first, each part tokenized on its own), one list per answer;
    an answer with neither text is none."""
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) if text else []

    return [encode(m.get("reasoning_content", "")) + encode(m["content"])
            for rec in tqdm(conversations, desc="tokenizing answers", unit="conv")
            for m in rec["messages"] if m["role"] == "assistant" and (m["content"] or m.get("reasoning_content"))]


def draft_vocab_of(ckpt_dir: str | Path, vocab_size: int) -> Any:
    """The checkpoint's ``t2d`` as bool; an error naming the file when it cannot cover ``vocab_size`` target ids."""
    t2d = load_draft_vocab(ckpt_dir)
    if t2d.numel() < vocab_size:
        raise CheckpointError(f"{ckpt_dir}: t2d covers {t2d.numel()} target ids, the target's tokenizer has "
                              f"{vocab_size}: a drafter for another vocabulary")
    return t2d


def coverage(ckpt_dirs: Sequence[str | Path], conversations: Path, tokenizer: Any, limit: int | None = None
             ) -> dict:
    """Per drafter: its draft vocab's size and ``outside_draft_vocab`` over the answers of the first ``limit``
    conversations (all when None)."""
    vocabs = {str(d): draft_vocab_of(d, len(tokenizer)) for d in ckpt_dirs}  # a wrong drafter fails before the work
    convs = read_conversations(conversations)[:limit]
    answers = answer_tokens(convs, tokenizer)
    out = {d: {"draft_vocab_size": int(v.sum()), **outside_draft_vocab(answers, v, tokenizer)}
           for d, v in vocabs.items()}
    return {"conversations": str(conversations), "conversations_read": len(convs), "answers": len(answers),
            "drafters": out}


def coverage_lines(report: dict) -> list[str]:
    """One line per drafter for people: the share outside, over what, and the commonest such tokens."""
    lines = []
    for d, f in report["drafters"].items():
        common = ", ".join(f"{c['token']!r} {c['count']}" for c in f["commonest"][:5])
        lines.append(f"{d}: {100 * f['share']:.2f} % of {f['tokens']:,} answer tokens lie outside its "
                     f"{f['draft_vocab_size']:,}-id draft vocab (in {f['prompts_with_any']:,} of "
                     f"{report['answers']:,} answers){'; commonest: ' + common if common else ''}")
    return lines

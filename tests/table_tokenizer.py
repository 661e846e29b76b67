"""A tokenizer over a fixed list of token texts, for tests of what symbol tokens a vocabulary holds."""

from __future__ import annotations


class Table:
    """A tokenizer over a fixed list of token texts; encoding splits a text into the longest known pieces."""

    def __init__(self, texts: list[str]):
        self.texts = texts

    def __len__(self) -> int:
        return len(self.texts)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.texts[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        while text:
            i = max((i for i, t in enumerate(self.texts) if t and text.startswith(t)), key=lambda i: len(self.texts[i]))
            out.append(i)
            text = text[len(self.texts[i]):]
        return out

"""A conversation's next prompt tokenized from where its previous prompt's last special token ends.

Each turn's prompt re-renders the whole conversation, and tokenizing it whole costs time in its length: a
multi-turn regeneration tokenizes thousands of follow-up prompts of a few thousand tokens, on the host, between
decode steps, while the device waits. A follow-up's text usually starts with the previous prompt's
text, whose ids are known. Fast tokenizers split added tokens (the chat template's markers) out of a text before
anything else, so what follows one tokenizes on its own: the ids up to the previous prompt's last added token
are kept, and only the rest of the new text is tokenized, behind that same token as an anchor (so the rest is,
as in the whole text, a piece that follows it). A template that rewrites the history (reasoning dropped from
earlier turns) makes the texts differ before that point, and the whole text is tokenized.

The first ``CHECKS`` shortcuts are also tokenized whole and compared; one that differs turns the shortcut off
for the run, with one warning (a tokenizer whose pieces depend on what precedes them). Every shortcut also
checks that the previous ids hold as many added tokens as its text has markers, so the kept ids end where the
kept text does.
"""

from __future__ import annotations

import re
import sys
from typing import Any

CHECKS = 64  # shortcuts also tokenized whole and compared, at the start of a run


class PromptTokenizer:
    """Token ids of chat prompts (already rendered), reusing a conversation's previous prompt when it can."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        added = {s: i for s, i in tokenizer.get_added_vocab().items() if s}
        self.added_ids = set(added.values())
        self.id_of = added
        self.markers = re.compile("|".join(re.escape(s) for s in sorted(added, key=len, reverse=True))) if added \
            else None
        self.on = self.markers is not None
        self.checked = self.shortcuts = self.whole = 0
        self.saved_tokens = 0  # tokens kept from previous prompts instead of tokenized again
        self.off_reason: str | None = None

    def encode(self, texts: list[str], previous: list[tuple[str, list[int]] | None]) -> list[list[int]]:
        """Ids of ``texts``; ``previous[i]``: the (text, ids) of the prompt before text i in its conversation."""
        plans = [self._plan(t, p) if self.on and p is not None else None for t, p in zip(texts, previous, strict=True)]
        cut = [i for i, plan in enumerate(plans) if plan is not None]
        out: list[list[int] | None] = [None] * len(texts)
        for i, tail in zip(cut, self._tokenize([plans[i][1] for i in cut]), strict=True):  # type: ignore[index]
            kept, _, anchor_ids = plans[i]  # type: ignore[misc]
            if tail[: len(anchor_ids)] == anchor_ids:  # else the anchor did not tokenize as itself: whole
                out[i] = kept + tail[len(anchor_ids):]
        short = [i for i in cut if out[i] is not None]
        if short and self.checked < CHECKS and not self._agrees(short, texts, out):
            for i in short:
                out[i] = None
            short = []
        self.shortcuts += len(short)
        self.saved_tokens += sum(len(plans[i][0]) for i in short)  # type: ignore[index]
        whole = [i for i, ids in enumerate(out) if ids is None]
        for i, ids in zip(whole, self._tokenize([texts[i] for i in whole]), strict=True):
            out[i] = ids
        self.whole += len(whole)
        return out  # type: ignore[return-value]

    def _agrees(self, short: list[int], texts: list[str], out: list[list[int] | None]) -> bool:
        """Whether these shortcuts give what the whole texts do; a difference turns the shortcut off, warned."""
        self.checked += len(short)
        for i, ids in zip(short, self._tokenize([texts[i] for i in short]), strict=True):
            if ids != out[i]:
                self.on = False
                self.off_reason = "a prompt tokenized after its previous prompt's ids differed from the whole text's"
                print(f"warning: prompts are tokenized whole from now on: {self.off_reason}", file=sys.stderr)
                return False
        return True

    def stats(self) -> dict[str, Any]:
        return {"prompt_shortcuts": self.shortcuts, "prompts_tokenized_whole": self.whole,
                "prompt_tokens_kept": self.saved_tokens, "prompt_shortcut_checks": self.checked,
                "prompt_shortcut_off": self.off_reason}

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    def _plan(self, text: str, previous: tuple[str, list[int]]) -> tuple[list[int], str, list[int]] | None:
        """(kept ids, anchor + the rest of ``text``, the anchor's ids), or None to tokenize ``text`` whole."""
        ptext, pids = previous
        assert self.markers is not None
        found = list(self.markers.finditer(ptext))
        if not found:
            return None
        last = found[-1]
        end = last.end()
        if not text.startswith(ptext[:end]):  # the template rewrote the history before this point
            return None
        positions = [j for j, x in enumerate(pids) if x in self.added_ids]
        if len(positions) != len(found) or pids[positions[-1]] != self.id_of[last.group()]:
            return None  # the ids and the text do not hold the same markers: nothing to align on
        anchor = last.group()
        return pids[: positions[-1] + 1], anchor + text[end:], [self.id_of[anchor]]

"""Ingest: every configured prompt source -> one normalised, deduplicated ``prompts.jsonl``.

Records are cut to ``data.max_turns`` user turns and checked once here, so regeneration can trust its
input. Ids are ``<source>-<sha1[:16]>`` of the prompt turns (system and user, not the source's
answers, which regeneration replaces): the same prompt gets the same id in every run and every file,
and a second copy of it is a duplicate. A record with a user turn that an eval dataset measures (case and whitespace
aside) is kept out of training. Every dropped record is counted under one reason, and every kept record that lost
turns under the change that dropped them (``SourceReport``'s columns). The records come from ``data_prep.sources``
(files, `datasets` sources, hub ids, column mappings).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Set as AbstractSet
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.config import RunConfig
from common.files import write_jsonl_atomic
from data_prep.decontaminate import eval_turn_keys, held_out_turn
from data_prep.readers import Messages, Record, Skip
from data_prep.sources import open_source
from data_prep.step_failed import StepFailed

SKIP_REASONS = ("bad_json", "invalid_utf8", "missing_field", "unknown_role", "non_text", "orphan_tool_result",
                "empty", "too_long", "duplicate", "eval_prompt")


@dataclass
class SourceReport:
    source: str
    path: str
    read: int = 0
    kept: int = 0
    cut_to_max_turns: int = 0
    leading_assistant_dropped: int = 0  # kept records that opened with an assistant turn (that turn dropped)
    # kept records that had an empty system turn (dropped: the chat template's default system prompt renders instead)
    empty_system_dropped: int = 0
    # kept records that ended in a system turn after their last user turn or tool result (dropped: no answer follows)
    trailing_system_dropped: int = 0
    stopped_at_limit: bool = False
    skipped: Counter[str] = field(default_factory=Counter)
    first_skip: dict[str, str] = field(default_factory=dict)  # reason -> "where: detail" of its first case
    broken_tail: str | None = None

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.skipped[reason] += 1
        self.first_skip.setdefault(reason, f"{where}: {detail}" if detail else where)


@dataclass
class IngestSummary:
    output: str
    sources: list[SourceReport]

    @property
    def kept(self) -> int:
        return sum(s.kept for s in self.sources)

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "kept": self.kept,
                "skipped": dict(sum((s.skipped for s in self.sources), Counter())),
                "sources": [asdict(s) | {"skipped": dict(s.skipped)} for s in self.sources]}

    def to_markdown(self) -> str:
        lines = [f"## Ingest: {self.kept} prompts -> {self.output}", "",
                 "| source | path | read | kept | cut to max_turns | opening assistant turn dropped | "
                 "empty system turn dropped | trailing system turn dropped | "
                 + " | ".join(SKIP_REASONS) + " |", "|---" * (8 + len(SKIP_REASONS)) + "|"]
        for s in self.sources:
            read = f"{s.read} (stopped at limit)" if s.stopped_at_limit else str(s.read)
            lines.append(f"| {s.source} | {Path(s.path).name} | {read} | {s.kept} | {s.cut_to_max_turns} | "
                         f"{s.leading_assistant_dropped} | {s.empty_system_dropped} | {s.trailing_system_dropped} | "
                         + " | ".join(str(s.skipped[r]) for r in SKIP_REASONS) + " |")
        notes = [f"- {s.source}: broken tail: {s.broken_tail}" for s in self.sources if s.broken_tail]
        notes += [f"- {s.source}: first {r}: {w}" for s in self.sources for r, w in s.first_skip.items()
                  if w != s.broken_tail]
        return "\n".join(lines + ([""] + notes if notes else []))

    __str__ = to_markdown


@dataclass
class Normalised:
    """A record's turns as ingest keeps them, and which counted changes made them so (``SourceReport``'s columns)."""

    messages: Messages
    cut: bool  # cut after its max_turns-th user turn
    empty_system: bool  # an empty system turn dropped
    trailing_system: bool  # a system turn after the last user turn or tool result dropped (not one the cut took)


def normalise(messages: Messages, max_turns: int, max_chars: int) -> Normalised:
    """Strip, drop empty system turns, keep up to the ``max_turns``-th user turn and its answer, drop system turns
    that no answer follows (``drop_unanswered``). An assistant's reasoning_content and tool_calls and a tool turn's
    tool_call_id/name are kept; a tool result must answer an assistant's tool calls. Raises Skip for a record that
    is no prompt."""
    out: Messages = []
    users = 0
    cut = empty_system = False
    for m in messages:
        content = m["content"].strip()
        if m["role"] == "system" and not content:
            empty_system = True
            continue
        if m["role"] == "user":
            if users == max_turns:
                cut = True
                break
            users += 1
        elif m["role"] == "tool" and not (out and (out[-1]["role"] == "tool" or out[-1].get("tool_calls"))):
            raise Skip("orphan_tool_result", "a tool result that follows no assistant tool call")
        if m["role"] == "user" and not content:
            raise Skip("empty", f"user turn {users} is empty")
        out.append({**m, "content": content})
    if users == 0:
        raise Skip("empty", "no user turn")
    out, unanswered = drop_unanswered(out)
    prompt_chars = sum(len(m["content"]) for m in out if m["role"] != "assistant")
    if prompt_chars > max_chars:
        raise Skip("too_long", f"{prompt_chars} prompt chars > data.max_prompt_chars {max_chars}")
    # after a cut, those system turns led into the user turn it dropped: counted with the cut
    return Normalised(out, cut, empty_system, unanswered and not cut)


def drop_unanswered(messages: Messages) -> tuple[Messages, bool]:
    """Regeneration answers after a user turn or a run of tool results, nothing else: a system turn after the last
    of those gets no answer, and kept it would give the prompt another id than the same chat without it, which
    regenerates the same, so it is dropped (the source's assistant turns after it stay: placeholders that
    regeneration replaces). ``messages`` holds a user turn. Returns the messages and whether any were dropped."""
    last = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
    kept = messages[: last + 1] + [m for m in messages[last + 1:] if m["role"] == "assistant"]
    return kept, len(kept) < len(messages)


def drop_leading_assistant(messages: Messages) -> tuple[Messages, bool]:
    """ShareGPT splits long chats into records, and a continuation opens with the assistant's turn. That
    turn answers nothing we have, but the user turns after it are good prompts: drop only the opening
    assistant turns and the tool results answering their calls (system turns stay). Returns the messages
    and whether any were dropped."""
    first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
    kept: Messages = []
    answered = False  # an opening assistant turn was dropped: the tool results after it go with it
    for m in messages[:first_user]:
        if m["role"] == "assistant" or (m["role"] == "tool" and answered):
            answered = True
            continue
        kept.append(m)
    kept += messages[first_user:]
    return kept, len(kept) < len(messages)


def content_hash(messages: Messages, tools: list[dict[str, Any]] | None = None) -> str:
    prompt: list[Any] = [[m["role"], m["content"]] for m in messages if m["role"] != "assistant"]
    if tools:  # the same turns with other tools on offer are another prompt (ids of tool-less records unchanged)
        prompt.append(["tools", tools])
    try:
        data = json.dumps(prompt, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:  # lone surrogates: undecodable bytes in a JSON array, or bad escapes
        raise Skip("invalid_utf8", f"text cannot be encoded as UTF-8 ({e.reason})") from None
    return hashlib.sha1(data).hexdigest()


def ingest_source(records: Any, report: SourceReport, limit: int | None, max_turns: int, max_chars: int,
                  seen: set[str], out: list[dict[str, Any]], eval_keys: AbstractSet[str] = frozenset()) -> None:
    rec: Record
    for rec in records:
        if limit is not None and report.kept >= limit:
            report.stopped_at_limit = True
            return
        report.read += 1
        try:
            if rec.skip:
                if rec.tail:
                    report.broken_tail = f"{rec.where}: {rec.detail}"
                raise Skip(rec.skip, rec.detail)
            messages, dropped = drop_leading_assistant(rec.messages or [])
            norm = normalise(messages, max_turns, max_chars)
            messages = norm.messages
            if (turn := held_out_turn(messages, eval_keys)) is not None:
                raise Skip("eval_prompt", f"user turn {turn} is a prompt of eval.datasets")
            digest = content_hash(messages, rec.tools)
            if digest in seen:
                raise Skip("duplicate", f"same prompt as an earlier record (sha1 {digest[:16]})")
        except Skip as s:
            report.skip(s.reason, rec.where, s.detail)
            continue
        seen.add(digest)
        report.kept += 1
        report.cut_to_max_turns += norm.cut
        report.leading_assistant_dropped += dropped
        report.empty_system_dropped += norm.empty_system
        report.trailing_system_dropped += norm.trailing_system
        out.append({"id": f"{report.source}-{digest[:16]}", "source": report.source, "messages": messages}
                   | ({"tools": rec.tools} if rec.tools else {}))


def run_ingest(cfg: RunConfig) -> IngestSummary:
    data = cfg.data
    opened = [open_source(src, f"data.sources[{i}]") for i, src in enumerate(data.sources)]  # all checked first
    eval_keys = eval_turn_keys(cfg.eval.datasets)  # kept out of training: the figures are measured on them
    seen: set[str] = set()
    prompts: list[dict[str, Any]] = []
    reports = []
    for src, (where, records) in zip(data.sources, opened, strict=True):
        report = SourceReport(source=src.kind, path=where)
        with closing(records):
            ingest_source(tqdm(records, desc=f"ingest {src.kind}", unit=" rec", mininterval=1.0), report,
                          src.limit, data.max_turns, data.max_prompt_chars, seen, prompts, eval_keys)
        reports.append(report)
    summary = IngestSummary(output=str(cfg.prompts_path), sources=reports)
    if not prompts:  # an empty pool would only fail later, and must not replace a good prompts.jsonl
        skipped = dict(sum((r.skipped for r in reports), Counter()))
        raise StepFailed(f"no usable prompt in data.sources ({sum(r.read for r in reports)} records read, skipped: "
                         f"{skipped or 'none'}); {cfg.prompts_path} left as it was", summary)
    write_jsonl_atomic(cfg.prompts_path, prompts)
    return summary

"""Regenerate: the target rewrites every assistant turn, so the drafter learns the target's own text.

Turn by turn: the chat is system? + user1 -> answer1, then + answer1 + user2 -> answer2, ..., each
answer the target's (the source's answers are dropped). Each finished conversation is appended to
``conversations.jsonl`` as one whole line, flushed at once (fsynced at least every second and at the end:
``common.files.JsonlAppender``), so after a kill -9 a rerun drops a torn last line, skips the ids already there
and ends with every id exactly once.

The hf backend runs one stream over all pending conversations (``_stream``): a request is a conversation's
next turn, submitted to the running engine as soon as its previous answer ends, and a conversation is
written the moment its last answer does, so a kill loses only the conversations in flight. A backend
without a stream (openai) advances rounds of ``regenerate.batch_size`` conversations one turn per call
(``_rounds``).

A failed prompt is counted and left for the next run, but failure is not success: the step stops after
``regenerate.max_consecutive_failures`` prompts in a row failed (a dead server, a broken engine) and exits 2
when more than ``regenerate.max_failure_share`` of the prompts it tried failed. A failure that is a verdict
on the prompt itself (``PROMPT_VERDICTS``: its first user turn alone fills the target's context) says
nothing about the engine: it is counted and reported like any other, and counts towards the share, but it
neither counts towards a run of failures in a row nor ends one. With several devices (hf), each
device's process writes its own part file (merged into ``conversations.jsonl`` at the end, idempotently);
a device stops its share after the consecutive-failure limit, and the share limit applies to the failures
of all devices together.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common import parent_death
from common.config import RunConfig, dump_config, parse_config
from common.files import JsonlAppender, cut_torn_tail, iter_jsonl, json_line, named_errors
from common.percentiles import percentiles
from common.process_clock import process_age_s
from data_prep.backends import CONTEXT_FULL, Chat, ChatBackend, Completion, make_chat_backend
from data_prep.conversation_spans import ConversationSpans
from data_prep.id_hash import id_hash
from data_prep.step_failed import StepFailed, over_failure_share
from engine.profile import EngineProfile

FLAG_SAMPLE = 5  # ids listed per flag in the summary


class RegenerateError(ValueError):
    """Unusable input or output file; the message names it."""


def _json_type(value: Any) -> str:
    """What a value read from JSON is, in words for an error line."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def load_prompt_records(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` prompts of prompts.jsonl (written by ingest, so a bad line is an error)."""
    if not path.is_file():
        raise RegenerateError(f"{path}: no prompts file; run `python -m data_prep ingest` first")
    prompts: list[dict[str, Any]] = []
    seen: set[str] = set()
    for lineno, p in islice(iter_jsonl(path, RegenerateError, fix="rerun ingest"), limit):
        try:
            pid, messages = p["id"], p["messages"]
            roles = [m["role"] for m in messages] if isinstance(messages, list) else []
        except (KeyError, TypeError) as e:
            raise RegenerateError(f"{path}:{lineno}: not a prompt record ({type(e).__name__}: {e}); "
                                  "rerun ingest") from None
        # Ingest writes these types; another would fail far from this line (an id is a set key).
        if not isinstance(pid, str):
            raise RegenerateError(f"{path}:{lineno}: id must be a string, not {_json_type(pid)}; rerun ingest")
        if not isinstance(messages, list):
            raise RegenerateError(f"{path}:{lineno}: messages must be a list, not {_json_type(messages)}; "
                                  "rerun ingest")
        if pid in seen:
            raise RegenerateError(f"{path}:{lineno}: id {pid} appears twice; rerun ingest")
        if "user" not in roles:
            raise RegenerateError(f"{path}:{lineno}: prompt {pid} has no user turn; rerun ingest")
        if (unanswered := unanswered_role(roles)) is not None:
            raise RegenerateError(f"{path}:{lineno}: prompt {pid} has a {unanswered} turn after its last user "
                                  "turn or tool result, which no answer would follow; rerun ingest")
        seen.add(pid)
        prompts.append(p)
    if not prompts:
        raise RegenerateError(f"{path}: no prompts in it; rerun ingest with data.sources that hold some")
    return prompts


def unanswered_role(roles: list[str]) -> str | None:
    """The role of a turn after the last user turn or tool result other than the source's answers, else None:
    ``Conversation`` answers only after those, so such a turn would be left out of the conversation (ingest drops
    and counts it, ``data_prep.ingest.drop_unanswered``). ``roles`` holds a user turn."""
    last = max(i for i, r in enumerate(roles) if r in ("user", "tool"))
    return next((r for r in roles[last + 1:] if r != "assistant"), None)


def resume(path: Path) -> tuple[set[str], int]:
    """Ids already written, after cutting a torn last line off the file; returns (ids, bytes cut)."""
    if not path.exists():
        return set(), 0
    torn = cut_torn_tail(path)
    return {rec["id"] for rec in whole_records(path)}, torn


_DAMAGED = "the file is damaged: move it away and rerun"


def whole_records(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a conversations file whose torn tail is cut: what is left are whole lines, so a bad one is
    damage, never an interrupted append."""
    for lineno, rec in iter_jsonl(path, RegenerateError, fix=_DAMAGED):
        if not isinstance(rec.get("id"), str):
            raise RegenerateError(f"{path}:{lineno}: a whole line that is not a conversation record; {_DAMAGED}")
        yield rec


class Conversation:
    """One prompt being regenerated: the target answers after each user turn and after each run of tool results.

    The source's assistant turns are dropped; its tool results stay, since no tool is run here. A run of tool
    results answers the source's tool calls, so it is fed only when the target's own previous answer made the
    same calls (function names in order); they are then attached to the target's call ids. When the target
    chose otherwise (other calls, or calls where the source made none), the conversation ends after its answer
    (``diverged``): a result for a call never made would teach the drafter a conversation that cannot happen."""

    def __init__(self, prompt: dict[str, Any]):
        self.prompt = prompt
        self.tools = prompt.get("tools")
        self.segments: list[Chat] = []  # the non-assistant turns before each answer
        self.answers_calls: list[list[dict[str, Any]] | None] = []  # per segment: the source calls it answers
        pending: Chat = []
        calls = None
        msgs = prompt["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "assistant":
                calls = m.get("tool_calls")
                continue
            pending.append(dict(m))
            after = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
            if m["role"] == "user" or (m["role"] == "tool" and after != "tool"):
                self.segments.append(pending)
                self.answers_calls.append(calls if m["role"] == "tool" else None)
                pending = []
        self.chat: Chat = []
        self.finish_reasons: list[str] = []
        self.error: str | None = None
        self.detail = ""
        self.diverged = False
        self.turns_dropped = 0  # prompt turns (a user turn, or a run of tool results) left out: context full
        self.answer_tokens = 0  # tokens of its answers, as the backend counted them
        self.loop_cuts: list[tuple[int, int]] = []  # per answer cut at a loop: (tokens generated, tokens kept)

    def wants_more(self) -> bool:
        return self.error is None and not self.diverged and len(self.finish_reasons) < len(self.segments)

    def request(self) -> Chat:
        n = len(self.finish_reasons)
        segment = self.segments[n]
        if self.answers_calls[n] is not None:
            segment = self._attach(segment, self.answers_calls[n])
        self.chat += segment
        return list(self.chat)

    def _attach(self, results: Chat, source_calls: list[dict[str, Any]]) -> Chat:
        """Tool results re-addressed to the target's own calls (by position among the source's calls)."""
        own = self.chat[-1].get("tool_calls") or [] if self.chat and self.chat[-1]["role"] == "assistant" else []
        position = {c.get("id"): i for i, c in enumerate(source_calls)}
        out = []
        for j, r in enumerate(results):
            i = position.get(r.get("tool_call_id"), j)
            out.append(r | ({"tool_call_id": own[i]["id"]} if i < len(own) and "id" in own[i] else {}))
        return out

    def _can_continue(self, n: int) -> bool:
        """Whether segment n can follow the target's last answer: its tool results answer exactly the calls the
        target made (same function names in order, one result each), or it has no tool results and the target
        made no call. SGLang refuses a chat with an unanswered call (``_tool_call_pairing_error`` in sglang
        srt/entrypoints/openai/serving_chat.py), and a result for a call never made would be fiction."""
        own = [c["function"]["name"] for c in self.chat[-1].get("tool_calls") or ()]
        source = self.answers_calls[n]
        if source is None:
            return not own
        results = [m for m in self.segments[n] if m["role"] == "tool"]
        return own == [c["function"]["name"] for c in source] and len(results) == len(own)

    def accept(self, c: Completion) -> None:
        if c.error:
            self.error, self.detail = c.error, c.detail
            return
        if c.finish_reason == CONTEXT_FULL:  # the target's context is full: the conversation ends here
            done = len(self.finish_reasons)
            if done == 0:
                self.error, self.detail = "prompt_exceeds_context", "the first user turn alone fills the context"
                return
            self.chat = self.chat[: len(self.chat) - len(self.segments[done])]
            self.turns_dropped = len(self.segments) - done
            self.segments = self.segments[:done]
            self.answers_calls = self.answers_calls[:done]
            return
        self.chat.append(c.message())
        self.finish_reasons.append(c.finish_reason)
        self.answer_tokens += c.tokens or 0
        if c.loop_tokens:
            self.loop_cuts.append(c.loop_tokens)
        n = len(self.finish_reasons)
        if n < len(self.segments) and not self._can_continue(n):
            self.diverged = True

    def record(self, backend: str) -> dict[str, Any]:
        return ({"id": self.prompt["id"], "source": self.prompt["source"], "messages": self.chat,
                 "finish_reasons": self.finish_reasons, "backend": backend}
                | ({"tools": self.tools} if self.tools else {}))


@dataclass
class RegenerateSummary:
    output: str
    backend: str
    selected: int  # prompts asked for (regenerate.num_prompts of prompts.jsonl)
    already_done: int  # found in the file at start
    torn_bytes_dropped: int
    written: int  # this run
    tool_calls_diverged: int = 0  # this run: ended early, the target made other tool calls than the source's
    # this run: later turns left out, the target's context being full (a run of tool results counts as one)
    turns_dropped_context_full: int = 0
    # this run: answers cut at their loop's first copy (regenerate.stop_loops), the tokens they had when cut
    # (hf: generated; openai: the returned answer's) and the tokens kept
    loop_cuts: int = 0
    loop_tokens_generated: int = 0
    loop_tokens_kept: int = 0
    # this run: tokens of the answers written (hf: the engine's; openai: the server's usage, when it sends it)
    answer_tokens: int = 0
    engine: dict[str, Any] = field(default_factory=dict)  # hf: the engine's run (rows, pages, steps, preempted, ...)
    # hf: when its conversations were open (``ConversationSpans.summary``; several devices: per device)
    spans: dict[str, Any] = field(default_factory=dict)
    failed: Counter[str] = field(default_factory=Counter)  # this run, by reason
    failure_examples: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0  # the step: the stream (or the rounds; several devices: the workers and the merge)
    # Where the process's seconds went, measured in it (``PHASES``); several devices: the parent's, and each
    # worker's in device_phases (in the order of regenerate.devices)
    phases: dict[str, float] = field(default_factory=dict)
    device_phases: list[dict[str, float]] = field(default_factory=list)
    tried: int = 0  # this run: prompts attempted (written + failed)
    stopped: str | None = None  # why the run stopped early (too many failures in a row; per device when several)
    # Validation of the whole output file as it stands at the end:
    records: int = 0
    duplicate_ids: int = 0
    missing: int = 0  # selected prompts with no record (failed; a rerun retries them)
    turns: int = 0
    finish_reasons: Counter[str] = field(default_factory=Counter)
    answer_chars: dict[str, int] = field(default_factory=dict)  # percentile -> chars
    empty_answers: int = 0
    length_answers: int = 0
    loop_answers: int = 0  # finish reason "loop"
    flagged: dict[str, list[str]] = field(default_factory=dict)  # "empty"/"length"/"loop" -> sample ids

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"failed": dict(self.failed), "finish_reasons": dict(self.finish_reasons)}

    def to_markdown(self) -> str:
        pct = ", ".join(f"p{k}={v}" for k, v in self.answer_chars.items()) or "-"
        lines = [
            f"## Regenerate ({self.backend}): {self.records} conversations in {self.output}", "",
            f"- this run: {self.written} written in {self.seconds:.1f} s ({self.answer_tokens} answer tokens); "
            f"{self.already_done} already done; "
            f"{sum(self.failed.values())} failed; torn tail dropped: {self.torn_bytes_dropped} bytes; "
            f"{self.tool_calls_diverged} ended where the target's tool calls differ from the source's; "
            f"{self.turns_dropped_context_full} later user turns left out (context full)",
            f"- of {self.selected} selected prompts: {self.missing} missing (rerun to retry), "
            f"{self.duplicate_ids} duplicate ids",
            f"- {self.turns} answers: finish reasons {dict(self.finish_reasons)}; chars {pct}",
            f"- flagged: {self.empty_answers} empty, {self.length_answers} cut at max_new_tokens (\"length\"), "
            f"{self.loop_answers} cut at a loop (\"loop\")",
            f"- this run: {self.loop_cuts} answers cut at their loop's first copy, when they had "
            f"{self.loop_tokens_generated} tokens; {self.loop_tokens_kept} kept",
        ]
        lines += [f"  - {flag}: {', '.join(ids)}" for flag, ids in self.flagged.items() if ids]
        lines += [f"- failed {reason}: {n} (first: {self.failure_examples.get(reason, '')})"
                  for reason, n in self.failed.items()]
        if self.stopped:
            lines.append(f"- stopped early: {self.stopped}")
        if self.phases:
            lines.append(f"- seconds by phase: {phase_text(self.phases)}")
        lines += [f"  - device worker {r}: {phase_text(p)}" for r, p in enumerate(self.device_phases)]
        return "\n".join(lines)

    __str__ = to_markdown


# The summary's ``phases`` (seconds, ms rounded; a key is absent where its part did not run, and the three that are
# the process's age, from its start as the kernel records it (``common.process_clock``), off Linux): ``startup_s``,
# its age when the step started, of it ``interpreter_and_imports_s``, its age at the step's call (the interpreter,
# the imports, the config, the run-dir lock; in a device worker: its spawn, imports and task), then
# ``prompts_read_s``, ``devices_s`` (hf: torch imported, the GPUs counted), ``backend_s``
# (make_chat_backend: transformers imported, the tokenizer and model loaded, the engine built) and ``resume_s``
# (the output's ids read back, the pending sorted; several devices: leftover part files merged first); then
# ``step_s`` (= ``seconds``), ``validate_s``, ``close_s`` (the backend closed) and ``process_s``, the process's age
# when the step returned. What comes after (the summary printed and written, the interpreter's exit, CUDA's
# teardown) cannot be timed inside: bench/regenerate_throughput.py reports it as the command's wall time minus
# process_s (``exit_s``).
PHASES = ("startup_s", "interpreter_and_imports_s", "prompts_read_s", "devices_s", "backend_s", "resume_s",
          "step_s", "validate_s", "close_s", "process_s")
STARTUP_PARTS = PHASES[1:6]


def _since(start: float) -> float:
    return round(time.perf_counter() - start, 3)


def _age(key: str) -> dict[str, float]:
    """``{key: the process's age}``, or nothing where the kernel does not say (not Linux)."""
    age = process_age_s()
    return {} if age is None else {key: round(age, 3)}


def phase_text(phases: dict[str, float]) -> str:
    """``phases`` in one line: the startup, its parts in parentheses, then the rest in order."""
    name = lambda k: k.removesuffix("_s").replace("_", " ")  # noqa: E731
    parts = ", ".join(f"{name(k)} {phases[k]}" for k in STARTUP_PARTS if k in phases)
    rest = ", ".join(f"{name(k)} {phases[k]} s" for k in PHASES[6:] if k in phases)
    head = f"startup {phases['startup_s']} s" if "startup_s" in phases else "before the step"
    return f"{head} ({parts}), {rest}"


def answer_text(message: dict[str, Any]) -> str:
    """What an answer says: its reasoning, content and tool calls (an agentic turn may have no content)."""
    calls = "".join(json.dumps(c, ensure_ascii=False) for c in message.get("tool_calls") or ())
    return (message.get("reasoning_content") or "") + message["content"] + calls


def validate(path: Path, selected: list[str], summary: RegenerateSummary) -> None:
    """Re-read the output as the next stage will, and fill in the checks and answer statistics."""
    counts: Counter[str] = Counter()
    lengths: list[int] = []
    flagged: dict[str, list[str]] = {"empty": [], "length": [], "loop": []}
    for _, rec in iter_jsonl(path, RegenerateError, fix=_DAMAGED):
        counts[rec["id"]] += 1
        answers = [answer_text(m) for m in rec["messages"] if m["role"] == "assistant"]
        lengths += [len(a) for a in answers]
        summary.finish_reasons.update(rec["finish_reasons"])
        empty = sum(not a.strip() for a in answers)
        cut = rec["finish_reasons"].count("length")
        looped = rec["finish_reasons"].count("loop")
        summary.empty_answers += empty
        summary.length_answers += cut
        summary.loop_answers += looped
        for flag, n in (("empty", empty), ("length", cut), ("loop", looped)):
            if n and len(flagged[flag]) < FLAG_SAMPLE:
                flagged[flag].append(rec["id"])
    summary.records = sum(counts.values())
    summary.duplicate_ids = sum(n - 1 for n in counts.values())
    summary.missing = sum(pid not in counts for pid in selected)
    summary.turns = len(lengths)
    summary.answer_chars = percentiles(lengths)
    summary.flagged = flagged


# Failure reasons that are a verdict on the prompt, not on the engine or the server: the same prompt fails the
# same way on any healthy backend, so a run of them (the stream may well report all the too-long prompts
# first: they are rejected before any decoding) is no sign of a dead server and must not stop the run. They
# still count towards regenerate.max_failure_share, so a dataset that is mostly too long still fails.
# Case by case:
# - prompt_exceeds_context (hf: the first user turn's tokens alone reach the context): a verdict on the prompt.
# - http_4xx (openai; 429 is retried): NOT one. A too-long prompt does get a 400 from SGLang or vLLM, but so
#   does every prompt when the request is wrong (model name, chat_template_kwargs, a parameter the server
#   refuses), and that misconfiguration is what the breaker is for; the status alone cannot tell them apart.
# - bad_response, timeout, connection, connection_refused, http_5xx: the server's state, not the prompt's.
# - a conversation cut short by a full context after its first answer, or whose tool calls diverge, is not a
#   failure at all: it is written (turns_dropped_context_full, tool_calls_diverged).
PROMPT_VERDICTS = frozenset({"prompt_exceeds_context"})
# What to change when a failure reason makes the run fail (check_failures): one clause, naming the settings.
FAILURE_HINTS = {
    "prompt_exceeds_context": "prompts too long for the target's context: raise regenerate.max_context_tokens (hf; "
                              "at most the target's max_position_embeddings), or lower data.max_prompt_chars and "
                              "rerun ingest, or raise regenerate.max_failure_share to leave them out",
}


class _Tally:
    """Where finished conversations go: written at once (one durable line each) or counted as failed; says
    when ``regenerate.max_consecutive_failures`` in a row means stopping. A failure in ``PROMPT_VERDICTS``
    is counted but leaves the run of failures in a row as it was (neither adds to it nor ends it)."""

    def __init__(self, summary: RegenerateSummary, out: JsonlAppender, limit: int, bar: tqdm):
        self.summary, self.out, self.limit, self.bar = summary, out, limit, bar
        self.in_a_row = 0

    def settle(self, conv: Conversation) -> None:
        s = self.summary
        if conv.error:
            s.failed[conv.error] += 1
            s.failure_examples.setdefault(conv.error, f"{conv.prompt['id']}: {conv.detail}")
            if conv.error not in PROMPT_VERDICTS:
                self.in_a_row += 1
        else:
            self.out.append(conv.record(s.backend))
            s.written += 1
            self.in_a_row = 0
            s.tool_calls_diverged += conv.diverged
            s.turns_dropped_context_full += conv.turns_dropped
            s.loop_cuts += len(conv.loop_cuts)
            s.loop_tokens_generated += sum(g for g, _ in conv.loop_cuts)
            s.loop_tokens_kept += sum(k for _, k in conv.loop_cuts)
            s.answer_tokens += conv.answer_tokens
        s.tried += 1
        self.bar.update(1)

    @property
    def stop(self) -> bool:
        return self.in_a_row >= self.limit


def _rounds(pending: list[dict[str, Any]], backend: ChatBackend, tally: _Tally) -> None:
    """Rounds of ``backend.batch_size`` conversations, each advanced one turn per ``complete`` call."""
    for i in range(0, len(pending), backend.batch_size):
        convs = [Conversation(p) for p in pending[i: i + backend.batch_size]]
        while active := [c for c in convs if c.wants_more()]:
            chats = [c.request() for c in active]
            tools = [c.tools for c in active]
            for conv, completion in zip(active, backend.complete(chats, tools if any(tools) else None),
                                        strict=True):
                conv.accept(completion)
        for conv in convs:
            tally.settle(conv)
        if tally.stop:
            return


def _stream(pending: list[dict[str, Any]], backend: Any, tally: _Tally, spans: ConversationSpans,
            profile: EngineProfile | None) -> dict[str, Any]:
    """One engine run over every pending conversation: a turn is submitted when the previous one's answer
    ends, a conversation settled (written) when it ends. New conversations are opened only as the engine has
    room for them (``wants``), so what a kill loses is the conversations in flight. Returns the engine's
    statistics; ``spans`` gets when each conversation opened and settled, ``profile`` where the seconds went."""
    stream = backend.stream(len(pending), profile)  # one turn of a conversation in flight at a time
    if hasattr(stream, "prefetch"):  # each one's first chat, as its Conversation will ask it
        stream.prefetch([p["id"] for p in pending],
                        ((c.request(), c.tools) for c in (Conversation(p) for p in pending)))
    try:
        return _run_stream(stream, pending, tally, spans, profile)
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


def _run_stream(stream: Any, pending: list[dict[str, Any]], tally: _Tally, spans: ConversationSpans,
                profile: EngineProfile | None) -> dict[str, Any]:
    """``_stream``'s loop over a stream that is set up."""
    unopened = iter(pending)
    open_: dict[str, Conversation] = {}

    def open_more() -> None:
        batch = []
        for _ in range(max(0, stream.wants)):
            p = next(unopened, None)
            if p is None:
                break
            conv = open_[p["id"]] = Conversation(p)
            spans.open(p["id"])
            batch.append((p["id"], conv.request(), conv.tools))
        stream.submit(batch)

    open_more()
    for finished in stream.results():
        follow_ups = []  # submitted together: tokenized in one batch
        for key, completion in finished:
            conv = open_[key]
            conv.accept(completion)
            if conv.wants_more():
                follow_ups.append((key, conv.request(), conv.tools))
            else:
                del open_[key]
                spans.settle(key, len(conv.finish_reasons), conv.answer_tokens)
                tally.settle(conv)
                if tally.stop:
                    break
        if tally.stop:
            break
        stream.submit(follow_ups)
        open_more()
        tally.bar.set_postfix(tok_s=round(stream.tokens_per_s()), open=len(open_), refresh=False)
    if profile is not None:
        profile.add_caller("write_s", tally.out.seconds)
    return stream.stats()


def regenerate(cfg: RunConfig, prompts: list[dict[str, Any]], backend: ChatBackend,
               out_path: Path | None = None, phases: dict[str, float] | None = None,
               profile: EngineProfile | None = None) -> RegenerateSummary:
    """The loop, for any backend: one stream over the conversations where the backend has one (hf), else
    rounds of conversations advanced a turn per backend call. ``out_path``: conversations.jsonl, or one
    device's part file when several devices share the work. ``phases``: the caller's so far (``PHASES``); the
    summary's go on from them. ``profile`` (a benchmark's): where the stream's seconds go, in the summary's
    ``engine``, with the host's stack samples of the step when it samples them."""
    t = time.perf_counter()
    out_path = out_path or cfg.conversations_path
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done, torn = resume(out_path)
    pending = [p for p in prompts if p["id"] not in done]
    streaming = hasattr(backend, "stream")
    if streaming:
        # The most turns (then the most text) first: the conversations opened last are short, so the run's
        # end is not one long conversation's turns one after another.
        pending.sort(key=lambda p: (-len(Conversation(p).segments), -_prompt_chars(p), p["id"]))
    else:
        # Similar lengths share a round: less waiting on one long request per round.
        pending.sort(key=_prompt_chars)
    summary = RegenerateSummary(output=str(out_path), backend=backend.name, selected=len(prompts),
                                already_done=len(prompts) - len(pending), torn_bytes_dropped=torn, written=0)
    resume_s = _since(t)
    summary.phases = _age("startup_s") | (phases or {}) | {"resume_s": resume_s}
    start = time.perf_counter()
    limit = cfg.regenerate.max_consecutive_failures
    sampling = profile.sampling() if profile is not None else nullcontext()
    with open(out_path, "ab") as f, tqdm(total=len(pending), desc=f"regenerate ({backend.name})",
                                         unit=" conv") as bar, sampling:
        out = JsonlAppender(f)
        tally = _Tally(summary, out, limit, bar)
        try:
            if streaming and pending:
                spans = ConversationSpans()
                summary.engine = _stream(pending, backend, tally, spans, profile)
                summary.spans = spans.summary()
            else:
                _rounds(pending, backend, tally)
        finally:
            out.sync()
        if tally.stop:
            summary.stopped = (f"{tally.in_a_row} prompts in a row failed (regenerate.max_consecutive_failures="
                               f"{limit}); {len(pending) - summary.tried} not tried")
    summary.seconds = time.perf_counter() - start
    summary.phases["step_s"] = round(summary.seconds, 3)
    if profile is not None and profile.host_samples is not None:
        summary.engine["host_samples"] = profile.host_samples
    t = time.perf_counter()
    validate(out_path, [p["id"] for p in prompts], summary)
    summary.phases["validate_s"] = _since(t)
    return summary


def _prompt_chars(p: dict[str, Any]) -> int:
    return sum(len(m["content"]) for m in p["messages"] if m["role"] != "assistant")


def check_failures(cfg: RunConfig, summary: RegenerateSummary) -> None:
    """StepFailed (exit 2, the summary still saved) when the run stopped early or more than
    regenerate.max_failure_share of the prompts it tried failed; ``summary`` covers every device."""
    failed, tried = sum(summary.failed.values()), summary.tried
    if not (summary.stopped or over_failure_share(failed, tried, cfg.regenerate.max_failure_share)):
        return
    reasons = ", ".join(f"{r}: {n}" for r, n in summary.failed.most_common())
    top = summary.failed.most_common(1)[0][0] if failed else ""
    first = summary.failure_examples.get(top, "")
    hint = f"; {FAILURE_HINTS[top]}" if top in FAILURE_HINTS and not summary.stopped else ""
    raise StepFailed(f"{failed} of {tried} prompts failed ({reasons}; e.g. {first})"
                     + (f"; stopped early: {summary.stopped}" if summary.stopped else
                        f"; more than regenerate.max_failure_share={cfg.regenerate.max_failure_share}{hint}")
                     + f". Fix the cause and rerun: the {summary.records} finished conversations in {summary.output} "
                     "are kept", summary)


def hf_devices(cfg: RunConfig) -> list[str]:
    """Where the hf backend runs: regenerate.devices, else every visible GPU when the target may use one."""
    if cfg.regenerate.backend != "hf":
        return []
    if cfg.regenerate.devices:
        return list(cfg.regenerate.devices)
    import torch

    if cfg.target.device in ("auto", "cuda") and torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [cfg.target.device]


def part_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.part-{rank}{out.suffix}")


def merge_parts(out: Path) -> int:
    """Fold the per-device part files into ``out`` (ids already there are skipped), then delete them.
    Idempotent: a kill mid-merge leaves at most a torn last line, and the rerun merges the rest."""
    parts = sorted(out.parent.glob(f"{out.stem}.part-*{out.suffix}"))
    if not parts:
        return 0
    done, _ = resume(out)
    added = 0
    with named_errors(out), open(out, "ab") as f:
        for part in parts:
            cut_torn_tail(part)
            for rec in whole_records(part):
                if rec["id"] not in done:
                    f.write(json_line(rec).encode("utf-8"))  # the bytes the part's writer wrote (same json_line)
                    done.add(rec["id"])
                    added += 1
        f.flush()
        os.fsync(f.fileno())
    for part in parts:
        part.unlink()
    return added


def share_of(prompt_id: str, n: int) -> int:
    """The device a prompt goes to: stable across reruns, so a resumed part file is never re-asked."""
    return id_hash(prompt_id) % n


def device_shares(prompts: list[dict[str, Any]], n: int) -> list[list[dict[str, Any]]]:
    """``prompts`` split over ``n`` devices (``share_of``), each share in the prompts' order."""
    return [[p for p in prompts if share_of(p["id"], n) == r] for r in range(n)]


def _device_worker(tree: dict[str, Any], prompts: list[dict[str, Any]], device: str, part: str,
                   profile: bool) -> dict[str, Any]:
    """One device's share, in its own process (spawned: CUDA cannot be forked). It runs under the parent's
    run-dir lock (it takes none: the parent holds it) and dies with the parent (``_worker_init``). Its failures
    are counted, not raised: the limits apply to all devices together (``check_failures`` in the parent); it
    stops its own share after max_consecutive_failures in a row."""
    phases = _age("interpreter_and_imports_s")
    summary = _on_one_backend(parse_config(tree), prompts, phases, device, Path(part), profile)
    summary.phases |= _age("process_s")
    return summary.to_dict()


def _on_one_backend(cfg: RunConfig, prompts: list[dict[str, Any]], phases: dict[str, float],
                    device: str | None = None, out_path: Path | None = None, profile: bool = False
                    ) -> RegenerateSummary:
    """The step on one backend (the target on ``device`` when given), built and closed here (the openai one has
    threads to close): ``phases`` goes on with backend_s, the step's own, and close_s. ``profile``: the step is
    profiled (``EngineProfile``, its host sampled)."""
    if device is not None:
        cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"device": device})})
    t = time.perf_counter()
    backend = make_chat_backend(cfg.target, cfg.regenerate)
    phases["backend_s"] = _since(t)
    try:
        summary = regenerate(cfg, prompts, backend, out_path, phases,
                             EngineProfile(sample_host=True) if profile else None)
    finally:
        t = time.perf_counter()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        close_s = _since(t)
    summary.phases["close_s"] = close_s
    return summary


def regenerate_on_devices(cfg: RunConfig, prompts: list[dict[str, Any]], devices: list[str],
                          phases: dict[str, float] | None = None, profile: bool = False) -> RegenerateSummary:
    """The prompts split over ``devices`` (one process and one part file each), merged at the end. ``phases``:
    the caller's so far (``PHASES``); the summary's go on from them, each worker's in ``device_phases``.
    ``profile``: each worker's step is profiled (``run_regenerate``)."""
    import multiprocessing as mp

    t = time.perf_counter()
    out = cfg.conversations_path
    out.parent.mkdir(parents=True, exist_ok=True)
    merge_parts(out)  # leftovers of a killed run
    done, torn = resume(out)
    pending = [p for p in prompts if p["id"] not in done]
    shares = device_shares(pending, len(devices))
    tree = dump_config(cfg)
    resume_s = _since(t)
    phases = _age("startup_s") | (phases or {}) | {"resume_s": resume_s}
    start = time.perf_counter()
    # The workers die with this process (a pipeline killed with -9 takes its stages' workers along; the
    # run-dir lock they work under dies with it).
    with mp.get_context("spawn").Pool(len(devices), initializer=parent_death.die_with_parent) as pool:
        parts = pool.starmap(_device_worker, [(tree, share, dev, str(part_path(out, r)), profile)
                                              for r, (share, dev) in enumerate(zip(shares, devices, strict=True))])
    merge_parts(out)
    stopped = [f"{dev}: {p['stopped']}" for dev, p in zip(devices, parts, strict=True) if p["stopped"]]
    summary = RegenerateSummary(output=str(out), backend=f"hf x{len(devices)} ({', '.join(devices)})",
                                selected=len(prompts), already_done=len(prompts) - len(pending),
                                torn_bytes_dropped=torn, written=sum(p["written"] for p in parts),
                                turns_dropped_context_full=sum(p["turns_dropped_context_full"] for p in parts),
                                tool_calls_diverged=sum(p["tool_calls_diverged"] for p in parts),
                                loop_cuts=sum(p["loop_cuts"] for p in parts),
                                loop_tokens_generated=sum(p["loop_tokens_generated"] for p in parts),
                                loop_tokens_kept=sum(p["loop_tokens_kept"] for p in parts),
                                answer_tokens=sum(p["answer_tokens"] for p in parts),
                                engine={dev: p["engine"] for dev, p in zip(devices, parts, strict=True)},
                                spans={dev: p["spans"] for dev, p in zip(devices, parts, strict=True)},
                                tried=sum(p["tried"] for p in parts), stopped="; ".join(stopped) or None,
                                seconds=time.perf_counter() - start, device_phases=[p["phases"] for p in parts])
    summary.phases = phases | {"step_s": round(summary.seconds, 3)}
    for p in parts:
        summary.failed.update(p["failed"])
        for reason, example in p["failure_examples"].items():
            summary.failure_examples.setdefault(reason, example)
    t = time.perf_counter()
    validate(out, [p["id"] for p in prompts], summary)
    summary.phases["validate_s"] = _since(t)
    return summary


def run_regenerate(cfg: RunConfig, profile: bool = False) -> RegenerateSummary:
    """Regenerate on one backend or over several devices; StepFailed when too many prompts failed. ``profile`` (a
    benchmark's, never the command's): each process's step measures where its seconds go (``EngineProfile``, the
    host's stack sampled) into the summary's ``engine``."""
    phases = _age("interpreter_and_imports_s")
    t = time.perf_counter()
    # Read first: a bad input fails before the model loads.
    prompts = load_prompt_records(cfg.prompts_path, cfg.regenerate.num_prompts)
    phases["prompts_read_s"] = _since(t)
    t = time.perf_counter()
    devices = hf_devices(cfg)
    phases["devices_s"] = _since(t)
    if len(devices) > 1:
        summary = regenerate_on_devices(cfg, prompts, devices, phases, profile)
    else:
        summary = _on_one_backend(cfg, prompts, phases, devices[0] if devices else None, profile=profile)
    summary.phases |= _age("process_s")
    check_failures(cfg, summary)
    return summary

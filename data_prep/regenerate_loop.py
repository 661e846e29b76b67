"""The regeneration loop on one backend: conversations advanced turn by turn, each written the moment it ends.

The hf backend runs one stream over all pending conversations (``_stream``): a request is a conversation's
next turn, submitted to the running engine as soon as its previous answer ends, and a conversation is
written the moment its last answer does, so a kill loses only the conversations in flight. A backend
without a stream (openai) advances rounds of ``regenerate.batch_size`` conversations one turn per call
(``_rounds``).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.config import RunConfig
from common.files import JsonlAppender
from data_prep.backends import ChatBackend, make_chat_backend
from data_prep.conversation import Conversation
from data_prep.conversation_spans import ConversationSpans
from data_prep.regenerate_files import resume
from data_prep.regenerate_summary import PROMPT_VERDICTS, RegenerateSummary, age_phase, seconds_since, validate
from engine.profile import EngineProfile


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
    resume_s = seconds_since(t)
    summary.phases = age_phase("startup_s") | (phases or {}) | {"resume_s": resume_s}
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
    summary.phases["validate_s"] = seconds_since(t)
    return summary


def _prompt_chars(p: dict[str, Any]) -> int:
    return sum(len(m["content"]) for m in p["messages"] if m["role"] != "assistant")


def on_one_backend(cfg: RunConfig, prompts: list[dict[str, Any]], phases: dict[str, float],
                   device: str | None = None, out_path: Path | None = None, profile: bool = False
                   ) -> RegenerateSummary:
    """The step on one backend (the target on ``device`` when given), built and closed here (the openai one has
    threads to close): ``phases`` goes on with backend_s, the step's own, and close_s. ``profile``: the step is
    profiled (``EngineProfile``, its host sampled)."""
    if device is not None:
        cfg = cfg.model_copy(update={"target": cfg.target.model_copy(update={"device": device})})
    t = time.perf_counter()
    backend = make_chat_backend(cfg.target, cfg.regenerate)
    phases["backend_s"] = seconds_since(t)
    try:
        summary = regenerate(cfg, prompts, backend, out_path, phases,
                             EngineProfile(sample_host=True) if profile else None)
    finally:
        t = time.perf_counter()
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        close_s = seconds_since(t)
    summary.phases["close_s"] = close_s
    return summary

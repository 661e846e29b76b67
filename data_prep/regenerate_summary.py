"""What a regenerate run reports: its summary (counts, the output file validated, seconds by phase) and the
verdict on its failures (``check_failures``: StepFailed when too many prompts failed)."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.config import RunConfig
from common.files import iter_jsonl
from common.percentiles import percentiles
from common.process_clock import process_age_s
from data_prep.regenerate_files import DAMAGED, RegenerateError
from data_prep.step_failed import StepFailed, over_failure_share

FLAG_SAMPLE = 5  # ids listed per flag in the summary


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


def seconds_since(start: float) -> float:
    return round(time.perf_counter() - start, 3)


def age_phase(key: str) -> dict[str, float]:
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
    for _, rec in iter_jsonl(path, RegenerateError, fix=DAMAGED):
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

"""Symbol runs: the target's own continuations of a run of one symbol token inside its answers.

A greedy target that falls into a loop often repeats one token (a row of ``=``, a run of ``<<`` in code), and there
a drafter that copies the token keeps every draft while one that drafts anything else keeps none. Regeneration cuts
loops (regenerate.stop_loops), so few runs reach the training data. Sample ``i`` takes the first answer of a random
regenerated conversation (data.symbol_runs.conversations), cuts it after a random token, appends a run of a random
symbol token (``symbol_tokens``: one to three punctuation characters, optionally after a space, whose run the
tokenizer encodes as copies of it; with drafter.init_from, only those in its draft vocab, since a warm start keeps
its map) and lets the target continue greedily for max_new_tokens. The record is the conversation up to that answer,
whose content is the cut text, the run and the continuation, with ``given_chars`` counting what the target was given:
only the continuation is trained (data_prep/loss_mask.py), so every label is the target's own greedy token, whether
it keeps the run or leaves it.

Sample ``i`` draws its choices from its own seed (data.symbol_runs.seed and ``i``), so a resumed run makes the samples
an unbroken one makes. Kept samples go to ``run_dir/symbol_runs.jsonl`` (conversations.jsonl's format: train on it
beside the regenerated conversations); a skipped sample goes to ``run_dir/symbol_runs.skipped.jsonl`` with its
reason: ``context`` (its prompt leaves no room for max_new_tokens in the target's context) or ``round_trip`` (the
text does not encode back to the tokens the target read and wrote, and training re-encodes the text). Both files are
appended whole line by line; a torn last line is cut on resume.
"""

from __future__ import annotations

import random
import string
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.config import RunConfig, SymbolRunsConfig
from common.files import JsonlAppender, cut_torn_tail, iter_jsonl, named_errors
from data_prep.backends import context_limit
from data_prep.loss_mask import MARK, conversation_text
from data_prep.self_prompts import continuation
from data_prep.step_failed import StepFailed
from drafter.sglang_checkpoint import load_draft_vocab
from engine.batched import BatchedTarget
from engine.continuous_batching import Stream
from engine.sampling import Sampling
from target_model.hf_model import load_target_from_config, stop_token_ids

KEPT_FILE = "symbol_runs.jsonl"
SKIPPED_FILE = "symbol_runs.skipped.jsonl"
REASONS = ("context", "round_trip")
PUNCTUATION = frozenset(string.punctuation)
CONTINUED_SHARE = 0.9  # a continuation keeps the run when this share of its tokens is the run's token
RUN_CHECK = 8  # copies a symbol token's run must encode back to


class SymbolRunsError(ValueError):
    """A source file or config the step cannot use; the message names it and what to do."""


def symbol_tokens(tokenizer: Any, max_chars: int = 3) -> list[int]:
    """Every token whose text is 1..``max_chars`` punctuation characters, optionally after one space, and that
    encodes back to itself alone (so a run of it is a run of that one token)."""
    out = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        core = text[1:] if text.startswith(" ") else text
        if 1 <= len(core) <= max_chars and set(core) <= PUNCTUATION \
                and tokenizer.encode(text, add_special_tokens=False) == [i]:
            out.append(i)
    return out


def run_tokens(tokenizer: Any) -> list[int]:
    """The symbol tokens whose run's text encodes back to copies of the token (``<<`` twice is not ``<<<<``), so
    that a run written as text reads as the run the target wrote."""
    return [t for t in symbol_tokens(tokenizer)
            if tokenizer.encode(tokenizer.decode([t]) * RUN_CHECK, add_special_tokens=False) == [t] * RUN_CHECK]


def proposable(tokens: Sequence[int], init_from: str | None) -> list[int]:
    """The run tokens a warm start from ``init_from`` can draft (its ``t2d``; a warm start keeps its vocab map, and
    training scores only labels in the draft vocab), all of them when the drafter starts fresh."""
    if init_from is None:
        return list(tokens)
    t2d = load_draft_vocab(init_from)
    return [t for t in tokens if t < len(t2d) and bool(t2d[t])]


def continued(tokens: Sequence[int], run_token: int) -> bool:
    """Whether the target's continuation keeps the run for at least ``CONTINUED_SHARE`` of its tokens."""
    return bool(tokens) and sum(t == run_token for t in tokens) >= CONTINUED_SHARE * len(tokens)


def sample_key(seed: int, index: int) -> str:
    return f"runs-{seed}-{index:08d}"


def sample_index(key: str) -> int:
    return int(key.rsplit("-", 1)[1])


@dataclass(frozen=True)
class Answer:
    """An answer a sample may cut: the turns before it and its text."""

    messages: list[dict[str, Any]]
    content: str


def read_answers(path: Path) -> list[Answer]:
    """The first answer of each of ``path``'s conversations (regenerate's format) that is text: a run's
    continuation needs the answer as context, not the chat before it, and a short context keeps each sample cheap to
    train on. A line that is not a conversation is an error naming it; a conversation whose first answer made tool
    calls or holds no text has nothing to cut (not an error: it is no candidate)."""
    if not path.is_file():
        raise SymbolRunsError(f"data.symbol_runs.conversations: {path} is not a file; name a conversations.jsonl "
                              "regenerate wrote")
    answers = []
    for lineno, rec in iter_jsonl(path, SymbolRunsError, fix="name a conversations.jsonl regenerate wrote"):
        messages = rec.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise SymbolRunsError(f"{path}:{lineno}: not a conversation (messages with roles)")
        first = next((j for j, m in enumerate(messages) if m["role"] == "assistant" and j > 0), None)
        if first is not None and isinstance(messages[first].get("content"), str) and messages[first]["content"] \
                and not messages[first].get("tool_calls"):
            answers.append(Answer(messages[:first], messages[first]["content"]))
    if not answers:
        raise SymbolRunsError(f"data.symbol_runs.conversations: {path} holds no text answer to cut")
    return answers


@dataclass(frozen=True)
class Sample:
    """One sample's choices and the token ids the target continues."""

    key: str
    answer: Answer
    given: str  # the cut answer's text and the run: what the target was given of the answer
    run_token: int
    prompt_ids: list[int]
    round_trips: bool  # the prompt's text encodes to a prompt ending in the run's copies


def build_sample(tokenizer: Any, answers: Sequence[Answer], tokens: Sequence[int], s: SymbolRunsConfig,
                 template_kwargs: dict | None, index: int) -> Sample:
    """Sample ``index``: an answer, the token it is cut after, the run's token and length, all from its own seed."""
    rng = random.Random(f"{s.seed}:{index}")
    answer = answers[rng.randrange(len(answers))]
    offsets = tokenizer(answer.content, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    cut = offsets[rng.randrange(len(offsets))][1] if offsets else len(answer.content)
    token = tokens[rng.randrange(len(tokens))]
    length = rng.randint(s.min_run, s.max_run)
    given = answer.content[:cut] + tokenizer.decode([token]) * length
    marked = conversation_text(tokenizer, [*answer.messages, {"role": "assistant", "content": given + MARK}],
                               template_kwargs)
    ids = tokenizer.encode(marked[:marked.index(MARK)], add_special_tokens=False)
    return Sample(sample_key(s.seed, index), answer, given, token, ids, ids[-length:] == [token] * length)


def record(sample: Sample, text: str, finish_reason: str) -> dict[str, Any]:
    """The kept line: the conversation through the answer, its given part counted in ``given_chars``."""
    answer = {"role": "assistant", "content": sample.given + text, "given_chars": len(sample.given)}
    return {"id": sample.key, "source": "symbol-runs", "run_token": sample.run_token,
            "messages": [*sample.answer.messages, answer],
            "finish_reasons": [finish_reason]}


def read_done(kept_path: Path, skipped_path: Path, seed: int) -> tuple[set[int], int]:
    """The sample indices earlier runs made (both files, torn tails cut) and how many they kept; a line of another
    seed, or one that is not a sample, is an error naming it."""
    done, kept = set(), 0
    for path in (kept_path, skipped_path):
        if not path.exists():
            continue
        cut_torn_tail(path)
        for lineno, rec in iter_jsonl(path, SymbolRunsError, fix="the file is damaged: move it away and rerun"):
            key = rec.get("id")
            try:
                index = sample_index(key)
            except (AttributeError, ValueError):
                raise SymbolRunsError(f"{path}:{lineno}: a line that is not a symbol-run sample; the file is "
                                      "damaged: move it away and rerun") from None
            if key != sample_key(seed, index):
                raise SymbolRunsError(f"{path}:{lineno}: sample {key} is not of data.symbol_runs.seed {seed}; move "
                                      "the files away for a new seed, or set the seed back")
            done.add(index)
            kept += path == kept_path
    return done, kept


@dataclass
class SymbolRunsSummary:
    output: str
    wanted: int
    run_tokens: int = 0  # symbol tokens the runs are drawn from
    made: int = 0  # by this run
    kept: int = 0
    kept_before: int = 0
    continued: int = 0  # this run's kept samples whose continuation keeps the run
    skipped: Counter[str] = field(default_factory=Counter)  # this run's, by reason
    generated_tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "wanted": self.wanted, "run_tokens": self.run_tokens, "made": self.made,
                "kept": self.kept, "kept_before": self.kept_before, "continued": self.continued,
                "skipped": {r: self.skipped[r] for r in REASONS}, "generated_tokens": self.generated_tokens,
                "seconds": round(self.seconds, 1),
                "tokens_per_s": round(self.generated_tokens / self.seconds, 1) if self.seconds else None}

    def to_markdown(self) -> str:
        return "\n".join([
            f"## Symbol runs: {self.kept} kept of {self.wanted} samples -> {self.output}", "",
            "| run tokens | made | kept before | kept | run continued | " + " | ".join(REASONS) + " | tokens/s |",
            "|---" * (6 + len(REASONS)) + "|",
            f"| {self.run_tokens} | {self.made} | {self.kept_before} | {self.kept} | {self.continued} | "
            + " | ".join(str(self.skipped[r]) for r in REASONS) + f" | {self.to_dict()['tokens_per_s']} |"])

    __str__ = to_markdown


def run_symbol_runs(cfg: RunConfig) -> SymbolRunsSummary:
    """Make data.symbol_runs.count samples (those earlier runs made are kept), the target in-process."""
    s = cfg.data.symbol_runs
    if s is None:
        raise SymbolRunsError("data.symbol_runs: not set; give its conversations and count to write symbol runs")
    if cfg.regenerate.backend != "hf":
        raise SymbolRunsError(f"data.symbol_runs: needs regenerate.backend hf (the target in-process), not "
                              f"{cfg.regenerate.backend}: the run is given as tokens")
    cfg.root.mkdir(parents=True, exist_ok=True)
    kept_path, skipped_path = cfg.root / KEPT_FILE, cfg.root / SKIPPED_FILE
    done, kept_before = read_done(kept_path, skipped_path, s.seed)
    summary = SymbolRunsSummary(str(kept_path), s.count, kept=kept_before, kept_before=kept_before)
    todo = [i for i in range(s.count) if i not in done]
    if not todo:
        return summary
    answers = read_answers(Path(s.conversations))
    start = time.perf_counter()
    target = load_target_from_config(cfg.target)
    tok, kwargs = target.tokenizer, cfg.target.chat_template_kwargs
    tokens = proposable(run_tokens(tok), cfg.drafter.init_from)
    if not tokens:
        raise SymbolRunsError(f"target.name {cfg.target.name}: no symbol token whose run encodes back to copies of it"
                              + ("" if cfg.drafter.init_from is None else
                                 f" is in the draft vocab of drafter.init_from {cfg.drafter.init_from}"))
    summary.run_tokens = len(tokens)
    limit = context_limit(target.hf_config, cfg.regenerate.max_context_tokens)
    samples = {}
    with named_errors(kept_path), open(kept_path, "ab") as kf, open(skipped_path, "ab") as sf:
        kept_out, skipped_out = JsonlAppender(kf), JsonlAppender(sf)

        def skip(key: str, reason: str) -> None:
            summary.skipped[reason] += 1
            summary.made += 1
            skipped_out.append({"id": key, "reason": reason})

        for i in todo:
            sample = build_sample(tok, answers, tokens, s, kwargs, i)
            if limit is not None and len(sample.prompt_ids) + s.max_new_tokens > limit:
                skip(sample.key, "context")
            elif not sample.round_trips:
                skip(sample.key, "round_trip")
            else:
                samples[sample.key] = sample
        if samples:
            bar = tqdm(total=len(samples), desc="symbol runs", unit="sample")
            stream = Stream(BatchedTarget(target.model), stop_token_ids(tok), Sampling(seed=s.seed),
                            max_len=max(len(x.prompt_ids) for x in samples.values()) + s.max_new_tokens,
                            rows=cfg.regenerate.slots, cpu_rows=cfg.regenerate.batch_size, wanted=len(samples))
            for key, sample in samples.items():
                stream.submit(key, sample.prompt_ids, s.max_new_tokens)
            while stream.busy:
                for key, g in stream.poll():
                    sample = samples[key]
                    text = continuation(tok, [sample.run_token], g.tokens)
                    rec = record(sample, text, g.finish_reason)
                    whole = conversation_text(tok, rec["messages"], kwargs)
                    summary.generated_tokens += len(g.tokens)
                    bar.update(1)
                    wanted_ids = sample.prompt_ids + g.tokens
                    if tok.encode(whole, add_special_tokens=False)[:len(wanted_ids)] != wanted_ids:
                        skip(key, "round_trip")
                        continue
                    kept_out.append(rec)
                    summary.made += 1
                    summary.kept += 1
                    summary.continued += continued(g.tokens, sample.run_token)
            bar.close()
        kept_out.sync()
        skipped_out.sync()
    summary.seconds = time.perf_counter() - start
    if summary.made and summary.kept == summary.kept_before:
        raise StepFailed(f"data.symbol_runs: none of {summary.made} samples kept ({dict(summary.skipped)}); "
                         "lower max_new_tokens or cut shorter conversations", summary)
    return summary

"""Synthesize: prompts the target writes itself (Magpie, arXiv 2406.08464).

An instruction-tuned model given its chat template up to the start of a user turn writes a user's message:
the kind of request its own instruction tuning was made of. Answered by the same target (regenerate), these
prompts are data in the target's domain that never runs out, where a prompt corpus does (ShareGPT's 16k
prompts are all used by the shipped config).

With ``data.synthesize.follow_up`` (a conversations.jsonl regenerate wrote), draw ``i`` writes instead the user's
next turn after conversation ``i`` (data_prep/follow_ups.py): the kept record is that conversation with the new
turn, which regenerate answers. Draws that leave no room in the target's context for max_new_tokens are dropped.

Each draw ``i`` samples from its own seed (``data.synthesize.seed`` and the draw's key, the engine's
``request_seed``), so a resumed run makes the draws an unbroken one makes, up to the rounding another batch brings.
Draw ``i`` is written under system turn ``i % len(systems)`` (data.synthesize.systems, null: the template's own),
which steers its domain, and its user turn starts with ``turn_starts[i % len(turn_starts)]``, which steers what it
asks (the target writes the rest; the kept turn is both). The target runs in-process (regenerate.backend hf) or
behind OpenAI-compatible servers (openai: the prefix sent as a raw text completion that stops at the template's end
of turn, with the draw's seed). A draw is kept, or dropped under one reason: ``unfinished`` (no end of turn within
max_new_tokens), ``loop`` (regenerate's loop stop), ``short`` (fewer than min_chars characters), ``duplicate`` (the
same text as a kept one, whitespace aside), ``context`` (its prefix leaves no room for max_new_tokens). Kept prompts
go to ``run_dir/self_prompts.jsonl`` (OpenAI messages, one user turn or a followed-up conversation: list it in
data.sources, kind openai); every dropped draw to ``run_dir/self_prompts.dropped.jsonl`` with its reason, so a
resumed run knows which draws were made. Both are appended whole line by line; a torn last line is cut on resume.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from common.config import RunConfig, SynthesizeConfig
from common.files import JsonlAppender, cut_torn_tail, iter_jsonl, named_errors
from data_prep.backends import OpenAIChatBackend, context_limit
from data_prep.decontaminate import turn_key
from data_prep.follow_ups import FollowUps
from data_prep.step_failed import StepFailed, over_failure_share
from data_prep.user_turn import SynthesizeError, query_prefix, query_stop, server_prompt
from engine.batched import BatchedTarget
from engine.continuous_batching import Stream
from engine.loops import LoopStop
from engine.sampling import Sampling, request_seed
from target_model.hf_model import load_target_from_config, stop_token_ids, tokenizer_from_config

KEPT_FILE = "self_prompts.jsonl"
DROPPED_FILE = "self_prompts.dropped.jsonl"
REASONS = ("unfinished", "loop", "short", "duplicate", "context")
DRAWS_PER_PROMPT = 4  # draws made per prompt still wanted before the step gives up (a target that rarely ends a turn)


class FirstTurns:
    """Draw ``i`` opens a chat under system turn ``i % len(systems)`` (None: the template's own); draws never run
    out (``limit`` None)."""

    limit = None

    def __init__(self, systems: list[str | None], template_kwargs: dict[str, Any] | None):
        self.systems, self.template_kwargs = systems, template_kwargs
        self._prefixes: dict[int, str] = {}

    def prefix(self, tokenizer: Any, index: int) -> str:
        which = index % len(self.systems)
        if which not in self._prefixes:
            self._prefixes[which] = query_prefix(tokenizer, self.template_kwargs, self.systems[which])
        return self._prefixes[which]

    def follows(self, index: int) -> None:
        return None

    def record(self, key: str, index: int, text: str) -> dict[str, Any]:
        """The kept line: the user's turn alone (the system turn only steered it)."""
        return {"id": key, "source": "self", "messages": [{"role": "user", "content": text}]}

    def kept_key(self, index: int, text: str) -> str:
        return turn_key(text)


Openings = FirstTurns | FollowUps  # what each draw continues


def openings_of(cfg: RunConfig) -> Openings:
    s = cfg.data.synthesize
    assert s is not None
    kwargs = cfg.target.chat_template_kwargs
    if s.follow_up is None:
        return FirstTurns(s.systems, kwargs)
    follow_ups = FollowUps(s.follow_up, kwargs)
    if follow_ups.limit < s.count:
        raise SynthesizeError(f"data.synthesize.count: {s.count} follow-ups asked of the {follow_ups.limit} "
                              f"conversations of follow_up {s.follow_up} (one each); lower count")
    return follow_ups


def turn_start(starts: Sequence[str], index: int) -> str:
    """The words draw ``index``'s user turn starts with."""
    return starts[index % len(starts)]


def draw_prefix(openings: Openings, tokenizer: Any, starts: Sequence[str], index: int) -> str:
    """The text draw ``index`` continues: its opening's template text, then its turn start."""
    return openings.prefix(tokenizer, index) + turn_start(starts, index)


def continuation(tokenizer: Any, lead: list[int], tokens: list[int]) -> str:
    """The text ``tokens`` add after a prompt ending in the tokens ``lead``: decoded after them, so that a tokenizer
    which drops a text's leading space (SentencePiece's) keeps the one between a turn's start and what follows."""
    if not lead:
        return tokenizer.decode(tokens, skip_special_tokens=True)
    before = tokenizer.decode(lead, skip_special_tokens=True)
    return tokenizer.decode(lead + tokens, skip_special_tokens=True)[len(before):]


def draw_key(seed: int, index: int) -> str:
    return f"self-{seed}-{index:08d}"


def draw_index(key: str) -> int:
    return int(key.rsplit("-", 1)[1])


@dataclass
class SynthesizeSummary:
    output: str
    wanted: int
    follow_up: str | None = None  # the conversations the prompts follow up, when they do
    kept: int = 0
    drawn: int = 0  # by this run
    kept_before: int = 0  # by earlier runs (resumed)
    dropped: Counter[str] = field(default_factory=Counter)  # this run's, by reason
    failed: Counter[str] = field(default_factory=Counter)  # draws a server failed, by reason (made again next run)
    first_failure: str | None = None
    generated_tokens: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"output": self.output, "wanted": self.wanted, "follow_up": self.follow_up, "kept": self.kept,
                "kept_before": self.kept_before,
                "drawn": self.drawn, "dropped": {r: self.dropped[r] for r in REASONS}, "failed": dict(self.failed),
                "first_failure": self.first_failure,
                "generated_tokens": self.generated_tokens, "seconds": round(self.seconds, 1),
                "tokens_per_s": round(self.generated_tokens / self.seconds, 1) if self.seconds else None}

    def to_markdown(self) -> str:
        return "\n".join([
            f"## Synthesize: {self.kept} of {self.wanted} prompts -> {self.output}", "",
            "| drawn | kept before | kept | " + " | ".join(REASONS) + " | tokens/s |",
            "|---" * (4 + len(REASONS)) + "|",
            f"| {self.drawn} | {self.kept_before} | {self.kept} | " + " | ".join(str(self.dropped[r]) for r in REASONS)
            + f" | {self.to_dict()['tokens_per_s']} |"])

    __str__ = to_markdown

    @property
    def failures(self) -> int:
        return sum(self.failed.values())

    @property
    def tried(self) -> int:
        """This run's draws, failed ones included."""
        return self.drawn + self.failures


@dataclass
class Draws:
    """What earlier runs drew: the kept prompts' texts (for duplicates), the draws' indices, and the next new one."""

    kept: set[str] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    next_index: int = 0

    def keys(self, seed: int, n: int, limit: int | None = None) -> list[str]:
        """``n`` draws: first those a killed run left in flight (below next_index, never written), then new ones
        (below ``limit``, the draws there can be, when there is one), so a resumed run draws the keys an unbroken
        one draws."""
        left = [i for i in range(self.next_index) if i not in self.done][:n]
        end = self.next_index + n - len(left)
        fresh = list(range(self.next_index, end if limit is None else min(end, limit)))
        self.next_index += len(fresh)
        return [draw_key(seed, i) for i in left + fresh]


def read_draws(kept_path: Path, dropped_path: Path, seed: int, openings: Openings,
               starts: Sequence[str] = ("",)) -> Draws:
    """Both files read after their torn last lines are cut; a whole line that is not a draw, a draw of another
    seed (its prompts would count towards this one's), a follow-up of another conversation than its draw's, or a
    turn that does not begin with its draw's start (``starts``: data.synthesize.turn_starts) is an error naming
    it."""
    draws = Draws()
    for path in (kept_path, dropped_path):
        if not path.exists():
            continue
        cut_torn_tail(path)
        for lineno, rec in iter_jsonl(path, SynthesizeError, fix="the file is damaged: move it away and rerun"):
            try:
                index = draw_index(rec["id"])
                if openings.limit is not None and not 0 <= index < openings.limit:
                    raise SynthesizeError(f"{path}:{lineno}: draw {rec['id']} is past the {openings.limit} "
                                          "conversations of data.synthesize.follow_up; move the files away for "
                                          "another follow_up, or name the same one")
                if path == kept_path:
                    if rec.get("follows") != openings.follows(index):
                        raise SynthesizeError(f"{path}:{lineno}: draw {rec['id']} follows {rec.get('follows')!r}, "
                                              f"not {openings.follows(index)!r} as data.synthesize.follow_up has it; "
                                              "move the files away for another follow_up, or name the same one")
                    text, start = rec["messages"][-1]["content"], turn_start(starts, index)
                    if not text.startswith(start):
                        raise SynthesizeError(f"{path}:{lineno}: draw {rec['id']} does not start with {start!r}, "
                                              f"data.synthesize.turn_starts[{index % len(starts)}]; move the files "
                                              "away for other turn_starts, or set them back")
                    draws.kept.add(openings.kept_key(index, text))
            except SynthesizeError:
                raise
            except (ValueError, KeyError, TypeError, IndexError, AttributeError):
                raise SynthesizeError(f"{path}:{lineno}: a whole line that is not a synthesized draw; the file is "
                                      "damaged: move it away and rerun") from None
            if rec["id"] != draw_key(seed, index):
                raise SynthesizeError(f"{path}:{lineno}: draw {rec['id']} is not of data.synthesize.seed {seed}; "
                                      "move the files away for a new seed, or set the seed back")
            draws.done.add(index)
            draws.next_index = max(draws.next_index, index + 1)
    return draws


def verdict(text: str, finish_reason: str, s: SynthesizeConfig, kept: set[str], key: str) -> str | None:
    """Why a draw is dropped (one of REASONS), or None to keep it. ``key``: the draw's kept key (its openings'
    ``kept_key``), ``kept`` those of the prompts kept so far."""
    if finish_reason == "length":
        return "unfinished"
    if finish_reason in ("loop", "context"):
        return finish_reason
    if len(text.strip()) < s.min_chars:
        return "short"
    if key in kept:
        return "duplicate"
    return None


Draw = tuple[str, str, str, int, str | None]  # key, text, finish reason, tokens, error (a server's failure)


def fitting(keys: list[str], lengths: list[int], max_new_tokens: int, limit: int | None
            ) -> tuple[list[int], list[Draw]]:
    """The indices into ``keys`` of the draws whose prefix of ``lengths`` tokens leaves room for max_new_tokens
    within the target's context (``limit``, None: no limit known), and a "context" draw for each of the others."""
    if limit is None:
        return list(range(len(keys))), []
    room = [n + max_new_tokens <= limit for n in lengths]
    return ([i for i, ok in enumerate(room) if ok],
            [(key, "", "context", 0, None) for key, ok in zip(keys, room, strict=True) if not ok])


class HFDrawer:
    """The target in-process, loaded once; each round of draws is one engine run over the draws' prefixes."""

    gave_up = False  # an engine raises rather than failing a draw

    def __init__(self, cfg: RunConfig, openings: Openings):
        self.cfg, self.openings = cfg, openings
        target = load_target_from_config(cfg.target)
        self.tok = target.tokenizer
        self.engine = BatchedTarget(target.model)
        self.max_context = context_limit(target.hf_config, cfg.regenerate.max_context_tokens)
        # the tokenizer's EOS and ChatML's end of turn, and the template's own end-of-turn marker when it is a token
        marker = self.tok(query_stop(self.tok, cfg.target.chat_template_kwargs), add_special_tokens=False)["input_ids"]
        self.stop_ids = sorted(set(stop_token_ids(self.tok)) | (set(marker) if len(marker) == 1 else set()))

    def draw(self, keys: list[str]) -> Iterator[Draw]:
        """Each draw as the engine finishes it (first those whose prefix leaves no room in the context)."""
        s, r = self.cfg.data.synthesize, self.cfg.regenerate
        assert s is not None
        indices = [draw_index(key) for key in keys]
        rendered = [draw_prefix(self.openings, self.tok, s.turn_starts, i) for i in indices]
        prefixes = self.tok(rendered, add_special_tokens=False)["input_ids"]
        lead = {key: ids[-1:] if turn_start(s.turn_starts, i) else []  # the start's last token, when there is one
                for key, i, ids in zip(keys, indices, prefixes, strict=True)}
        room, no_room = fitting(keys, list(map(len, prefixes)), s.max_new_tokens, self.max_context)
        yield from no_room
        if not room:
            return
        loops = LoopStop(r.loop_min_repeat_tokens, r.loop_max_period) if r.stop_loops else None
        stream = Stream(self.engine, self.stop_ids, Sampling(s.temperature, s.top_p, None, s.seed),
                        max_len=max(len(prefixes[i]) for i in room) + s.max_new_tokens, rows=r.slots,
                        cpu_rows=r.batch_size, wanted=len(room), loops=loops)
        for i in room:
            stream.submit(keys[i], prefixes[i], s.max_new_tokens)
        while stream.busy:
            finished = stream.poll()
            for key, g in finished:
                yield key, continuation(self.tok, lead[key], g.tokens), g.finish_reason, len(g.tokens), None


class ServerDrawer:
    """The target behind OpenAI-compatible servers (regenerate.backend openai: SGLang, vLLM, llama.cpp): the
    prefix, rendered here with the target's tokenizer, is sent as a raw text completion that stops at the
    template's end of turn; each draw sends its own seed. A loop is cut afterwards (the backend's, as for answers).
    The context is known here only as regenerate.max_context_tokens."""

    gave_up = False  # regenerate.max_consecutive_failures draws in a row failed: a dead server

    def __init__(self, cfg: RunConfig, openings: Openings):
        self.cfg, self.openings = cfg, openings
        t = cfg.target
        self.tok = tokenizer_from_config(t)
        self.stop = query_stop(self.tok, t.chat_template_kwargs)
        self.backend = OpenAIChatBackend(cfg.regenerate, t.chat_template_kwargs, t, tokenizer=self.tok)

    def draw(self, keys: list[str]) -> Iterator[Draw]:
        """Each draw, in order, as the servers answer: ``batch_size`` requests at a time, none after
        ``max_consecutive_failures`` draws in a row failed (``gave_up``)."""
        s, r = self.cfg.data.synthesize, self.cfg.regenerate
        assert s is not None
        in_a_row = 0
        for start in range(0, len(keys), self.backend.batch_size):
            part = keys[start:start + self.backend.batch_size]
            prompts = [server_prompt(self.tok, draw_prefix(self.openings, self.tok, s.turn_starts, draw_index(key)))
                       for key in part]
            lengths = ([len(x) for x in self.tok(prompts, add_special_tokens=False)["input_ids"]]
                       if r.max_context_tokens else [0] * len(part))
            room, no_room = fitting(part, lengths, s.max_new_tokens, r.max_context_tokens)
            yield from no_room
            bodies = ({"prompt": prompts[i], "max_tokens": s.max_new_tokens, "temperature": s.temperature,
                       "top_p": s.top_p, "seed": request_seed(s.seed, part[i]) & 0x7FFFFFFF, "stop": [self.stop]}
                      for i in room)
            for i, c in zip(room, self.backend.complete_text(bodies), strict=True):
                in_a_row = in_a_row + 1 if c.error else 0
                yield part[i], c.text, c.finish_reason, c.tokens or 0, c.error and f"{c.error}: {c.detail}"
            if in_a_row >= r.max_consecutive_failures:
                self.gave_up = True
                return

    def close(self) -> None:
        self.backend.close()


def run_synthesize(cfg: RunConfig) -> SynthesizeSummary:
    """Draw until data.synthesize.count prompts are kept (at most DRAWS_PER_PROMPT draws per prompt wanted). A draw
    a server failed is not written, and is made again in the next round; as in regenerate, the step stops and fails
    after regenerate.max_consecutive_failures failures in a row, or once more than max_failure_share of its draws
    failed (what it kept stays; the rerun goes on)."""
    s = cfg.data.synthesize
    if s is None:
        raise SynthesizeError("data.synthesize: not set; give its count (and seed) to have the target write prompts")
    cfg.root.mkdir(parents=True, exist_ok=True)
    kept_path, dropped_path = cfg.root / KEPT_FILE, cfg.root / DROPPED_FILE
    openings = openings_of(cfg)
    draws = read_draws(kept_path, dropped_path, s.seed, openings, s.turn_starts)
    summary = SynthesizeSummary(str(kept_path), s.count, kept=len(draws.kept), kept_before=len(draws.kept),
                                follow_up=s.follow_up)
    if summary.kept >= s.count:
        return summary
    start = time.perf_counter()
    drawer = HFDrawer(cfg, openings) if cfg.regenerate.backend == "hf" else ServerDrawer(cfg, openings)
    budget = DRAWS_PER_PROMPT * (s.count - summary.kept)
    too_many = exhausted = False
    try:
        with named_errors(kept_path), open(kept_path, "ab") as kf, open(dropped_path, "ab") as df:
            kept_out, dropped_out = JsonlAppender(kf), JsonlAppender(df)
            bar = tqdm(total=s.count, initial=summary.kept, desc="synthesize", unit="prompt")
            while summary.kept < s.count and budget > 0 and not too_many:
                keys = draws.keys(s.seed, min(budget, s.count - summary.kept), openings.limit)  # at most as wanted
                if not keys:  # every conversation to follow up was drawn
                    exhausted = True
                    break
                budget -= len(keys)
                for key, text, reason, tokens, error in drawer.draw(keys):
                    if error is not None:
                        summary.failed[error.split(":")[0]] += 1
                        summary.first_failure = summary.first_failure or error
                        continue
                    summary.drawn += 1
                    summary.generated_tokens += tokens
                    index = draw_index(key)
                    text = (turn_start(s.turn_starts, index) + text).strip()
                    kept_key = openings.kept_key(index, text)
                    if (why := verdict(text, reason, s, draws.kept, kept_key)) is None:
                        draws.kept.add(kept_key)
                        kept_out.append(openings.record(key, index, text))
                        summary.kept += 1
                        bar.update(1)
                    else:
                        summary.dropped[why] += 1
                        dropped_out.append({"id": key, "reason": why})
                    draws.done.add(index)
                too_many = drawer.gave_up or over_failure_share(summary.failures, summary.tried,
                                                                   cfg.regenerate.max_failure_share)
            bar.close()
            kept_out.sync()
            dropped_out.sync()
    finally:
        if isinstance(drawer, ServerDrawer):
            drawer.close()
    summary.seconds = time.perf_counter() - start
    if not any(Path(src.path).resolve() == kept_path.resolve() for src in cfg.data.sources):
        print(f"data_prep synthesize: note: {kept_path} is not in data.sources, so ingest will not read it; add "
              "{kind: openai, path: <it>} there", file=sys.stderr)
    if too_many:
        raise StepFailed(f"data.synthesize: {summary.failures} of {summary.tried} draws failed "
                         f"({dict(summary.failed)}; first: {summary.first_failure}); rerun to make them again", summary)
    if summary.kept < s.count and exhausted:
        keep = (f"set data.synthesize.count to {summary.kept} to keep these (a rerun draws nothing again), or "
                if summary.kept else "")
        raise StepFailed(f"data.synthesize: {summary.kept} of {s.count} follow-ups: each of the {openings.limit} "
                         f"conversations of follow_up was drawn once (dropped: {dict(summary.dropped)}); {keep}"
                         "follow up a longer file", summary)
    if summary.kept < s.count:
        raise StepFailed(f"data.synthesize: {summary.kept} of {s.count} prompts after {summary.drawn} draws "
                         f"(dropped: {dict(summary.dropped)}); raise max_new_tokens or lower min_chars"
                         + ("" if openings.limit is None else ", or follow up more conversations"), summary)
    return summary

"""Chat backends for regeneration: the target in-process (``hf``) or any OpenAI-compatible server
(``openai``: SGLang, vLLM, llama.cpp) behind one interface, so the regeneration loop is the same.

A backend never raises for one bad record: it returns a ``Completion`` whose ``error`` names the
reason, and the caller counts it and leaves the record for the next run.

With ``regenerate.stop_loops`` an answer that ends in a degenerate loop (``engine.loops``) is cut to the
loop's first copy, finish reason "loop": the hf engine stops it while it decodes; a server cannot, so the
openai backend cuts the answer it gets back, by the target's tokens.
"""

from __future__ import annotations

import dataclasses
import http.client
import itertools
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from common import redact
from common.config import RegenerateConfig, TargetConfig
from data_prep.loss_mask import prompt_text
from data_prep.prompt_ids import PromptTokenizer
from data_prep.prompt_prefetch import Encoded, PromptPrefetch
from engine.loops import LoopStop, first_repeat, retokenized_loop_start
from engine.profile import EngineProfile

Chat = list[dict[str, Any]]  # OpenAI messages (data_prep.readers.Messages)
Tools = list[dict[str, Any]] | None  # OpenAI tool definitions offered in one chat
MAX_BACKOFF_S = 60.0
# A refused connection means nothing listens there: no backoff helps. Each server gets this many quick
# tries per request (a server restarting its listener), then the request fails as "connection_refused".
REFUSED_TRIES_PER_SERVER = 2
REFUSED_RETRY_S = 0.2
ERROR_BODY_BYTES = 1 << 16  # read this much of an error body, redact it, then keep 200 characters
CONTEXT_FULL = "context_full"  # finish reason of a chat whose prompt already fills the target's context


def context_limit(hf_config: Any, max_context_tokens: int | None) -> int | None:
    """The positions a prompt and its answer share: the target's own (max_position_embeddings) or
    regenerate.max_context_tokens, the lower; None when neither is known."""
    limits = [getattr(hf_config, "max_position_embeddings", None), max_context_tokens]
    return min((x for x in limits if x), default=None)


class BackendError(ValueError):
    """A backend that cannot start (bad URL, missing API key); the message is for the user."""


@dataclass
class Completion:
    text: str = ""
    finish_reason: str = ""  # "stop" | "length" | "tool_calls" | what the server said; "" when error is set
    error: str | None = None  # failure reason key, e.g. "http_400", "timeout", "connection"
    detail: str = ""
    reasoning: str | None = None  # the server's reasoning_content (thinking), kept apart as the server sends it
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI tool calls the answer makes
    # finish_reason "loop": the answer's tokens when its loop was found, and the tokens kept (through its first copy)
    loop_tokens: tuple[int, int] | None = None
    tokens: int | None = None  # the answer's tokens (hf: generated and kept; openai: the server's usage, if sent)

    def message(self) -> dict[str, Any]:
        """The assistant turn as the next request (and the chat template) takes it back."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class ChatBackend(Protocol):
    name: str
    batch_size: int  # how many chats one ``complete`` call should get

    def complete(self, batch: list[Chat], tools: list[Tools] | None = None) -> list[Completion]:
        """One completion per chat; ``tools[i]`` (when given) are the tools offered to chat i."""
        ...


class HFChatBackend:
    """The target in-process, through continuous batching over a paged KV cache
    (``engine.continuous_batching``): at T=0 each answer is the target's greedy answer to that chat
    alone, and the GPU stays full while answers of very different lengths finish. ``stream`` is one engine run
    for a whole regeneration: a conversation's next turn joins the running batch when its previous answer
    ends. Chats are rendered as the server renders them (the target's chat_template_kwargs, the chat's tools).
    Its answer is raw text: separating reasoning and parsing tool calls are the server's parsers (SGLang's
    --reasoning-parser/--tool-call-parser), so thinking and agentic data come through the openai backend."""

    name = "hf"

    def __init__(self, target_cfg: TargetConfig, cfg: RegenerateConfig):
        import torch

        from engine.batched import BatchedTarget, UnsupportedTargetError
        from target_model.hf_model import load_target_from_config, pick_device, stop_token_ids

        # Where its seconds go (``backend_s`` in the summary's phases, split): a device's share of a several-device
        # run pays them whole, so they bound what more devices can save.
        t0 = time.perf_counter()
        device = pick_device(target_cfg.device)
        if device.type == "cuda":
            torch.zeros(1, device=device)  # the CUDA context, timed on its own
        t1 = time.perf_counter()
        loading: dict[str, float] = {}
        self.target = load_target_from_config(target_cfg, loading)
        t2 = time.perf_counter()
        self.template_kwargs = target_cfg.chat_template_kwargs
        try:
            self.engine = BatchedTarget(self.target.model)
        except UnsupportedTargetError as e:
            raise BackendError(f"regenerate.backend hf: {target_cfg.name}: {e}") from None
        self.build_s = {"cuda_context_s": round(t1 - t0, 2), "target_s": round(t2 - t1, 2), "target_s_by_part": loading,
                        "engine_s": round(time.perf_counter() - t2, 2)}
        self.tok = self.target.tokenizer
        self.cfg = cfg
        self.batch_size = cfg.batch_size
        self.stop_ids = stop_token_ids(self.tok)
        self.max_context = context_limit(self.target.hf_config, cfg.max_context_tokens)

    def stream(self, wanted: int | None = None, profile: EngineProfile | None = None) -> HFChatStream:
        """An engine run that chats can be submitted to while it answers (``wanted``: chats expected, so a
        short run does not size rows for thousands; ``profile``: where its seconds go, measured into it)."""
        return HFChatStream(self, wanted, profile)

    def complete(self, batch: list[Chat], tools: list[Tools] | None = None) -> list[Completion]:
        stream = self.stream(len(batch))
        stream.submit([(i, chat, t) for i, (chat, t) in enumerate(zip(batch, tools or [None] * len(batch),
                                                                      strict=True))])
        results: list[Completion | None] = [None] * len(batch)
        for finished in stream.results():
            for i, completion in finished:
                results[i] = completion
        return results  # type: ignore[return-value]


class HFChatStream:
    """Chats in (each a conversation's next turn: ``submit``), completions out as they finish (``results``):
    one ``continuous_batching.Stream`` over the whole regeneration. A chat with no room left for an answer in
    the target's context is answered ``context_full`` at once, without the engine. A conversation's next prompt
    is tokenized from its previous one's ids (``PromptTokenizer``), kept from its submit until the poll after its
    answer came out: the window in which its follow-up is submitted. With a ``profile`` the caller's seconds in
    it (rendering, tokenizing, detokenizing) are measured too."""

    LONGEST_ROW = 32768  # positions per row when the target names no context length

    def __init__(self, backend: HFChatBackend, wanted: int | None = None, profile: EngineProfile | None = None):
        from engine.continuous_batching import Stream
        from engine.sampling import Sampling
        from engine.sizing import MAX_ROWS

        c = backend.cfg
        self.b = backend
        self.max_len = backend.max_context or self.LONGEST_ROW
        self.max_new_tokens = c.max_new_tokens  # an answer's budget, cut to the room its prompt leaves
        loops = LoopStop(c.loop_min_repeat_tokens, c.loop_max_period, keep=c.loop_keep_tokens) if c.stop_loops else None
        self.engine = Stream(backend.engine, backend.stop_ids, Sampling(c.temperature, c.top_p, c.top_k, c.seed),
                             max_len=self.max_len, rows=c.slots, cpu_rows=c.batch_size, wanted=wanted or MAX_ROWS,
                             loops=loops, profile=profile)
        self.profile = profile
        self.ready: deque[tuple[Hashable, Completion]] = deque()
        self.prompts = PromptTokenizer(backend.tok)
        self.ahead: PromptPrefetch | None = None  # first prompts encoded on a thread (``prefetch``)
        self.sent: dict[Hashable, tuple[str, list[int]]] = {}  # in the engine: the prompt's text and ids
        self.answered: dict[Hashable, tuple[str, list[int]]] = {}  # answered by the last poll: the same

    @property
    def rows(self) -> int:
        return self.engine.rows

    @property
    def wants(self) -> int:
        """How many more chats to queue: enough for every free row and the next refill; while first prompts
        are being prefetched, no more than are ready (at least a chunk: the first forward waits only for it)."""
        e = self.engine
        wanted = e.free_rows + e.refill_at - e.waiting - len(self.ready)
        if self.ahead is not None and not self.ahead.finished:
            wanted = min(wanted, max(self.ahead.ready, PromptPrefetch.CHUNK))
        return wanted

    def prefetch(self, keys: Sequence[Hashable], chats: Iterable[tuple[Chat, Tools]]) -> None:
        """The first chat of each key, in the order they will be submitted (``chats`` is read on the thread,
        lazily), rendered and tokenized on a thread with its own copy of the tokenizer (a fast tokenizer is
        not to be shared between threads)."""
        import copy

        tok, kwargs = copy.deepcopy(self.b.tok), self.b.template_kwargs

        def encode(batch: list[tuple[Chat, Tools]]) -> list[Encoded]:
            texts = [prompt_text(tok, chat, kwargs, tools or None) for chat, tools in batch]
            return list(zip(texts, tok(texts, add_special_tokens=False)["input_ids"], strict=True))

        self.ahead = PromptPrefetch(keys, chats, encode)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.stop()

    def submit(self, items: list[tuple[Hashable, Chat, Tools]]) -> None:
        """Queue (key, chat, tools) items; rendered and tokenized together (a first chat prefetched is taken
        as it is). A conversation's turns share its key, so a chat submitted under the key of an answer just
        handed out continues in that answer's row: the engine prefills only what follows the ids it holds
        (``Stream.submit``'s ``continue_from``)."""
        if not items:
            return
        previous = [self.answered.pop(key, None) for key, _, _ in items]
        encoded: list[Encoded | None] = [None] * len(items)
        if self.ahead is not None:
            encoded = [self.ahead.take(key) if p is None else None
                       for (key, _, _), p in zip(items, previous, strict=True)]
        rest = [i for i, e in enumerate(encoded) if e is None]
        t0 = time.perf_counter()
        texts = [prompt_text(self.b.tok, items[i][1], self.b.template_kwargs, items[i][2] or None) for i in rest]
        t1 = time.perf_counter()
        for i, text, x in zip(rest, texts, self.prompts.encode(texts, [previous[i] for i in rest]), strict=True):
            encoded[i] = (text, x)
        if self.profile is not None:  # of the engine's caller_s (the host outside its polls)
            self.profile.add_caller("render_s", t1 - t0)
            self.profile.add_caller("tokenize_s", time.perf_counter() - t1)
        for (key, _, _), (text, x) in zip(items, encoded, strict=True):  # type: ignore[misc]
            max_new_tokens = min(self.max_new_tokens, self.max_len - len(x))
            if max_new_tokens > 0:
                self.engine.submit(key, x, max_new_tokens, continue_from=key)
                self.sent[key] = (text, x)
            else:  # no room left for another answer
                self.ready.append((key, Completion(finish_reason=CONTEXT_FULL)))

    def results(self) -> Iterator[list[tuple[Hashable, Completion]]]:
        """The (key, completion) pairs that finished together (one engine poll's, or chats answered without the
        engine), until nothing is queued or running; chats submitted meanwhile are answered in the same run.
        Together, so that the caller submits their follow-ups in one batch: one tokenizer call for many costs the
        host far less than one call each."""
        while self.ready or self.engine.busy:
            if self.ready:  # taken before the caller sees them: what it submits meanwhile may join ``ready``
                answered = list(self.ready)
                self.ready.clear()
                yield answered
            self.answered.clear()  # their follow-ups came while the last poll's answers were handed out
            finished = self.engine.poll()
            if not finished:
                if self.ahead is not None and self.ahead.ready and self.engine.free_rows:
                    yield []  # prefetched first prompts wait and rows are free: the caller opens more now
                continue
            for key, _ in finished:
                if key in self.sent:
                    self.answered[key] = self.sent.pop(key)
            t0 = time.perf_counter()
            texts = self.b.tok.batch_decode([g.tokens for _, g in finished], skip_special_tokens=True)
            if self.profile is not None:
                self.profile.add_caller("detokenize_s", time.perf_counter() - t0)
            yield [(key, Completion(text=text, finish_reason=g.finish_reason, tokens=len(g.tokens),
                                    loop_tokens=(g.generated, len(g.tokens)) if g.finish_reason == "loop" else None))
                   for (key, g), text in zip(finished, texts, strict=True)]

    def tokens_per_s(self) -> float:
        return self.engine.tokens_per_s()

    def stats(self) -> dict[str, Any]:
        ahead = self.ahead.stats() if self.ahead is not None else {}
        return {**self.engine.stats(), **self.prompts.stats(), **ahead, "backend_s_by_part": self.b.build_s}


def chat_url(base: str) -> str:
    """``http://host:port``, ``.../v1`` or the full endpoint -> the chat completions endpoint."""
    if not base.startswith(("http://", "https://")):
        raise BackendError(f"regenerate.server_urls: {base!r} is not an http(s) URL")
    base = base.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


def text_url(base: str) -> str:
    """The same server's text completions endpoint (a raw prompt continued, no chat template applied)."""
    return chat_url(base).removesuffix("/chat/completions") + "/completions"


class _Retryable(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class OpenAIChatBackend:
    """Requests spread round-robin over the servers by a bounded thread pool; transient failures
    (timeouts, 5xx, 429, reset/dropped connections) are retried with exponential backoff, the next
    attempt going to the next server; other 4xx fail the record at once. A refused connection is retried
    at once on the next server, and after every server refused it twice the record fails: a run against
    a port where nothing listens ends in seconds, not in hours of backoff.

    The API key (``regenerate.api_key_env``) is only ever sent in the header; error details and answers
    pass through ``common.redact`` before anyone sees or stores them (a server may echo the header).

    With ``stop_loops``, an answer that ends in a loop is cut afterwards (``cut_loop``), by the tokens of the
    target's tokenizer (``target``; loaded at the first answer that may loop)."""

    name = "openai"

    def __init__(self, cfg: RegenerateConfig, chat_template_kwargs: dict[str, Any] | None = None,
                 target: TargetConfig | None = None, tokenizer: Any = None):
        self.cfg = cfg
        self.template_kwargs = chat_template_kwargs or {}
        self.target = target
        self._tokenizer: Any = tokenizer  # the target's, when the caller has it loaded already
        self.urls = [chat_url(u) for u in cfg.server_urls]
        self.text_urls = [text_url(u) for u in cfg.server_urls]
        if not self.urls:
            raise BackendError("regenerate.server_urls: backend 'openai' needs at least one server URL")
        self.headers = {"Content-Type": "application/json"}
        if cfg.api_key_env:
            key = os.environ.get(cfg.api_key_env)
            if not key:
                raise BackendError(f"regenerate.api_key_env: environment variable {cfg.api_key_env} is not set")
            redact.register(key)
            self.headers["Authorization"] = f"Bearer {key}"
        self.batch_size = max(cfg.batch_size, cfg.concurrency)
        self._next = itertools.cycle(range(len(self.urls)))
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(cfg.concurrency, thread_name_prefix="regen")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def body(self, chat: Chat, tools: Tools = None) -> dict[str, Any]:
        c = self.cfg
        body: dict[str, Any] = {"model": c.model, "messages": chat, "temperature": c.temperature,
                                "top_p": c.top_p, "max_tokens": c.max_new_tokens, "seed": c.seed}
        if c.top_k is not None:
            body["top_k"] = c.top_k
        if tools:
            body["tools"] = tools
        if self.template_kwargs:
            body["chat_template_kwargs"] = self.template_kwargs
        return body

    def complete(self, batch: list[Chat], tools: list[Tools] | None = None) -> list[Completion]:
        out = list(self._pool.map(lambda chat, t: self._one(json.dumps(self.body(chat, t)).encode()), batch,
                                  tools or [None] * len(batch)))
        return [self.cut_loop(c) for c in out] if self.cfg.stop_loops else out

    def complete_text(self, bodies: Iterable[dict[str, Any]]) -> Iterator[Completion]:
        """Text completions of raw prompts (``bodies``: the request bodies, model added), in order, as they come
        back; the same retries, failures and loop cuts as chats. What a server offers to continue a template by
        hand."""
        out = self._pool.map(lambda body: self._one(json.dumps({"model": self.cfg.model, **body}).encode(),
                                                    text=True), bodies)
        return (self.cut_loop(c) for c in out) if self.cfg.stop_loops else out

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.target is None:
                raise BackendError("regenerate.stop_loops: the openai backend needs the target's tokenizer to cut "
                                   "loops (target.name)")
            from target_model.hf_model import tokenizer_from_config

            try:
                self._tokenizer = tokenizer_from_config(self.target)
            except ValueError as e:  # the TargetError naming target.name, or resolve_source's
                raise BackendError(f"{e}; or set regenerate.stop_loops: false (the openai backend loads the "
                                   "tokenizer only to cut loops)") from None
        return self._tokenizer

    def cut_loop(self, c: Completion) -> Completion:
        """The answer cut to its loop's first copy (finish reason "loop") when its tail loops: its content, or
        its reasoning when it has no content (the end of what the target generated); an answer with tool calls
        ended in them and is left alone."""
        part = "text" if c.text else "reasoning"
        text = getattr(c, part) or ""
        m, p = self.cfg.loop_min_repeat_tokens, self.cfg.loop_max_period
        # m repeated tokens are m bytes or more, holding (m - 6) // 4 whole characters that occur twice: an answer
        # without such a repeat cannot end in a loop, and most answers need no tokenizer
        if c.error or c.tool_calls or first_repeat(text, max(1, (m - 6) // 4)) is None:
            return c
        cut = cut_text_loop(self.tokenizer(), text, m, p, self.cfg.loop_keep_tokens)
        if cut is None:
            return c
        kept, tokens, kept_tokens = cut
        return dataclasses.replace(c, **{part: kept}, finish_reason="loop", loop_tokens=(tokens, kept_tokens),
                                   tokens=kept_tokens if c.tokens is not None else None)

    def _url(self, text: bool = False) -> str:
        with self._lock:
            return (self.text_urls if text else self.urls)[next(self._next)]

    def _one(self, data: bytes, text: bool = False) -> Completion:
        refused, backoffs = 0, 0
        for attempt in range(self.cfg.max_retries + 1):
            try:
                return self._post(self._url(text), data, text)
            except _Retryable as e:
                last = e
            if last.reason == "connection_refused":
                refused += 1
                if refused >= REFUSED_TRIES_PER_SERVER * len(self.urls):
                    return Completion(error=last.reason, detail=f"{last.detail} (every server refused the "
                                      f"connection {REFUSED_TRIES_PER_SERVER}x: is it running, on that port?)")
                if attempt < self.cfg.max_retries:
                    time.sleep(REFUSED_RETRY_S)
                continue
            if attempt < self.cfg.max_retries:
                delay = min(MAX_BACKOFF_S, self.cfg.retry_backoff_s * 2 ** backoffs)
                backoffs += 1
                time.sleep(delay * (1 + 0.25 * random.random()))
        return Completion(error=last.reason, detail=f"{last.detail} (gave up after {attempt + 1} attempts)")

    def _post(self, url: str, data: bytes, text: bool = False) -> Completion:
        req = urllib.request.Request(url, data=data, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            body = " ".join(redact.redact(e.read(ERROR_BODY_BYTES).decode("utf-8", "replace")).split())  # one line
            detail = f"{url}: HTTP {e.code}: {body[:200]}"
            if e.code == 429 or e.code >= 500:
                raise _Retryable(f"http_{e.code}", detail) from None
            return Completion(error=f"http_{e.code}", detail=detail)
        except urllib.error.URLError as e:
            kind = ("timeout" if isinstance(e.reason, TimeoutError) else
                    "connection_refused" if isinstance(e.reason, ConnectionRefusedError) else "connection")
            raise _Retryable(kind, redact.redact(f"{url}: {e.reason}")) from None
        except TimeoutError as e:
            raise _Retryable("timeout", f"{url}: {e}") from None
        except (OSError, http.client.HTTPException) as e:  # reset, dropped mid-response, ...
            raise _Retryable("connection", redact.redact(f"{url}: {type(e).__name__}: {e}")) from None
        try:
            # SGLang's ChatMessage (srt/entrypoints/openai/protocol.py): content, reasoning_content (with a
            # --reasoning-parser), tool_calls [{id, index, type, function: {name, arguments}}] (--tool-call-parser).
            reply = json.loads(raw)
            choice = reply["choices"][0]
            usage = reply.get("usage") if isinstance(reply.get("usage"), dict) else {}
            tokens = usage.get("completion_tokens") if isinstance(usage.get("completion_tokens"), int) else None
            if text:  # a text completion: {"text", "finish_reason"}
                return Completion(text=redact.redact_secrets(choice["text"]),
                                  finish_reason=choice.get("finish_reason") or "unknown", tokens=tokens)
            msg = choice["message"]
            # The model's own words, with any registered secret masked (a server may echo the key).
            reasoning = redact.redact_secrets(msg.get("reasoning_content") or msg.get("reasoning") or "") or None
            calls = [{"id": c.get("id") or f"call_{i}", "type": "function",
                      "function": {"name": c["function"]["name"],
                                   "arguments": redact.redact_secrets(_arguments(c["function"]))}}
                     for i, c in enumerate(msg.get("tool_calls") or [])] or None
            return Completion(text=redact.redact_secrets(msg.get("content") or ""),
                              finish_reason=choice.get("finish_reason") or "unknown",
                              reasoning=reasoning, tool_calls=calls, tokens=tokens)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            body = redact.redact(raw[:ERROR_BODY_BYTES].decode("utf-8", "replace"))
            return Completion(error="bad_response", detail=f"{url}: {type(e).__name__}: {body[:200]!r}")


def cut_text_loop(tokenizer: Any, text: str, min_repeat_tokens: int, max_period: int, keep: int = 0
                  ) -> tuple[str, int, int] | None:
    """(the text through the loop's first copy and ``keep`` tokens of its copies, its tokens, the tokens kept)
    when ``text``'s tokens end in a loop (its last token may be ragged: ``retokenized_loop_start``), else None.
    The cut is at the first dropped token's character offset (fast tokenizers), else where the decoded kept
    tokens end."""
    fast = getattr(tokenizer, "is_fast", False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
    ids = enc["input_ids"]
    start = retokenized_loop_start(ids, min_repeat_tokens, max_period)
    if start is None:
        return None
    start = min(start + keep, len(ids))
    if start == len(ids):
        return None  # nothing left to drop
    if fast:
        kept = text[: enc["offset_mapping"][start][0]]
    else:
        kept = tokenizer.decode(ids[:start]).rstrip("\ufffd")  # a character split between tokens decodes as U+FFFD
        if not text.startswith(kept):
            return None  # the tokenizer does not decode to a prefix of the text: leave the answer whole
    return kept, len(ids), start


def _arguments(function: dict[str, Any]) -> str:
    args = function.get("arguments", "{}")
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def make_chat_backend(target_cfg: TargetConfig, cfg: RegenerateConfig) -> ChatBackend:
    if cfg.backend == "hf":
        return HFChatBackend(target_cfg, cfg)
    return OpenAIChatBackend(cfg, target_cfg.chat_template_kwargs, target_cfg)

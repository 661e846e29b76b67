"""Chat backends for regeneration: the target in-process (``hf``) or any OpenAI-compatible server
(``openai``: SGLang, vLLM, llama.cpp) behind one interface, so the regeneration loop is the same.

A backend never raises for one bad record: it returns a ``Completion`` whose ``error`` names the
reason, and the caller counts it and leaves the record for the next run.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from common import redact
from common.config import RegenerateConfig, TargetConfig
from data_prep.batching import length_batches

Chat = list[dict[str, str]]
MAX_BACKOFF_S = 60.0
# A refused connection means nothing listens there: no backoff helps. Each server gets this many quick
# tries per request (a server restarting its listener), then the request fails as "connection_refused".
REFUSED_TRIES_PER_SERVER = 2
REFUSED_RETRY_S = 0.2
ERROR_BODY_BYTES = 1 << 16  # read this much of an error body, redact it, then keep 200 characters


class BackendError(ValueError):
    """A backend that cannot start (bad URL, missing API key); the message is for the user."""


@dataclass
class Completion:
    text: str = ""
    finish_reason: str = ""  # "stop" | "length" | what the server said; "" when error is set
    error: str | None = None  # failure reason key, e.g. "http_400", "timeout", "connection"
    detail: str = ""


class ChatBackend(Protocol):
    name: str
    batch_size: int  # how many chats one ``complete`` call should get

    def complete(self, batch: list[Chat]) -> list[Completion]: ...


class HFChatBackend:
    """The target itself via ``generate``: left padding so every row's answer starts at one column."""

    name = "hf"

    def __init__(self, target_cfg: TargetConfig, cfg: RegenerateConfig):
        import torch
        from transformers import GenerationConfig

        from drafter.target import load_target_from_config, stop_token_ids

        self.target = load_target_from_config(target_cfg)
        self.tok = self.target.tokenizer
        self.tok.padding_side = "left"
        self.cfg = cfg
        self.batch_size = cfg.batch_size
        self.stop_ids = stop_token_ids(self.tok)
        sampling = cfg.temperature > 0
        self.gen = GenerationConfig(
            max_new_tokens=cfg.max_tokens, do_sample=sampling, eos_token_id=self.stop_ids,
            pad_token_id=self.tok.pad_token_id,
            **({"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k or 0} if sampling else {}))
        torch.manual_seed(cfg.seed)

    def complete(self, batch: list[Chat]) -> list[Completion]:
        texts = [self.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True,
                                              **self.cfg.chat_template_kwargs) for chat in batch]
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        results: list[Completion] = [Completion()] * len(ids)
        for group in length_batches([len(x) + self.cfg.max_tokens for x in ids], self.cfg.batch_tokens):
            for i, c in zip(group, self._generate([ids[i] for i in group]), strict=True):
                results[i] = c
        return results

    def _generate(self, ids: list[list[int]]) -> list[Completion]:
        import torch

        enc = self.tok.pad({"input_ids": ids}, return_tensors="pt").to(self.target.device)
        with torch.no_grad():
            out = self.target.model.generate(**enc, generation_config=self.gen)
        results = []
        for row in out[:, enc["input_ids"].shape[1]:].tolist():
            end = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
            text = self.tok.decode(row if end is None else row[:end], skip_special_tokens=True)
            results.append(Completion(text=text, finish_reason="length" if end is None else "stop"))
        return results


def chat_url(base: str) -> str:
    """``http://host:port``, ``.../v1`` or the full endpoint -> the chat completions endpoint."""
    if not base.startswith(("http://", "https://")):
        raise BackendError(f"regenerate.server_urls: {base!r} is not an http(s) URL")
    base = base.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    return base + ("/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")


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
    pass through ``common.redact`` before anyone sees or stores them (a server may echo the header)."""

    name = "openai"

    def __init__(self, cfg: RegenerateConfig):
        self.cfg = cfg
        self.urls = [chat_url(u) for u in cfg.server_urls]
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

    def body(self, chat: Chat) -> dict[str, Any]:
        c = self.cfg
        body: dict[str, Any] = {"model": c.model, "messages": chat, "temperature": c.temperature,
                                "top_p": c.top_p, "max_tokens": c.max_tokens, "seed": c.seed}
        if c.top_k is not None:
            body["top_k"] = c.top_k
        if c.chat_template_kwargs:
            body["chat_template_kwargs"] = c.chat_template_kwargs
        return body

    def complete(self, batch: list[Chat]) -> list[Completion]:
        return list(self._pool.map(self._one, batch))

    def _url(self) -> str:
        with self._lock:
            return self.urls[next(self._next)]

    def _one(self, chat: Chat) -> Completion:
        data = json.dumps(self.body(chat)).encode()
        refused, backoffs = 0, 0
        for attempt in range(self.cfg.max_retries + 1):
            try:
                return self._post(self._url(), data)
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

    def _post(self, url: str, data: bytes) -> Completion:
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
            choice = json.loads(raw)["choices"][0]
            text = redact.redact_secrets(choice["message"].get("content") or "")
            return Completion(text=text, finish_reason=choice.get("finish_reason") or "unknown")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            body = redact.redact(raw[:ERROR_BODY_BYTES].decode("utf-8", "replace"))
            return Completion(error="bad_response", detail=f"{url}: {type(e).__name__}: {body[:200]!r}")


def make_chat_backend(target_cfg: TargetConfig, cfg: RegenerateConfig) -> ChatBackend:
    return HFChatBackend(target_cfg, cfg) if cfg.backend == "hf" else OpenAIChatBackend(cfg)

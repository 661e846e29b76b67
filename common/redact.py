"""Keep API keys out of everything a run prints or stores.

A server may echo the request's ``Authorization`` header in an error body (seen: a 401 page), and that
body goes into failure messages, the summary file and the terminal. Two layers: ``redact`` removes
credential-shaped text (``Authorization: ...``, ``Bearer ...``, ``api_key=...``) and every registered
secret (the value of the configured API-key variable, ``register_env``) from messages; ``redact_secrets``
removes only the registered values, for model output that may rightly contain ``api_key = ...`` in code.
``redacting_streams`` filters stdout and stderr of a process that holds a secret, so a message that
escapes both (a traceback) is cleaned too.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

MASK = "[REDACTED]"
MIN_SECRET = 4  # a shorter value would mask ordinary text and is no secret anyway
_secrets: set[str] = set()

_VALUE = r"(?!\[REDACTED\])[^\s\"',;&)}\]]+"  # a credential: no spaces, quotes or closing punctuation
_PATTERNS = [
    # Authorization: [scheme] <credential>, in headers, JSON or repr'd dicts
    re.compile(r"""(?i)(\bauthorization["']?\s*[:=]\s*["']?(?:[A-Za-z]+\s+)?)""" + _VALUE),
    re.compile(r"(?i)(\bbearer\s+)" + _VALUE),
    re.compile(r"""(?i)(\b(?:x-)?api[_-]?key["']?\s*[:=]\s*["']?)""" + _VALUE),
]


def register(secret: str | None) -> None:
    if secret and len(secret) >= MIN_SECRET:
        _secrets.add(secret)


def register_env(name: str | None) -> None:
    """Treat the value of environment variable ``name`` (when set) as a secret from now on."""
    if name:
        register(os.environ.get(name))


def redact_secrets(text: str) -> str:
    """Registered values only, plus a secret's head left at the end of text cut to a length limit."""
    for s in sorted(_secrets, key=len, reverse=True):
        text = text.replace(s, MASK)
        for k in range(len(s) - 1, MIN_SECRET - 1, -1):
            if text.endswith(s[:k]):
                text = text[:-k] + MASK
                break
    return text


def redact(text: str) -> str:
    """Registered values and credential-shaped text: for messages, logs and error details."""
    text = redact_secrets(text)
    for pattern in _PATTERNS:
        text = pattern.sub(lambda m: m.group(1) + MASK, text)
    return text


def redact_tree(obj: Any) -> Any:
    """``redact`` applied to every string of a JSON-like tree (a summary about to be saved)."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {k: redact_tree(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redact_tree(v) for v in obj]
    return obj


class _RedactingStream:
    """A text stream that cleans whole lines (a secret split over two writes is still seen whole)."""

    def __init__(self, stream: TextIO):
        self._stream, self._pending = stream, ""

    def write(self, text: str) -> int:
        self._pending += text
        cut = max(self._pending.rfind("\n"), self._pending.rfind("\r")) + 1
        if cut:
            self._stream.write(redact(self._pending[:cut]))
            self._pending = self._pending[cut:]
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(redact(self._pending))
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ...
        return getattr(self._stream, name)


@contextmanager
def redacting_streams() -> Iterator[None]:
    """Filter sys.stdout and sys.stderr through ``redact`` for the block."""
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _RedactingStream(sys.stdout), _RedactingStream(sys.stderr)  # type: ignore[assignment]
    try:
        yield
    finally:
        for s in (sys.stdout, sys.stderr):
            s.flush()
        sys.stdout, sys.stderr = old

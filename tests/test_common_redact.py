"""Secrets never reach output or files: credential-shaped text and registered values are masked."""

from __future__ import annotations

import io
import sys

import pytest

from common import redact


@pytest.fixture(autouse=True)
def _no_leftover_secrets(monkeypatch):
    monkeypatch.setattr(redact, "_secrets", set())


@pytest.mark.parametrize("text, want", [
    ("Authorization: Bearer abc.def-1; rest", "Authorization: Bearer [REDACTED]; rest"),
    ('{"Authorization": "Bearer xyz"}', '{"Authorization": "Bearer [REDACTED]"}'),
    ("{'authorization': 'Basic dXNlcjpw=='}", "{'authorization': 'Basic [REDACTED]'}"),
    ("GET /v1?api_key=foo&x=1", "GET /v1?api_key=[REDACTED]&x=1"),
    ("x-api-key: zzz)", "x-api-key: [REDACTED])"),
    ("api_key=[REDACTED]) ok", "api_key=[REDACTED]) ok"),  # idempotent: a second pass eats nothing
    ("an api key is a secret", "an api key is a secret"),
])
def test_credential_shapes(text, want):
    assert redact.redact(text) == want


def test_registered_values_and_their_truncated_heads(monkeypatch):
    monkeypatch.setenv("SOME_KEY", "sk-0123456789SECRET")
    redact.register_env("SOME_KEY")
    redact.register("abc")  # too short to be a secret: masking it would garble ordinary text
    assert redact.redact_secrets("key sk-0123456789SECRET here") == "key [REDACTED] here"
    assert redact.redact_secrets("body cut at 200 chars: sk-01234") == "body cut at 200 chars: [REDACTED]"
    assert redact.redact_secrets("api_key = os.environ['X'] abc") == "api_key = os.environ['X'] abc"
    assert redact.redact_tree({"a": ["sk-0123456789SECRET", 3]}) == {"a": ["[REDACTED]", 3]}


def test_streams_are_cleaned_even_when_a_secret_is_split_over_writes(monkeypatch):
    redact.register("sk-0123456789SECRET")
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    with redact.redacting_streams():
        sys.stdout.write("token sk-01234")
        sys.stdout.write("56789SECRET done\n")
        print("tail without newline Bearer t0k", end="")
    assert out.getvalue() == "token [REDACTED] done\ntail without newline Bearer [REDACTED]"

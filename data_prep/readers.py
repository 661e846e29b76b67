"""Readers for prompt files (JSON, JSON Lines, text; .gz too): each turns one file into chat messages,
record by record. ``data_prep.sources`` picks the reader for a configured source (and hands what these
files are not to ``data_prep.hf_datasets``).

A reader never raises on a bad record: it yields a ``Record`` carrying a skip reason, so ingest can
count every record it drops. JSON containers are streamed (a JSON array is decoded element by element
with ``raw_decode``), because the ShareGPT copy we ship is a 125 MB array cut off mid-record: a
``json.load`` would both hold it all in memory and lose every record to the one broken tail.
"""

from __future__ import annotations

import codecs
import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

CHUNK_BYTES = 1 << 22
# {"role", "content": str}; an assistant turn may add "reasoning_content" (str) and "tool_calls" (OpenAI's
# [{"id", "type": "function", "function": {"name", "arguments": JSON str}}]), a tool turn "tool_call_id"/"name".
Messages = list[dict[str, Any]]
Tools = list[dict[str, Any]] | None  # OpenAI tool definitions offered in one chat

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "bing": "assistant", "system": "system"}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


class Skip(Exception):
    """A record that cannot become a prompt; ``reason`` is one of ingest's fixed skip reasons."""

    def __init__(self, reason: str, detail: str = "", tail: bool = False):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.tail = tail


@dataclass
class Record:
    where: str  # "file:line" (JSONL, lines) or "file[index]" (JSON array)
    messages: Messages | None = None
    tools: Tools = None  # OpenAI tool definitions the chat template renders
    skip: str | None = None
    detail: str = ""
    tail: bool = False  # the file ends in a broken record: ``detail`` says where and what was cut


def _open_binary(path: Path) -> IO[bytes]:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _first_char(f: IO[bytes]) -> bytes:
    """The first non-whitespace byte (a UTF-8 BOM skipped); the stream is left at the start."""
    head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    f.seek(0)
    return head[:1]


def iter_json_values(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, value) for each element of a JSON array or each line of a JSONL file; a value that is
    a ``Skip`` stands for an undecodable record."""
    with _open_binary(path) as f:
        yield from (_iter_array(f, path.name) if _first_char(f) == b"[" else _iter_lines(f, path.name))


def _iter_lines(f: IO[bytes], name: str) -> Iterator[tuple[str, Any]]:
    for lineno, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        where = f"{name}:{lineno}"
        try:
            text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
        except UnicodeDecodeError as e:
            yield where, Skip("invalid_utf8", f"byte {e.start} of the line")
            continue
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as e:
            yield where, Skip("bad_json", f"{e.msg} at column {e.colno}")


class _ArrayStream:
    """A growing text window over a binary file; ``base`` is the byte offset of ``buf[0]``.

    Undecodable bytes become lone surrogates (surrogateescape), so one bad byte spoils only its own
    record (ingest reports it as invalid_utf8 when the text cannot be encoded back)."""

    def __init__(self, f: IO[bytes]):
        self.f = f
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.buf, self.pos, self.base, self.eof = "", 0, 0, False

    def fill(self) -> None:
        chunk = self.f.read(CHUNK_BYTES)
        self.eof = not chunk
        self.base += len(self.buf[: self.pos].encode("utf-8", "surrogateescape"))
        self.buf = self.buf[self.pos:] + self.dec.decode(chunk, final=self.eof)
        self.pos = 0

    def byte_offset(self) -> int:
        return self.base + len(self.buf[: self.pos].encode("utf-8", "surrogateescape"))

    def peek(self) -> str:
        """The next non-whitespace character ("" at end of file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n\ufeff":
                self.pos += 1
            if self.pos < len(self.buf) or self.eof:
                return self.buf[self.pos: self.pos + 1]
            self.fill()


def _iter_array(f: IO[bytes], name: str) -> Iterator[tuple[str, Any]]:
    s = _ArrayStream(f)
    decoder = json.JSONDecoder(strict=False)
    s.peek()
    s.pos += 1  # the "[" that _first_char saw
    if s.peek() == "]":
        return
    index = 0
    while True:
        s.peek()
        start = s.byte_offset()
        while True:
            try:
                value, end = decoder.raw_decode(s.buf, s.pos)
                if end < len(s.buf) or s.eof:
                    break
            except json.JSONDecodeError as e:
                if s.eof:
                    cut = s.buf[s.pos:]
                    yield f"{name}[{index}]", _tail(index, start, len(cut.encode("utf-8", "surrogateescape")),
                                                    e.msg, cut)
                    return
            s.fill()
        s.pos = end
        yield f"{name}[{index}]", value
        index += 1
        sep = s.peek()
        if sep == "]":
            return
        if sep != ",":
            what = "the file ends" if not sep else f"found {sep!r}"
            yield f"{name}[{index}]", _tail(index, s.byte_offset(), 0, f"expected ',' or ']' but {what}", "")
            return
        s.pos += 1


def _tail(index: int, offset: int, size: int, msg: str, cut: str) -> Skip:
    ending = f", ends with {cut[-60:]!r}" if cut else ""
    return Skip("bad_json", f"record #{index} at byte {offset} ({size} bytes left) is not "
                            f"whole JSON ({msg}{ending}); {index} whole records before it", tail=True)


def _field(obj: Any, key: str, kind: type) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise Skip("missing_field", f"no {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise Skip("non_text" if kind is str else "missing_field",
                   f"{key!r} is {type(value).__name__}, expected {kind.__name__}")
    return value


def _turn(role_map: dict[str, str], raw_role: Any, content: Any) -> dict[str, str]:
    role = role_map.get(str(raw_role).lower())
    if role is None:
        raise Skip("unknown_role", f"role {raw_role!r}")
    if not isinstance(content, str):
        raise Skip("non_text", f"{role} content is {type(content).__name__}")
    return {"role": role, "content": content}


def sharegpt_messages(obj: Any) -> Messages:
    turns = _field(obj, "conversations", list)
    out = []
    for t in turns:
        if not isinstance(t, dict) or "from" not in t or "value" not in t:
            raise Skip("missing_field", "a turn lacks 'from' or 'value'")
        out.append(_turn(SHAREGPT_ROLES, t["from"], t["value"]))
    return out


def _openai_content(role: Any, content: Any) -> Any:
    """Text parts of a multi-part content joined; an assistant's null content (tool calls) is empty."""
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise Skip("non_text", "content has non-text parts")
        return "".join(p["text"] for p in content)
    return content


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """OpenAI tool calls with string arguments (a dict is serialised, as the API sends it)."""
    if not isinstance(calls, list):
        raise Skip("missing_field", f"'tool_calls' is {type(calls).__name__}, expected a list")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Skip("missing_field", "a tool call lacks function.name")
        args = fn.get("arguments")
        args = args if isinstance(args, str) else json.dumps({} if args is None else args, ensure_ascii=False)
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call = {"id": c["id"], **call}
        out.append(call)
    return out


def openai_messages(obj: Any) -> Messages:
    """OpenAI chat messages, keeping what the chat template renders: an assistant's reasoning_content and
    tool_calls, tool results with their tool_call_id (K2.5 traffic is mostly thinking and agentic)."""
    out = []
    for m in _field(obj, "messages", list):
        if not isinstance(m, dict) or "role" not in m or ("content" not in m and "tool_calls" not in m):
            raise Skip("missing_field", "a message lacks 'role' or 'content'")
        turn: dict[str, Any] = _turn(OPENAI_ROLES, m["role"], _openai_content(m["role"], m.get("content")))
        if turn["role"] == "assistant":
            for key in ("reasoning_content", "reasoning"):  # vLLM names it "reasoning"
                if isinstance(m.get(key), str) and m[key]:
                    turn["reasoning_content"] = m[key]
                    break
            if m.get("tool_calls"):
                turn["tool_calls"] = _tool_calls(m["tool_calls"])
        elif turn["role"] == "tool":
            turn |= {k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)}
        out.append(turn)
    return out


def openai_tools(obj: Any) -> Tools:
    """The record's tool definitions (rendered into the prompt by the chat template), if any."""
    tools = obj.get("tools") if isinstance(obj, dict) else None
    if tools is None:
        return None
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise Skip("missing_field", "'tools' must be a list of objects")
    return tools or None


def mtbench_messages(obj: Any) -> Messages:
    """MT-Bench questions are user turns only; the target writes every answer at regeneration."""
    return [_turn({"user": "user"}, "user", t) for t in _field(obj, "turns", list)]


def humaneval_messages(obj: Any) -> Messages:
    return [{"role": "user", "content": _field(obj, "prompt", str)}]


JSON_FORMATS: dict[str, Callable[[Any], Messages]] = {
    "sharegpt": sharegpt_messages, "openai": openai_messages,
    "mtbench": mtbench_messages, "humaneval": humaneval_messages,
}


# The kinds whose records may offer tools, and the reader of those tool definitions.
JSON_TOOLS: dict[str, Callable[[Any], Tools]] = {"openai": openai_tools}


def to_record(where: str, value: Any, convert: Callable[[Any], Messages],
              tools: Callable[[Any], Tools] | None = None) -> Record:
    """One decoded record (a JSON value or a `datasets` row) as messages (and the tools it offers, read by
    ``tools``, one of JSON_TOOLS), or the reason it is skipped."""
    try:
        if isinstance(value, Skip):
            raise value
        return Record(where, messages=convert(value), tools=tools(value) if tools else None)
    except Skip as s:
        return Record(where, skip=s.reason, detail=s.detail, tail=s.tail)


def read_json_source(path: Path, convert: Callable[[Any], Messages],
                     tools: Callable[[Any], Tools] | None = None) -> Iterator[Record]:
    """``convert``: one of JSON_FORMATS, or one behind a column mapping (data_prep.sources); ``tools``: the
    kind's reader in JSON_TOOLS, if any."""
    for where, value in iter_json_values(path):
        yield to_record(where, value, convert, tools)


def read_lines(path: Path) -> Iterator[Record]:
    """One single-turn user prompt per non-blank line (blank lines separate, they are not records)."""
    with _open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path.name}:{lineno}"
            try:
                text = raw.decode("utf-8-sig" if lineno == 1 else "utf-8").strip()
            except UnicodeDecodeError as e:
                yield Record(where, skip="invalid_utf8", detail=f"byte {e.start} of the line")
                continue
            if text:
                yield Record(where, messages=[{"role": "user", "content": text}])

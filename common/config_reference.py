"""docs/config-reference.md, generated from the run-config schema (``common.config``) so that it cannot drift:
every key dotted, its type, default and description, one table per section.

    python -m common.config_reference --write      # rewrite docs/config-reference.md
    python -m common.config_reference              # print it

tests/test_docs_config_reference.py fails when the committed file differs from what this renders, and when a
key has no description.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from common.cli import EXIT_OK, one_line_errors
from common.config import RunConfig
from common.files import write_text_atomic

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
HEADER = """# Config reference

Generated from the schema in `common/config.py` by `python -m common.config_reference --write`: do not edit by
hand (`tests/test_docs_config_reference.py` fails when this file is stale). Every key is set in the run config's
YAML, or on any command line with `--set key=value` (the value read as YAML: `--set train.lr=3e-3`,
`--set "tracking.report_to=[tensorboard]"`). Unknown keys are errors that name the key.
"""
_BOUNDS = {annotated_types.Gt: (">", "gt"), annotated_types.Ge: (">=", "ge"), annotated_types.Lt: ("<", "lt"),
           annotated_types.Le: ("<=", "le")}


def _constraints(metadata: list[Any]) -> list[str]:
    """``["> 0"]`` for Field(gt=0), ``["at least 1 item"]`` for min_length=1; validators say nothing."""
    out = []
    for m in metadata:
        if isinstance(m, FieldInfo):
            out += _constraints(m.metadata)
        elif type(m) in _BOUNDS:
            sign, attr = _BOUNDS[type(m)]
            out.append(f"{sign} {getattr(m, attr)}")
        elif isinstance(m, annotated_types.MinLen):
            out.append(f"at least {m.min_length}")
    return out


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def type_name(tp: Any, metadata: list[Any] | None = None) -> str:
    """A config type as a reader writes it: ``int (> 0)``, ``"hf" | "openai"``, ``list[str]``, ``mapping``."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        return type_name(args[0], [*args[1:], *(metadata or [])])
    if origin is Literal:
        name = " | ".join(json.dumps(a) for a in args)
    elif origin in (Union, types.UnionType):
        name = " | ".join(type_name(a) for a in args)
    elif origin in (list, dict):
        name = f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    elif tp is type(None):
        name = "null"
    elif tp is Any:
        name = "any"
    elif _is_section(tp):
        name = "mapping"
    else:
        name = tp.__name__
    bounds = _constraints(metadata or [])
    return f"{name} ({', '.join(bounds)})" if bounds else name


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    return f"`{json.dumps(value.model_dump(mode='json') if isinstance(value, BaseModel) else value)}`"


def _section_of(tp: Any) -> tuple[type[BaseModel] | None, str]:
    """The section a field's type holds, and the suffix its keys take: ``[]`` for a list of sections."""
    if _is_section(tp):
        return tp, ""
    origin, args = get_origin(tp), get_args(tp)
    if origin is list and args and _is_section(args[0]):
        return args[0], "[]"
    if origin in (Union, types.UnionType):
        found = [a for a in args if _is_section(a)]
        if found:
            return found[0], ""
    return None, ""


def _cell(text: str) -> str:
    """One line of Markdown: rst's double backticks as single ones, pipes escaped, and ``<name>`` kept visible
    (a renderer would take it for an HTML tag)."""
    text = re.sub(r"<(?=[A-Za-z/])", "&lt;", text.replace("``", "`").replace("|", "\\|"))
    return " ".join(text.split())


def sections(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, type[BaseModel], list[tuple]]]:
    """(dotted section name, its model, its rows) depth first; a plain sub-section is a heading of its own, a list
    of sections or an optional one is also a row of its parent."""
    rows, nested = [], []
    for key, field in model.model_fields.items():
        dotted = f"{prefix}{key}"
        sub, suffix = _section_of(field.annotation)
        if sub is None or sub is not field.annotation:
            rows.append((dotted, type_name(field.annotation, field.metadata), default_text(field),
                         field.description or ""))
        if sub is not None:
            nested.append((f"{dotted}{suffix}", sub))
    yield prefix.rstrip("."), model, rows
    for dotted, sub in nested:
        yield from sections(sub, f"{dotted}.")


def render() -> str:
    parts = [HEADER.strip()]
    for name, model, rows in sections(RunConfig):
        parts.append(f"## `{name}`" if name else "## Top level")
        doc = inspect.getdoc(model) if model is not RunConfig and model.__doc__ else None
        if doc:
            parts.append(_cell(doc))
        table = ["| key | type | default | description |", "|---|---|---|---|"]
        table += [f"| `{key}` | {_cell(tp)} | {_cell(default)} | {_cell(desc)} |" for key, tp, default, desc in rows]
        parts.append("\n".join(table))
    return "\n\n".join(parts) + "\n"


def undocumented() -> list[str]:
    """Keys without a description, and sections without a docstring (the text under their heading)."""
    found = []
    for name, model, rows in sections(RunConfig):
        if name and not model.__doc__:
            found.append(f"{name} (the section's class docstring)")
        found += [key for key, _, _, desc in rows if not desc]
    return found


@one_line_errors()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.config_reference", description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite {REFERENCE.relative_to(REFERENCE.parents[1])}")
    args = ap.parse_args(argv)
    if args.write:
        write_text_atomic(REFERENCE, render())
        print(f"wrote {REFERENCE}")
    else:
        sys.stdout.write(render())
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())

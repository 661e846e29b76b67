"""docs/config-reference.md is generated from the run-config schema (common/config_reference.py): it must be what
the schema renders today, and every key must say what it does."""

from __future__ import annotations

from common import config_reference
from common.config import RunConfig


def test_the_committed_reference_is_what_the_schema_renders() -> None:
    committed = config_reference.REFERENCE.read_text()
    assert committed == config_reference.render(), (
        "docs/config-reference.md is stale: run `python -m common.config_reference --write` and commit it")


def test_every_key_and_section_has_a_description() -> None:
    assert config_reference.undocumented() == [], (
        "give these a Field(description=...) (a section: a class docstring) in common/config.py")


def test_every_key_of_the_schema_is_a_row_with_its_type_and_default() -> None:
    rendered = config_reference.render()
    for key in ("run_dir", "target.name", "data.sources[].kind", "eval.timings.cycle_ms", "eval.sglang.server_url",
                "gate.history_file"):
        assert f"| `{key}` |" in rendered
    assert "| `train.lr` | float (> 0) | `0.0001` |" in rendered
    assert "| `regenerate.backend` | \"hf\" \\| \"openai\" | `\"hf\"` |" in rendered
    assert "| `target.name` | str | required |" in rendered
    sections = {name for name, _, _ in config_reference.sections(RunConfig)}
    assert {"", "target", "data.sources[]", "eval.datasets[]", "eval.timings", "eval.sglang", "gate"} <= sections

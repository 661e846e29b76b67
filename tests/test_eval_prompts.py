"""Eval prompt loading: builtin MT-Bench/HumanEval first turns, files, and errors naming file:line."""

from __future__ import annotations

import json

import pytest

from common.config import DatasetConfig
from data_prep.source_fields import SourceError
from eval.prompts import PromptError, load_eval_prompts


def ds(kind: str, path: str = "builtin", **fields) -> DatasetConfig:
    return DatasetConfig(name=kind, kind=kind, path=path, **fields)


def test_builtin_first_turns():
    mt = load_eval_prompts(ds("mtbench"))
    assert len(mt) == 80 and mt[0].startswith("Compose an engaging travel blog post")
    he = load_eval_prompts(ds("humaneval"), limit=3)
    assert len(he) == 3 and he[0].startswith("from typing import List")


def test_files_and_errors(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("one\n\ntwo\nthree\n")
    assert load_eval_prompts(ds("lines", str(lines)), limit=2) == ["one", "two"]
    oa = tmp_path / "m.jsonl"
    oa.write_text(json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]})
                  + "\n" + json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    with pytest.raises(PromptError, match=r"m.jsonl:2: "):
        load_eval_prompts(ds("openai", str(oa)))
    assert load_eval_prompts(ds("openai", str(oa)), limit=1) == ["hi"]
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"turns": ["a"]}\n{oops\n')
    with pytest.raises(PromptError, match=r"q.jsonl:2: bad_json"):
        load_eval_prompts(ds("mtbench", str(bad)))
    with pytest.raises(SourceError, match=r"missing.txt: no such file \(eval dataset 'lines' \(lines\).path\)"):
        load_eval_prompts(ds("lines", str(tmp_path / "missing.txt")))


def test_truncated_sharegpt_wheel_ends_at_its_last_whole_record():
    prompts = load_eval_prompts(ds("sharegpt"), limit=40)
    assert len(prompts) == 40 and all(isinstance(p, str) and p for p in prompts)


def test_a_file_cut_off_mid_record_is_an_error_naming_the_record(tmp_path):
    """Only the builtin ShareGPT copy may end in a broken record: in any other file the cut-off prompt would be
    lost without a word and the report would measure fewer prompts than the file holds."""
    array = tmp_path / "trunc.json"
    array.write_text('[{"task_id": "a", "prompt": "def f():"}, {"task_id": "b", "prompt": "def g():"}, '
                     '{"task_id": "c", "prompt": "def h(')
    with pytest.raises(PromptError, match=r"^trunc.json\[2\]: bad_json \(record #2 at byte \d+ .*; 2 whole records "
                                          r"before it\); the file is cut off: copy it again"):
        load_eval_prompts(ds("humaneval", str(array)))
    assert load_eval_prompts(ds("humaneval", str(array)), limit=2) == ["def f():", "def g():"]
    lines = tmp_path / "trunc.jsonl"
    lines.write_text('{"prompt": "def f():"}\n{"prompt": "def g(')
    with pytest.raises(PromptError, match=r"^trunc.jsonl:2: bad_json"):
        load_eval_prompts(ds("humaneval", str(lines)))

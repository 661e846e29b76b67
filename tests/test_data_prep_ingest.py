"""Ingest: every reader format, every skip reason counted, stable ids, dedupe, the real ShareGPT wheel."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path
from typing import Any

import pytest

from common.config import RunConfig, parse_config
from data_prep.ingest import run_ingest
from data_prep.source_fields import SourceError
from data_prep.step_failed import StepFailed


def make_cfg(tmp_path: Path, sources: list[dict[str, Any]], eval_kind: str = "mtbench", **data: Any) -> RunConfig:
    return parse_config({"run_dir": str(tmp_path / "run"), "target": {"name": "smollm2-135m-instruct"},
                         "data": {"sources": sources, **data},
                         "eval": {"datasets": [{"name": eval_kind, "kind": eval_kind}]}})


def read_prompts(cfg: RunConfig) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cfg.prompts_path.read_text(encoding="utf-8").splitlines()]


def sg(*turns: tuple[str, Any]) -> dict[str, Any]:
    return {"conversations": [{"from": r, "value": v} for r, v in turns]}


def jsonl_bytes(items: list[Any]) -> bytes:
    return b"".join(i if isinstance(i, bytes) else json.dumps(i).encode() + b"\n" for i in items)


def test_sharegpt_jsonl_counts_every_malformed_record(tmp_path: Path) -> None:
    good = sg(("human", "What is 2+2?"), ("gpt", "4"))
    path = tmp_path / "sg.jsonl"
    path.write_bytes(jsonl_bytes([
        good,
        b'{"conversations": [ {"from": "human", \n',                    # bad_json
        {"conversations": [{"value": "no role"}]},                       # missing_field (turn)
        {"id": "x"},                                                     # missing_field (conversations)
        sg(("robot", "beep")),                                           # unknown_role
        sg(("gpt", "I speak first"), ("human", "hi")),                   # kept, opening turn dropped
        sg(("human", "   "), ("gpt", "?")),                              # empty
        b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}\n',  # invalid_utf8
        sg(("human", ["a", "list"])),                                    # non_text
        sg(("human", "x" * 200)),                                        # too_long
        sg(("human", " What is 2+2? "), ("gpt", "four")),                # duplicate (same prompt)
        sg(("system", "Be brief."), ("user", "Name a colour."), ("chatgpt", "Red"), ("bing", "Blue")),
    ]))
    cfg = make_cfg(tmp_path, [{"kind": "sharegpt", "path": str(path)}], max_prompt_chars=100)
    summary = run_ingest(cfg)
    report = summary.sources[0]
    assert dict(report.skipped) == {"bad_json": 1, "missing_field": 2, "unknown_role": 1,
                                    "empty": 1, "invalid_utf8": 1, "non_text": 1, "too_long": 1, "duplicate": 1}
    assert report.read == 12 and report.kept == 3 and summary.kept == 3 and report.leading_assistant_dropped == 1
    assert report.first_skip["bad_json"].startswith("sg.jsonl:2")
    assert report.first_skip["invalid_utf8"].startswith("sg.jsonl:8")
    prompts = read_prompts(cfg)
    assert prompts[1]["messages"] == [{"role": "user", "content": "hi"}]
    assert prompts[2]["messages"] == [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Name a colour."},
                                      {"role": "assistant", "content": "Red"},
                                      {"role": "assistant", "content": "Blue"}]
    md = summary.to_markdown()
    for reason in report.skipped:
        assert f"first {reason}: sg.jsonl:" in md
    assert summary.to_dict()["skipped"]["missing_field"] == 2
    assert not list(cfg.root.glob(".*tmp*")), "the temp file of the atomic write is left behind"


def test_sharegpt_array_streamed_with_broken_tail_and_bad_bytes(tmp_path: Path) -> None:
    records = [sg(("human", f"question {i}"), ("gpt", "answer")) for i in range(5)]
    body = ("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records)).encode()
    body = body.replace(b"question 2", b"question \xff2")  # one undecodable byte spoils one record only
    cut = b',\n{"conversations": [{"from": "human", "value": "cut he'
    path = tmp_path / "sg.json"
    path.write_bytes(body + cut)
    summary = run_ingest(make_cfg(tmp_path, [{"kind": "sharegpt", "path": str(path)}]))
    report = summary.sources[0]
    assert report.kept == 4 and dict(report.skipped) == {"invalid_utf8": 1, "bad_json": 1}
    assert report.broken_tail is not None
    assert f"at byte {len(body) + 2}" in report.broken_tail and "5 whole records" in report.broken_tail
    assert "cut he" in report.broken_tail
    assert "broken tail" in summary.to_markdown()


def test_sharegpt_array_whole_file_has_no_tail(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([sg(("human", f"q{i}")) for i in range(3)], indent=2))
    report = run_ingest(make_cfg(tmp_path, [{"kind": "sharegpt", "path": str(path)}])).sources[0]
    assert report.kept == 3 and report.broken_tail is None and not report.skipped


def test_openai_messages_reader(tmp_path: Path) -> None:
    path = tmp_path / "oa.jsonl"
    path.write_bytes(jsonl_bytes([
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"},
                      {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "two "},
                                                   {"type": "text", "text": "parts"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},  # non_text
        {"messages": [{"role": "function", "content": "{}"}]},  # unknown_role
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "{}"}]},  # orphan_tool_result
        {"messages": [{"content": "no role"}]},  # missing_field
        {"prompt": "not chat"},  # missing_field
    ]))
    cfg = make_cfg(tmp_path, [{"kind": "openai", "path": str(path)}])
    report = run_ingest(cfg).sources[0]
    assert dict(report.skipped) == {"non_text": 1, "unknown_role": 1, "missing_field": 2, "orphan_tool_result": 1}
    prompts = read_prompts(cfg)
    assert [m["role"] for m in prompts[0]["messages"]] == ["system", "user", "assistant", "user"]
    assert prompts[1]["messages"] == [{"role": "user", "content": "two parts"}]
    assert all(p["source"] == "openai" and p["id"].startswith("openai-") for p in prompts)


def test_an_opening_assistant_turn_goes_with_its_tool_results(tmp_path: Path) -> None:
    """A continuation that opens with an assistant tool call and its result keeps the user turns after them
    (both dropped and counted once); a tool result before any user turn that answers no dropped call is
    still an orphan."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    path = tmp_path / "oa.jsonl"
    path.write_bytes(jsonl_bytes([
        {"messages": [{"role": "system", "content": "sys"},
                      {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "user", "content": "so?"},
                      {"role": "assistant", "content": "42.", "reasoning_content": "the tool said so"}]},
        {"messages": [{"role": "tool", "content": "{}"}, {"role": "user", "content": "q"}]},  # orphan_tool_result
    ]))
    cfg = make_cfg(tmp_path, [{"kind": "openai", "path": str(path)}])
    report = run_ingest(cfg).sources[0]
    assert report.kept == 1 and report.leading_assistant_dropped == 1 and dict(report.skipped) == {
        "orphan_tool_result": 1}
    (prompt,) = read_prompts(cfg)
    assert prompt["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "so?"},
                                  {"role": "assistant", "content": "42.", "reasoning_content": "the tool said so"}]


def test_empty_and_trailing_system_turns_are_dropped_and_counted(tmp_path: Path) -> None:
    """An empty system turn is dropped (the template's default system prompt renders instead: another prompt), a
    system turn after the last user turn is dropped (regeneration answers nothing after it): each kept record
    that lost one is counted in its column, in the table and the JSON. A system turn that led into a user turn
    the max_turns cut took goes with the cut, counted there."""
    def turn(role: str, text: str) -> dict[str, str]:
        return {"role": role, "content": text}

    answer = turn("assistant", "hello")
    path = tmp_path / "oa.jsonl"
    path.write_bytes(jsonl_bytes([
        {"messages": [turn("system", ""), turn("user", "hi"), answer]},  # empty
        {"messages": [turn("system", "  "), turn("user", "yo"), turn("system", "French."), answer]},  # both
        {"messages": [turn("user", "hey"), answer, turn("system", "From now on answer in French.")]},  # trailing
        {"messages": [turn("user", "u1"), answer, turn("system", "Be brief."), turn("user", "u2"), answer]},  # cut
    ]))
    cfg = make_cfg(tmp_path, [{"kind": "openai", "path": str(path)}], max_turns=1)
    summary = run_ingest(cfg)
    report = summary.sources[0]
    assert report.kept == 4 and not report.skipped
    assert (report.empty_system_dropped, report.trailing_system_dropped, report.cut_to_max_turns) == (2, 2, 1)
    assert [[m["role"] for m in p["messages"]] for p in read_prompts(cfg)] == [["user", "assistant"]] * 4
    md = summary.to_markdown()
    assert "| empty system turn dropped | trailing system turn dropped |" in md
    assert "| openai | oa.jsonl | 4 | 4 | 1 | 0 | 2 | 2 | 0 |" in md
    assert summary.to_dict()["sources"][0].items() >= {"empty_system_dropped": 2, "trailing_system_dropped": 2}.items()


def test_mtbench_builtin_two_user_turns_and_max_turns(tmp_path: Path) -> None:
    # measured on HumanEval: MT-Bench as a training source would otherwise be kept out as the eval's own prompts
    cfg = make_cfg(tmp_path, [{"kind": "mtbench", "path": "builtin"}], "humaneval", max_turns=2)
    report = run_ingest(cfg).sources[0]
    prompts = read_prompts(cfg)
    assert report.kept == len(prompts) == 80 and not report.skipped
    assert all([m["role"] for m in p["messages"]] == ["user", "user"] for p in prompts)
    cfg1 = make_cfg(tmp_path / "one", [{"kind": "mtbench", "path": "builtin"}], "humaneval", max_turns=1)
    report1 = run_ingest(cfg1).sources[0]
    assert report1.cut_to_max_turns == 80
    assert all(len(p["messages"]) == 1 for p in read_prompts(cfg1))


def test_humaneval_builtin_and_gz_with_limit(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, [{"kind": "humaneval", "path": "builtin", "limit": 7}])
    report = run_ingest(cfg).sources[0]
    prompts = read_prompts(cfg)
    assert report.kept == 7 and report.stopped_at_limit and len(prompts) == 7
    assert prompts[0]["messages"][0]["content"].startswith("from typing import List")
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wb") as f:
        f.write(jsonl_bytes([{"task_id": "a", "prompt": "def f():\n"}, {"task_id": "b"}]))
    report = run_ingest(make_cfg(tmp_path / "gz", [{"kind": "humaneval", "path": str(path)}])).sources[0]
    assert report.kept == 1 and dict(report.skipped) == {"missing_field": 1}


def test_lines_reader(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"first prompt\n\n   \nsecond prompt\nbad \xc3\x28 bytes\nfirst prompt\n")
    cfg = make_cfg(tmp_path, [{"kind": "lines", "path": str(path)}])
    report = run_ingest(cfg).sources[0]
    assert report.kept == 2 and dict(report.skipped) == {"invalid_utf8": 1, "duplicate": 1}
    assert report.first_skip["invalid_utf8"].startswith("prompts.txt:5")
    assert [p["messages"] for p in read_prompts(cfg)] == [[{"role": "user", "content": "first prompt"}],
                                                          [{"role": "user", "content": "second prompt"}]]


def test_max_turns_keeps_the_last_kept_users_answer(tmp_path: Path) -> None:
    path = tmp_path / "sg.jsonl"
    path.write_bytes(jsonl_bytes([sg(("human", "u1"), ("gpt", "a1"), ("human", "u2"), ("gpt", "a2"),
                                     ("human", "u3"), ("gpt", "a3"))]))
    cfg = make_cfg(tmp_path, [{"kind": "sharegpt", "path": str(path)}], max_turns=2)
    report = run_ingest(cfg).sources[0]
    assert report.cut_to_max_turns == 1
    assert [m["content"] for m in read_prompts(cfg)[0]["messages"]] == ["u1", "a1", "u2", "a2"]


def test_ids_stable_dedupe_across_sources_and_limit_counts_kept(tmp_path: Path) -> None:
    a = tmp_path / "a.txt"
    a.write_text("alpha\nbeta\ngamma\n")
    b = tmp_path / "b.jsonl"
    b.write_bytes(jsonl_bytes([{"messages": [{"role": "user", "content": "beta"}]},
                               {"messages": [{"role": "user", "content": "delta"}]},
                               {"messages": [{"role": "user", "content": "epsilon"}]}]))
    sources = [{"kind": "lines", "path": str(a)}, {"kind": "openai", "path": str(b), "limit": 1}]
    cfg = make_cfg(tmp_path, sources)
    summary = run_ingest(cfg)
    first = cfg.prompts_path.read_bytes()
    assert summary.sources[1].skipped["duplicate"] == 1  # "beta" was already kept from the lines source
    assert summary.sources[1].kept == 1 and summary.sources[1].stopped_at_limit
    assert [p["messages"][0]["content"] for p in read_prompts(cfg)] == ["alpha", "beta", "gamma", "delta"]
    run_ingest(cfg)
    assert cfg.prompts_path.read_bytes() == first
    ids = [p["id"] for p in read_prompts(cfg)]
    assert len(set(ids)) == 4 and all(len(i.split("-")[1]) == 16 for i in ids)


def test_missing_file_is_a_one_line_error(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, [{"kind": "sharegpt", "path": str(tmp_path / "nope.json")}])
    with pytest.raises(SourceError, match=r"nope\.json: no such file \(data\.sources\[0\] \(sharegpt\)\.path\)"):
        run_ingest(cfg)
    with pytest.raises(SourceError, match="no builtin dataset of kind 'lines'"):
        run_ingest(make_cfg(tmp_path, [{"kind": "lines", "path": "builtin"}]))


@pytest.mark.real
def test_real_sharegpt_wheel_streams_to_the_broken_tail(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, [{"kind": "sharegpt", "path": "builtin"}], max_turns=2)
    start = time.perf_counter()
    summary = run_ingest(cfg)
    seconds = time.perf_counter() - start
    report = summary.sources[0]
    whole = report.read - 1  # the last record read is the cut-off tail
    assert 17000 <= whole <= 18500
    assert report.broken_tail and "at byte" in report.broken_tail and f"{whole} whole records" in report.broken_tail
    assert report.skipped["bad_json"] == 1
    assert report.leading_assistant_dropped > 800 and report.skipped["duplicate"] > 0
    assert report.kept + sum(report.skipped.values()) == report.read
    assert len(read_prompts(cfg)) == report.kept
    assert seconds < 30, f"ingest of the 125 MB ShareGPT array took {seconds:.1f} s"


def test_an_empty_or_all_junk_source_is_an_error_and_keeps_the_old_prompts(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text("a prompt\n")
    cfg = make_cfg(tmp_path, [{"kind": "lines", "path": str(good)}])
    run_ingest(cfg)
    before = cfg.prompts_path.read_bytes()
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"not json\n{\"conversations\": 3}\n")
    for path in (junk, tmp_path / "empty.jsonl"):
        path.touch()
        with pytest.raises(StepFailed, match=r"no usable prompt in data\.sources \(\d+ records read, skipped: .*"
                                             r"prompts\.jsonl left as it was") as e:
            run_ingest(make_cfg(tmp_path, [{"kind": "sharegpt", "path": str(path)}]))
        assert e.value.summary.kept == 0
        assert cfg.prompts_path.read_bytes() == before


def test_a_gz_name_on_another_format_is_an_error_naming_the_file(tmp_path: Path) -> None:
    fake = tmp_path / "prompts.jsonl.gz"
    fake.write_bytes(b'{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(SourceError, match=rf"{fake}: not a readable gzip file .*data\.sources\[0\]\.path"):
        run_ingest(make_cfg(tmp_path, [{"kind": "openai", "path": str(fake)}]))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(b'{"messages": [{"role": "user", "content": "hi"}]}\n' * 50)[:40])
    with pytest.raises(SourceError, match=rf"{cut}: not a readable gzip file"):
        run_ingest(make_cfg(tmp_path, [{"kind": "openai", "path": str(cut)}]))


def test_a_prompt_the_eval_measures_is_kept_out_of_training(tmp_path: Path) -> None:
    from common.config import DatasetConfig
    from eval.prompts import load_eval_turns

    turns, _ = load_eval_turns(DatasetConfig(name="mtbench", kind="mtbench", turn=2, limit=1))
    first, second = turns[0]
    path = tmp_path / "chats.jsonl"
    path.write_bytes(jsonl_bytes([
        sg(("human", "  " + first.upper().replace(" ", "\n ") + " "), ("gpt", "...")),  # case and spacing aside
        sg(("human", "Tell me a story."), ("gpt", "Once..."), ("human", second), ("gpt", "...")),  # a later turn
        sg(("human", first + " Please answer in French."), ("gpt", "...")),  # not the same prompt: kept
    ]))
    cfg = parse_config({"run_dir": str(tmp_path / "run"), "target": {"name": "smollm2-135m-instruct"},
                        "data": {"sources": [{"kind": "sharegpt", "path": str(path)}]},
                        "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench", "limit": 5},
                                              {"name": "mtbench_turn2", "kind": "mtbench", "turn": 2, "limit": 5}]}})
    report = run_ingest(cfg).sources[0]
    assert dict(report.skipped) == {"eval_prompt": 2} and report.kept == 1
    assert report.first_skip["eval_prompt"] == "chats.jsonl:1: user turn 1 is a prompt of eval.datasets"
    assert [r["messages"][0]["content"] for r in read_prompts(cfg)] == [first + " Please answer in French."]

"""Ingest through `datasets`: parquet files, save_to_disk directories and a hub id from the local cache give
the same prompts.jsonl as the JSONL reader (same ids, same skips); column mappings; one-line errors naming
the column; eval prompt sets load the same way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
import yaml
from datasets.packaged_modules.parquet.parquet import Parquet

from common.config import ConfigError, DatasetConfig, RunConfig, parse_config
from data_prep.ingest import run_ingest
from data_prep.source_fields import SourceError
from data_prep.steps import run_steps
from eval.prompts import load_eval_prompts

REPO = Path(__file__).resolve().parents[1]


def sg(*turns: tuple[str, Any], rid: str = "x") -> dict[str, Any]:
    return {"id": rid, "conversations": [{"from": r, "value": v} for r, v in turns]}


def oa(*turns: tuple[str, Any], rid: str = "x") -> dict[str, Any]:
    return {"id": rid, "messages": [{"role": r, "content": c} for r, c in turns]}


# One schema per file (columnar files have one): every record has the same keys.
SHAREGPT = [
    sg(("system", "Be brief."), ("human", "Name a colour."), ("gpt", "Red"), ("human", "Another?"), ("gpt", "Blue")),
    sg(("human", "What is 2+2?"), ("gpt", "4")),
    sg(("human", " What is 2+2? "), ("gpt", "four")),                      # duplicate (same prompt)
    sg(("gpt", "I speak first"), ("human", "hi")),                          # opening assistant turn dropped
    sg(("human", "   "), ("gpt", "?")),                                     # empty
    sg(("robot", "beep")),                                                   # unknown_role
    sg(*[(r, f"{r} {i}") for i in range(5) for r in ("human", "gpt")]),     # cut to max_turns
    sg(("human", "caf\u00e9 \u2603 \U0001f600"), ("chatgpt", "ok"), ("bing", "also")),
]
OPENAI = [
    oa(("developer", "sys"), ("user", "hello"), ("assistant", None), ("user", "again")),  # null: a tool call
    oa(("user", "What is 2+2?"), ("assistant", "4")),  # duplicate of a ShareGPT prompt (dedupe spans sources)
    oa(("narrator", "{}")),                                                  # unknown_role ("tool" is a role)
    oa(("user", "hello"), ("assistant", "hi")),
]
# The ShareGPT records under other names, as a custom dataset might hold them.
CUSTOM_ROLES = {"human": "Customer", "gpt": "Agent", "system": "System", "chatgpt": "Agent", "bing": "Agent",
                "robot": "Robot"}
CUSTOM = [{"id": r["id"], "dialog": [{"speaker": CUSTOM_ROLES[t["from"]], "text": t["value"]}
                                     for t in r["conversations"]]} for r in SHAREGPT]
MAPPING = {"messages_field": "dialog", "role_field": "speaker", "content_field": "text",
           "roles": {"customer": "user", "agent": "assistant"}}


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private `datasets` cache: the tests never touch ~/.cache, and can see what was written there."""
    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return str(path)


def write_parquet(path: Path, records: list[dict[str, Any]]) -> str:
    datasets.Dataset.from_list(records).to_parquet(str(path))
    return str(path)


def write_saved(path: Path, records: list[dict[str, Any]]) -> str:
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return str(path)


def write_data_dir(path: Path, records: list[dict[str, Any]]) -> str:
    """A directory of data files, laid out like a hub dataset repo (``hf download --repo-type dataset``)."""
    (path / "data").mkdir(parents=True)
    write_parquet(path / "data" / "train-00000-of-00001.parquet", records)
    return str(path)


def config_tree(root: Path, sources: list[dict[str, Any]]) -> dict[str, Any]:
    return {"run_dir": str(root / "run"), "target": {"name": "smollm2-135m-instruct"},
            "data": {"sources": sources, "max_turns": 3},
            "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench"}]}}


def ingest(root: Path, sources: list[dict[str, Any]]) -> tuple[RunConfig, dict[str, Any]]:
    cfg = parse_config(config_tree(root, sources))
    return cfg, run_ingest(cfg).to_dict()


def skips(summary: dict[str, Any]) -> list[dict[str, int]]:
    return [s["skipped"] for s in summary["sources"]]


@pytest.fixture
def jsonl_reference(tmp_path: Path) -> tuple[bytes, list[dict[str, int]]]:
    """prompts.jsonl and the skip counts from the JSONL reader."""
    cfg, summary = ingest(tmp_path / "jsonl", [
        {"kind": "sharegpt", "path": write_jsonl(tmp_path / "sg.jsonl", SHAREGPT)},
        {"kind": "openai", "path": write_jsonl(tmp_path / "oa.jsonl", OPENAI)}])
    assert summary["kept"] == 7 and skips(summary) == [
        {"duplicate": 1, "empty": 1, "unknown_role": 1}, {"duplicate": 1, "unknown_role": 1}]
    return cfg.prompts_path.read_bytes(), skips(summary)


@pytest.mark.parametrize("write, label", [(write_parquet, "sg.parquet"), (write_saved, "sg.saved"),
                                          (write_data_dir, "sg.data_dir:train")],
                         ids=["parquet", "save_to_disk", "data-files-dir"])
def test_parquet_and_arrow_dirs_ingest_like_jsonl(tmp_path: Path, jsonl_reference, write, label: str,
                                                  datasets_cache: Path) -> None:
    reference, reference_skips = jsonl_reference
    name = write.__name__.removeprefix("write_")
    cfg, summary = ingest(tmp_path / name, [
        {"kind": "sharegpt", "path": write(tmp_path / f"sg.{name}", SHAREGPT)},
        {"kind": "openai", "path": write(tmp_path / f"oa.{name}", OPENAI)}])
    assert cfg.prompts_path.read_bytes() == reference  # same prompts, same ids, same order
    assert skips(summary) == reference_skips
    first = summary["sources"][0]["first_skip"]
    assert first["duplicate"].startswith(f"{label}[2]:") and first["empty"].startswith(f"{label}[4]:")
    prompts = [json.loads(x) for x in reference.decode().splitlines()]
    assert [p["id"].split("-")[0] for p in prompts] == ["sharegpt"] * 5 + ["openai"] * 2
    assert prompts[-1]["messages"][-1] == {"role": "assistant", "content": "hi"}
    # Streaming: reading a parquet file leaves no Arrow copy of it in the cache.
    assert not list(datasets_cache.rglob("*.arrow"))


def test_column_mapping_reads_a_custom_shape_like_sharegpt(tmp_path: Path, jsonl_reference) -> None:
    reference = [json.loads(x) for x in jsonl_reference[0].decode().splitlines()]
    for path in (write_parquet(tmp_path / "custom.parquet", CUSTOM), write_jsonl(tmp_path / "custom.jsonl", CUSTOM)):
        cfg, summary = ingest(tmp_path / Path(path).suffix, [{"kind": "sharegpt", "path": path, **MAPPING}])
        prompts = [json.loads(x) for x in cfg.prompts_path.read_text().splitlines()]
        assert prompts == [p for p in reference if p["source"] == "sharegpt"]
        assert skips(summary) == [jsonl_reference[1][0]]
    # A turn without the mapped fields is a counted missing_field, naming them.
    broken = CUSTOM[:2] + [{"id": "b", "dialog": [{"speaker": "Customer", "text": None}]}]
    broken[2]["dialog"][0].pop("text")
    path = write_jsonl(tmp_path / "broken.jsonl", broken)
    _, summary = ingest(tmp_path / "broken", [{"kind": "sharegpt", "path": path, **MAPPING}])
    assert summary["sources"][0]["first_skip"]["missing_field"] == "broken.jsonl:3: a turn lacks 'speaker' or 'text'"


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}
AGENTIC = [  # thinking and tool calls in one schema: Arrow fills each absent field with None
    {"id": "a", "tools": [WEATHER, CLOCK], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "I should call the tool.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
        {"role": "assistant", "content": "18C and sunny.", "reasoning_content": "The tool answered."},
        {"role": "user", "content": "And the time?"}]},
    {"id": "b", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
    {"id": "c", "messages": [{"role": "user", "content": "Hi"}], "tools": [CLOCK]},  # other tools: another prompt
]


def test_reasoning_and_tool_calls_survive_datasets_sources_like_jsonl(tmp_path: Path) -> None:
    """An agentic OpenAI dataset in parquet or save_to_disk ingests to the JSONL reader's prompts.jsonl byte for
    byte: reasoning_content, tool_calls, tool results and tools kept, Arrow's Nones for absent fields dropped."""
    cfg, summary = ingest(tmp_path / "jsonl", [{"kind": "openai", "path": write_jsonl(tmp_path / "a.jsonl", AGENTIC)}])
    reference = cfg.prompts_path.read_bytes()
    prompts = [json.loads(x) for x in reference.decode().splitlines()]
    assert summary["kept"] == 3 and [p.get("tools") for p in prompts] == [[WEATHER, CLOCK], None, [CLOCK]]
    assert prompts[0]["messages"][1] == {"role": "assistant", "content": "", **{
        k: AGENTIC[0]["messages"][1][k] for k in ("reasoning_content", "tool_calls")}}
    assert prompts[0]["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}
    for write in (write_parquet, write_saved):
        name = write.__name__.removeprefix("write_")
        cfg, summary = ingest(tmp_path / name, [{"kind": "openai", "path": write(tmp_path / f"a.{name}", AGENTIC)}])
        assert cfg.prompts_path.read_bytes() == reference, name


def test_saved_dataset_dict_split_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(SHAREGPT[:2]),
                          "test": datasets.Dataset.from_list(OPENAI[3:])}).save_to_disk(str(path))
    cfg, summary = ingest(tmp_path / "a", [{"kind": "sharegpt", "path": str(path)},
                                           {"kind": "openai", "path": str(path), "split": "test"}])
    assert [s["kept"] for s in summary["sources"]] == [2, 1]
    assert summary["sources"][1]["path"] == "dd:test"
    with pytest.raises(SourceError, match=r"^data.sources\[0\].split: .*dd has no split 'dev'; its splits: train, "
                                          r"test$"):
        ingest(tmp_path / "b", [{"kind": "openai", "path": str(path), "split": "dev"}])
    with pytest.raises(SourceError, match=r"data.sources\[0\].split: .*oa.jsonl is one file, with no splits"):
        ingest(tmp_path / "c", [{"kind": "openai", "path": write_jsonl(tmp_path / "oa.jsonl", OPENAI),
                                 "split": "test"}])


@pytest.mark.parametrize("mapping, message", [
    ({"messages_field": "dialogue"},
     "chats.{ext}: no column 'dialogue' (set by data.sources[0].messages_field); its columns: conversations, id"),
    ({"role_field": "speaker"}, "chats.{ext}: the turns in column 'conversations' have no field 'speaker' (set by "
                                "data.sources[0].role_field); their fields: from, value"),
    ({"content_field": "text"}, "chats.{ext}: the turns in column 'conversations' have no field 'text' (set by "
                                "data.sources[0].content_field); their fields: from, value"),
    ({"kind": "openai"}, "chats.{ext}: no column 'messages' (set by data.sources[0].kind (openai)); its columns: "
                         "conversations, id"),
])
@pytest.mark.parametrize("write, ext", [(write_parquet, "parquet"), (write_jsonl, "jsonl")])
def test_bad_column_mapping_is_a_one_line_error_naming_the_column(tmp_path: Path, capsys, mapping, message,
                                                                  write, ext) -> None:
    source = {"kind": "sharegpt", "path": write(tmp_path / f"chats.{ext}", SHAREGPT)} | mapping
    with pytest.raises(SourceError) as e:
        ingest(tmp_path, [source])
    assert str(e.value) == message.format(ext=ext)
    # The command line prints it as one line (beside the progress bar) and exits 2 (common.cli: an error).
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(config_tree(tmp_path, [source])))
    capsys.readouterr()
    assert run_steps("ingest", config) == 2
    err = capsys.readouterr().err
    assert [x for x in err.splitlines() if x.strip() and not x.startswith("ingest ")] == [
        f"data_prep ingest: error: {message.format(ext=ext)}"], err


def test_mapping_is_for_chat_kinds_and_paths_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^<config>: data.sources.0: role_field: a column mapping is for chat "
                                          r"records \(kind sharegpt or openai\), not kind mtbench$"):
        parse_config(config_tree(tmp_path, [{"kind": "mtbench", "path": "builtin", "role_field": "r"}]))
    with pytest.raises(SourceError, match=r"chats.parquet: no such file \(data.sources\[0\] \(openai\).path\)"):
        ingest(tmp_path, [{"kind": "openai", "path": "chats.parquet"}])
    csv = tmp_path / "chats.csv"
    csv.write_text("a,b\n")
    with pytest.raises(SourceError, match=r"chats.csv: cannot read .csv files \(data.sources\[0\].path\)"):
        ingest(tmp_path, [{"kind": "openai", "path": str(csv)}])


def cache_as_hub_download(records: list[dict[str, Any]], repo_id: str, cache: Path, tmp: Path) -> None:
    """What ``load_dataset(repo_id)`` leaves in HF_DATASETS_CACHE after downloading a parquet dataset:
    ``<org>___<name>/default/0.0.0/<commit>/{dataset_info.json, <name>-train.arrow}``. Written by `datasets`'
    own Parquet builder from a local file (no hub here), under the repo's folder name."""
    org, name = repo_id.split("/")
    parquet = write_parquet(tmp / f"{name}.parquet", records)
    builder = Parquet(cache_dir=str(cache), dataset_name=name, config_id="default", data_files={"train": parquet},
                      hash="0123456789abcdef0123456789abcdef01234567")
    builder.download_and_prepare()
    shutil.move(cache / name, cache / f"{org}___{name}")


def test_hub_id_from_the_local_cache_offline(tmp_path: Path, jsonl_reference, monkeypatch) -> None:
    cache = tmp_path / "hf-home" / "datasets"
    cache_as_hub_download(SHAREGPT, "someorg/tiny-sharegpt", cache, tmp_path)
    cache_as_hub_download(OPENAI, "someorg/tiny-openai", cache, tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(config_tree(tmp_path / "hub", [
        {"kind": "sharegpt", "path": "someorg/tiny-sharegpt"},
        {"kind": "openai", "path": "someorg/tiny-openai", "split": "train"}])))
    # As a user runs it: offline, HF_HOME naming the cache, through the command line.
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "data_prep", "ingest", "--config", str(config)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hub" / "run" / "prompts.jsonl").read_bytes() == jsonl_reference[0]
    assert "| sharegpt | tiny-sharegpt:train | 8 | 5 |" in r.stdout
    # An id the cache does not hold: one line naming it, the key, and where hub ids are looked for offline.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    with pytest.raises(SourceError) as e:
        ingest(tmp_path / "missing", [{"kind": "openai", "path": "someorg/not-cached"}])
    assert len(str(e.value).splitlines()) == 1
    assert str(e.value).startswith("someorg/not-cached: datasets cannot load it (data.sources[0].path): ")
    assert "datasets cache when offline" in str(e.value)


def test_eval_prompt_sets_load_through_datasets_too(tmp_path: Path) -> None:
    def first_turns(path: str, kind: str = "sharegpt", **fields: Any) -> list[str]:
        return load_eval_prompts(DatasetConfig(name="x", kind=kind, path=path, **fields), limit=3)

    want = ["Name a colour.", "What is 2+2?", " What is 2+2? "]
    assert first_turns(write_jsonl(tmp_path / "sg.jsonl", SHAREGPT)) == want
    assert first_turns(write_parquet(tmp_path / "sg.parquet", SHAREGPT)) == want
    assert first_turns(write_saved(tmp_path / "custom", CUSTOM), **MAPPING) == want
    mt = write_parquet(tmp_path / "mt.parquet", [{"question_id": 1, "turns": ["q1", "q1b"]},
                                                 {"question_id": 2, "turns": ["q2"]}])
    assert first_turns(mt, kind="mtbench") == ["q1", "q2"]

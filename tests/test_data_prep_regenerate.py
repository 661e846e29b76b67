"""Regenerate: turn-by-turn feeding (rounds, and the hf backend's stream over conversations), retries and
failures of the OpenAI client, resume after kill -9 or a torn line, and the real target through both backends
(in-process HF: every turn as greedy generate alone; a real llama.cpp server)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from llama_server import LlamaServer, free_port

from common.cli import LLAMA_CPP_CAUSES, exit_reason
from common.config import RunConfig, TargetConfig, parse_config
from common.process_clock import process_age_s
from data_prep.backends import BackendError, HFChatBackend, make_chat_backend
from data_prep.regenerate import run_regenerate
from data_prep.regenerate_files import RegenerateError
from data_prep.regenerate_summary import PHASES, STARTUP_PARTS
from data_prep.step_failed import StepFailed
from engine.profile import EngineProfile

REPO = Path(__file__).resolve().parents[1]


def config_tree(tmp_path: Path, **regen: Any) -> dict[str, Any]:
    return {"run_dir": str(tmp_path / "run"), "target": {"name": "smollm2-135m-instruct", "device": "cpu"},
            "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]}, "regenerate": regen,
            "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench"}]}}


def make_cfg(tmp_path: Path, **regen: Any) -> RunConfig:
    return parse_config(config_tree(tmp_path, **regen))


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def write_prompts(cfg: RunConfig, chats: list[list[dict[str, str]]]) -> list[str]:
    cfg.root.mkdir(parents=True, exist_ok=True)
    ids = [f"test-{i:04d}" for i in range(len(chats))]
    with open(cfg.prompts_path, "w") as f:
        for pid, chat in zip(ids, chats, strict=True):
            f.write(json.dumps({"id": pid, "source": "test", "messages": chat}) + "\n")
    return ids


def read_conversations(cfg: RunConfig) -> list[dict[str, Any]]:
    return [json.loads(line) for line in cfg.conversations_path.read_bytes().split(b"\n") if line]


def assert_each_id_once(cfg: RunConfig, ids: list[str]) -> list[dict[str, Any]]:
    assert cfg.conversations_path.read_bytes().endswith(b"\n")
    records = read_conversations(cfg)
    assert sorted(r["id"] for r in records) == sorted(ids)
    return records


LOOPING = "Sure. " + "Let me say it again. " * 60  # what a small target at T=0 answers too often


class FakeChat(BaseHTTPRequestHandler):
    """An OpenAI-style echo server (chats, and text completions of a raw prompt); a user turn or prompt containing
    "[503x2]" gets HTTP 503 for its first 2 requests, one containing "[loop]" an answer that loops until max_tokens, one
    containing "[slow]" its answer after 20 ms."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        srv: Any = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = "prompt" in body  # a text completion (/v1/completions): the raw prompt, continued
        last = body["prompt"] if text else body["messages"][-1]["content"]
        with srv.lock:
            srv.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
            srv.seen[last] += 1
            n = srv.seen[last]
        if "[slow]" in last:
            time.sleep(0.02)
        fail = re.search(r"\[(\d{3})x(\d+)\]", last)
        if fail and n <= int(fail[2]):
            self.send_error(int(fail[1]))
            return
        content, finish = (LOOPING, "length") if "[loop]" in last else (f"echo {last}", "stop")
        answer = {"text": content} if text else {"message": {"role": "assistant", "content": content}}
        reply = json.dumps({"choices": [{"index": 0, "finish_reason": finish, **answer}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def regenerate_loads_the_session_smollm2(smollm2: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hf backend, asked to load the target, gets the session's SmolLM2: loading it again costs seconds per test
    and tests nothing new (subprocesses a test starts still load their own)."""
    from target_model import hf_model

    monkeypatch.setattr(hf_model, "load_target_from_config", lambda target_cfg, seconds=None: smollm2)


@pytest.fixture
def fake() -> Iterator[Any]:
    srv: Any = ThreadingHTTPServer(("127.0.0.1", 0), FakeChat)
    srv.requests, srv.seen, srv.lock = [], Counter(), threading.Lock()
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def openai_cfg(tmp_path: Path, urls: list[str], template_kwargs: dict | None = None, **regen: Any) -> RunConfig:
    tree = config_tree(tmp_path, **({"backend": "openai", "server_urls": urls, "retry_backoff_s": 0.01,
                                     "concurrency": 2, "batch_size": 2, "timeout_s": 10} | regen))
    tree["target"]["chat_template_kwargs"] = template_kwargs or {}
    return parse_config(tree)


def test_turn_by_turn_feeds_back_the_targets_answers(tmp_path: Path, fake: Any) -> None:
    cfg = openai_cfg(tmp_path, [fake.url + "/v1"], {"enable_thinking": False}, top_k=20, max_new_tokens=7, seed=3,
                     num_prompts=2)
    system = {"role": "system", "content": "be brief"}
    ids = write_prompts(cfg, [
        [system, user("u1"), {"role": "assistant", "content": "old answer 1"}, user("u2"),
         {"role": "assistant", "content": "old answer 2"}],
        [user("v1")],
        [user("not selected: num_prompts=2")],
    ])
    summary = run_regenerate(cfg)
    records = {r["id"]: r for r in assert_each_id_once(cfg, ids[:2])}
    assert records[ids[0]]["messages"] == [system, user("u1"), {"role": "assistant", "content": "echo u1"},
                                           user("u2"), {"role": "assistant", "content": "echo u2"}]
    assert records[ids[0]]["finish_reasons"] == ["stop", "stop"] and records[ids[0]]["backend"] == "openai"
    assert records[ids[1]]["messages"][-1] == {"role": "assistant", "content": "echo v1"}
    second_turn = next(r["body"] for r in fake.requests if r["body"]["messages"][-1]["content"] == "u2")
    assert second_turn["messages"] == records[ids[0]]["messages"][:-1]
    sent = {k: second_turn[k] for k in ("top_k", "max_tokens", "seed", "temperature", "chat_template_kwargs")}
    assert sent == {"top_k": 20, "max_tokens": 7, "seed": 3, "temperature": 0.0,
                    "chat_template_kwargs": {"enable_thinking": False}}
    assert all(r["path"] == "/v1/chat/completions" for r in fake.requests) and len(fake.requests) == 3
    assert (summary.written, summary.records, summary.turns, summary.missing) == (2, 2, 3, 0)
    assert summary.finish_reasons == {"stop": 3} and "3 answers" in str(summary)
    assert json.loads(json.dumps(summary.to_dict()))["selected"] == 2


@pytest.mark.parametrize("stop_loops", [True, False])
def test_a_servers_looping_answer_is_cut_afterwards_and_counted(tmp_path: Path, fake: Any, stop_loops: bool) -> None:
    """A server cannot stop on a loop: with regenerate.stop_loops the returned answer is cut by the target's
    tokens to the loop's first copy (finish reason "loop") and counted; other answers are left alone."""
    cfg = openai_cfg(tmp_path, [fake.url], stop_loops=stop_loops)
    ids = write_prompts(cfg, [[user("q [loop]"), {"role": "assistant", "content": "old"}, user("again")],
                              [user("plain")]])
    summary = run_regenerate(cfg)
    records = {r["id"]: r for r in assert_each_id_once(cfg, ids)}
    looped, plain = records[ids[0]], records[ids[1]]
    assert plain["messages"][-1]["content"] == "echo plain" and plain["finish_reasons"] == ["stop"]
    answer = looped["messages"][1]["content"]
    sent = next(r["body"] for r in fake.requests if r["body"]["messages"][-1]["content"] == "again")
    assert sent["messages"][1]["content"] == answer  # the next turn is asked after the answer as kept
    if not stop_loops:
        assert (answer, looped["finish_reasons"], summary.loop_cuts) == (LOOPING, ["length", "stop"], 0)
        return
    # the block that repeats is ". Let me say it again" (its first "." follows "Sure"): one copy is kept
    assert answer == "Sure. Let me say it again" and LOOPING.startswith(answer)
    assert looped["finish_reasons"] == ["loop", "stop"]
    assert (summary.loop_cuts, summary.loop_tokens_kept, summary.loop_answers) == (1, 7, 1)
    assert summary.loop_tokens_generated == 2 + 6 * 60 + 1  # the last token, a lone " ", breaks the period
    assert summary.flagged["loop"] == [ids[0]] and "1 answers cut at their loop's first copy" in str(summary)


def test_a_servers_looping_answer_keeps_the_asked_tokens_of_its_copies(tmp_path: Path, fake: Any) -> None:
    """regenerate.loop_keep_tokens: the cut moves past the first copy by that many of the answer's tokens (here
    one more period of ". Let me say it again", 6 tokens); more than loop_min_repeat_tokens is refused at load."""
    cfg = openai_cfg(tmp_path, [fake.url], loop_keep_tokens=6)
    ids = write_prompts(cfg, [[user("q [loop]")]])
    summary = run_regenerate(cfg)
    (rec,) = assert_each_id_once(cfg, ids)
    assert rec["messages"][1]["content"] == "Sure. Let me say it again. Let me say it again"
    assert (rec["finish_reasons"], summary.loop_tokens_kept) == (["loop"], 13)
    with pytest.raises(ValueError, match="loop_keep_tokens 65 > loop_min_repeat_tokens 64"):
        openai_cfg(tmp_path, [fake.url], loop_keep_tokens=65)


@pytest.mark.parametrize("streaming", [False, True])
def test_loop_cuts_and_answer_tokens_are_summed_over_the_run(tmp_path: Path, streaming: bool) -> None:
    from data_prep.backends import Completion
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate

    def complete(self: Any, batch: list[list[dict[str, str]]], tools: list[Any] | None = None) -> list[Any]:
        return [Completion(text="x", finish_reason="loop", loop_tokens=(320, 100), tokens=100)
                if "[loop]" in c[-1]["content"] else Completion(text="y", finish_reason="stop", tokens=7)
                for c in batch]

    cfg = make_cfg(tmp_path)
    write_prompts(cfg, [[user("a [loop]"), user("b [loop]")], [user("c")], [user("d [loop]")]])
    backend_cls = type("Looping", (ScriptedStreamBackend if streaming else ScriptedBackend,), {"complete": complete})
    backend = backend_cls(cfg.conversations_path) if streaming else backend_cls()
    summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), backend)
    assert (summary.loop_cuts, summary.loop_tokens_generated, summary.loop_tokens_kept) == (3, 960, 300)
    assert summary.answer_tokens == 307 and "(307 answer tokens)" in summary.to_markdown()
    assert summary.finish_reasons == {"loop": 3, "stop": 1} and summary.loop_answers == 3
    assert "3 cut at a loop" in summary.to_markdown()


def test_503_is_retried_with_backoff_until_success(tmp_path: Path, fake: Any) -> None:
    cfg = openai_cfg(tmp_path, [fake.url], max_retries=3)
    ids = write_prompts(cfg, [[user("[503x2] flaky")]])
    summary = run_regenerate(cfg)
    assert summary.written == 1 and not summary.failed
    assert fake.seen["[503x2] flaky"] == 3
    assert_each_id_once(cfg, ids)


def test_400_fails_the_record_at_once_and_a_rerun_fills_the_gap(tmp_path: Path, fake: Any) -> None:
    cfg = openai_cfg(tmp_path, [fake.url], max_retries=3)
    ids = write_prompts(cfg, [[user("[400x1] rejected once")], [user("fine")]])
    with pytest.raises(StepFailed, match=r"1 of 2 prompts failed \(http_400: 1; .*max_failure_share") as failed:
        run_regenerate(cfg)  # half the prompts failed: not a success, though the good one is kept
    first = failed.value.summary
    assert first.failed == {"http_400": 1} and first.written == 1 and first.missing == 1
    assert fake.seen["[400x1] rejected once"] == 1, "a 400 must not be retried"
    assert "failed http_400: 1" in str(first) and "HTTP 400" in first.failure_examples["http_400"]
    second = run_regenerate(cfg)
    assert (second.already_done, second.written, second.missing, second.records) == (1, 1, 0, 2)
    assert_each_id_once(cfg, ids)


def test_refused_connections_fail_over_round_robin_then_count(tmp_path: Path, fake: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    cfg = openai_cfg(tmp_path, [dead, fake.url], max_retries=1, concurrency=1, batch_size=1)
    ids = write_prompts(cfg, [[user("a")], [user("b")]])
    summary = run_regenerate(cfg)  # every first attempt hits the dead server, its retry the live one
    assert summary.written == 2 and not summary.failed and len(fake.requests) == 2
    assert_each_id_once(cfg, ids)
    cfg = openai_cfg(tmp_path / "dead", [dead], max_retries=5, retry_backoff_s=30)
    write_prompts(cfg, [[user("a")]])
    started = time.monotonic()
    with pytest.raises(StepFailed, match="connection_refused: 1") as failed:
        run_regenerate(cfg)
    assert time.monotonic() - started < 5  # two quick tries, not 30 s + 60 s + ... of backoff
    summary = failed.value.summary
    assert summary.failed == {"connection_refused": 1} and summary.records == 0 and summary.missing == 1
    assert "every server refused the connection 2x" in summary.failure_examples["connection_refused"]


def test_torn_last_line_is_cut_and_every_id_ends_once(tmp_path: Path, fake: Any) -> None:
    cfg = openai_cfg(tmp_path, [fake.url], num_prompts=1)
    ids = write_prompts(cfg, [[user(f"q{i}")] for i in range(4)])
    run_regenerate(cfg)
    torn = b'{"id": "test-0001", "source": "test", "messages": [{"role": "us'
    with open(cfg.conversations_path, "ab") as f:
        f.write(torn)
    summary = run_regenerate(openai_cfg(tmp_path, [fake.url]))
    assert summary.torn_bytes_dropped == len(torn)
    assert (summary.already_done, summary.written, summary.records, summary.duplicate_ids) == (1, 3, 4, 0)
    assert_each_id_once(cfg, ids)
    with open(cfg.conversations_path, "ab") as f:
        f.write(b"not json\n")
    with pytest.raises(RegenerateError, match=r"conversations\.jsonl:5: .* damaged"):
        run_regenerate(cfg)


def test_api_key_comes_from_the_env_and_is_never_shown(tmp_path: Path, fake: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = openai_cfg(tmp_path, [fake.url], api_key_env="TEST_REGEN_KEY")
    write_prompts(cfg, [[user("[400x1] hi")]])
    with pytest.raises(BackendError, match="TEST_REGEN_KEY is not set"):
        run_regenerate(cfg)
    monkeypatch.setenv("TEST_REGEN_KEY", "sk-secret-123")
    with pytest.raises(StepFailed) as failed:
        run_regenerate(cfg)
    summary = failed.value.summary
    assert fake.requests[-1]["auth"] == "Bearer sk-secret-123"
    assert "sk-secret" not in str(summary) and "sk-secret" not in json.dumps(summary.to_dict())


def test_missing_prompts_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(RegenerateError, match=r"prompts\.jsonl: no prompts file; run `python -m data_prep ingest`"):
        run_regenerate(make_cfg(tmp_path))


def test_empty_or_undecodable_prompts_are_errors_naming_file_and_line(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path)
    write_prompts(cfg, [])
    with pytest.raises(RegenerateError, match=r"prompts\.jsonl: no prompts in it; rerun ingest"):
        run_regenerate(cfg)
    write_prompts(cfg, [[user("fine")], [user("also fine")]])
    with open(cfg.prompts_path, "ab") as f:
        f.write(b'{"id": "x", "source": "t", "messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(RegenerateError, match=r"prompts\.jsonl:3: invalid UTF-8 at byte \d+ of the line"):
        run_regenerate(cfg)


@pytest.mark.parametrize(("fields", "problem"), [
    ({"id": ["p1"]}, "id must be a string, not a list"),
    ({"id": 7}, "id must be a string, not a number"),
    ({"id": None}, "id must be a string, not null"),
    ({"messages": "hi"}, "messages must be a list, not a string"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages must be a list, not an object"),
])
def test_a_prompt_field_of_the_wrong_type_is_an_error_naming_the_line(tmp_path: Path, fields: dict,
                                                                      problem: str) -> None:
    from data_prep.regenerate_files import load_prompt_records

    cfg = make_cfg(tmp_path)
    write_prompts(cfg, [[user("fine")]])
    with open(cfg.prompts_path, "a") as f:
        f.write(json.dumps({"id": "x", "source": "t", "messages": [user("hi")]} | fields) + "\n")
    with pytest.raises(RegenerateError) as e:
        load_prompt_records(cfg.prompts_path, None)
    assert str(e.value) == f"{cfg.prompts_path}:2: {problem}; rerun ingest"


def test_a_turn_no_answer_would_follow_is_an_error_not_left_out(tmp_path: Path) -> None:
    """A system turn after a prompt's last user turn gets no answer, so the conversation would lose it uncounted:
    ingest drops and counts it, and a prompts file that still has one is refused before any model loads."""
    from data_prep.regenerate_files import load_prompt_records, unanswered_role

    assert unanswered_role(["system", "user", "assistant", "tool", "assistant"]) is None  # answered: the tool results
    assert unanswered_role(["user", "system", "assistant"]) == "system"
    cfg = make_cfg(tmp_path)
    write_prompts(cfg, [[user("fine"), {"role": "assistant", "content": "ok"}],
                        [user("hi"), {"role": "assistant", "content": "hello"},
                         {"role": "system", "content": "From now on answer in French."}]])
    with pytest.raises(RegenerateError) as e:
        load_prompt_records(cfg.prompts_path, None)
    assert str(e.value) == (f"{cfg.prompts_path}:2: prompt test-0001 has a system turn after its last user turn or "
                            "tool result, which no answer would follow; rerun ingest")
    assert len(load_prompt_records(cfg.prompts_path, 1)) == 1


def test_failure_share_and_consecutive_failures(tmp_path: Path, fake: Any) -> None:
    # 1 failure in 30 prompts (3 %) is within the default 5 %: done, and the rerun retries it.
    cfg = openai_cfg(tmp_path / "share", [fake.url], concurrency=4, batch_size=4)
    write_prompts(cfg, [[user("[400x1] once")]] + [[user(f"q{i}")] for i in range(29)])
    assert run_regenerate(cfg).failed == {"http_400": 1}
    # 2 in 30 (6.7 %) is not.
    cfg = openai_cfg(tmp_path / "share2", [fake.url], concurrency=4, batch_size=4)
    write_prompts(cfg, [[user("[400x1] two")], [user("[400x1] three")]] + [[user(f"r{i}")] for i in range(28)])
    with pytest.raises(StepFailed, match=r"2 of 30 prompts failed \(http_400: 2"):
        run_regenerate(cfg)
    # A dead run stops after max_consecutive_failures prompts in a row, leaving the rest untried.
    cfg = openai_cfg(tmp_path / "dead", [fake.url], concurrency=2, batch_size=2, max_consecutive_failures=4,
                     max_failure_share=1.0)
    write_prompts(cfg, [[user(f"[400x9] q{i}")] for i in range(40)])
    with pytest.raises(StepFailed, match=r"4 of 4 prompts failed .*stopped early: 4 prompts in a row failed "
                                         r"\(regenerate\.max_consecutive_failures=4\); 36 not tried") as failed:
        run_regenerate(cfg)
    assert "stopped early" in str(failed.value.summary) and len(fake.requests) < 40 + 31 + 31


def _regenerate_cli(cfg_tree: dict[str, Any], tmp_path: Path, env: dict[str, str] | None = None,
                    timeout: float = 60) -> subprocess.CompletedProcess:
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(cfg_tree))
    return subprocess.run([sys.executable, "-m", "data_prep", "regenerate", "--config", str(cfg_file)],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout,
                          env=os.environ | (env or {}))


def test_closed_port_exits_2_within_seconds(tmp_path: Path) -> None:
    """Nothing listens on the port: with the default retry settings (5 retries, backoff from 1 s, up to
    60 s) the step must still end at once, with exit 2, instead of retrying every prompt for minutes."""
    tree = config_tree(tmp_path, backend="openai", server_urls=[f"http://127.0.0.1:{free_port()}"])
    write_prompts(parse_config(tree), [[user(f"q{i}")] for i in range(300)])
    started = time.monotonic()
    r = _regenerate_cli(tree, tmp_path, timeout=120)
    elapsed = time.monotonic() - started
    assert r.returncode == 2, r.stderr
    assert elapsed < 30, elapsed
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("data_prep regenerate: error: ") and "prompts failed (connection_refused: " in last, last
    assert "stopped early" in last and "Connection refused" in last, last


def assert_phases_add_up(phases: dict[str, float], expected: set[str]) -> None:
    """The summary's seconds by phase: those expected (the process's age where the kernel gives it), none
    negative, the startup's parts within the startup, and the process's age covering all of them in order."""
    timed = process_age_s() is not None
    assert set(phases) == {k for k in expected if timed or k not in ("startup_s", "interpreter_and_imports_s",
                                                                      "process_s")}, phases
    assert all(v >= 0 for v in phases.values()), phases
    ms = 0.001 * len(phases)  # each figure is rounded to the ms
    if timed:
        assert phases.get("interpreter_and_imports_s", 1) > 0
        assert sum(phases.get(k, 0) for k in STARTUP_PARTS) <= phases["startup_s"] + ms, phases
    if "process_s" in phases:
        after = sum(phases.get(k, 0) for k in ("step_s", "validate_s", "close_s"))
        assert phases["startup_s"] + after <= phases["process_s"] + ms, phases


def test_the_summary_says_where_the_process_seconds_went(tmp_path: Path, fake: Any) -> None:
    """The command's summary splits its seconds by phase, measured in the process from its start; what the
    process measured ends before the command's wall time does (the rest is its exit)."""
    tree = config_tree(tmp_path, backend="openai", server_urls=[fake.url], concurrency=2, batch_size=2)
    write_prompts(parse_config(tree), [[user(f"q{i}"), {"role": "assistant", "content": "a"}, user(f"r{i}")]
                                       for i in range(3)])
    started = time.perf_counter()
    r = _regenerate_cli(tree, tmp_path)
    wall = time.perf_counter() - started
    assert r.returncode == 0, r.stderr
    s = json.loads((tmp_path / "run" / "data_prep_summary.json").read_text())["regenerate"]
    phases = s["phases"]
    assert_phases_add_up(phases, set(PHASES))
    assert phases["step_s"] == round(s["seconds"], 3) and s["device_phases"] == []
    assert phases.get("process_s", 0) <= wall
    assert "seconds by phase: startup " in r.stdout or "seconds by phase: before the step (" in r.stdout


def test_a_profiled_step_samples_its_host_and_the_command_does_not(tmp_path: Path, fake: Any) -> None:
    """Profiled (a benchmark's ``EngineProfile(sample_host=True)``), the step's main thread is sampled and the
    summary's engine holds the samples: the regenerate loop among the functions sampled. The command profiles
    nothing."""
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate

    tree = config_tree(tmp_path, backend="openai", server_urls=[fake.url], concurrency=2, batch_size=2)
    cfg = parse_config(tree)
    # answers that take a few ms each: a run of a few ms could end between two 5 ms samples
    write_prompts(cfg, [[user(f"q{i} [slow]")] for i in range(4)])
    profile, backend = EngineProfile(sample_host=True), make_chat_backend(cfg.target, cfg.regenerate)
    try:
        summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), backend, profile=profile)
    finally:
        backend.close()
    got = summary.engine["host_samples"]
    assert got["samples"] >= 1 and got["interval_s"] > 0 and profile.sampler is not None
    # the samples are of the regenerate call's main thread (a quick run may hold one sample, in any of its phases)
    assert any(where.startswith("data_prep/regenerate_loop.py ") and credit > 0
               for where, credit in profile.sampler.inclusive.items()), got
    cfg.conversations_path.unlink()
    r = _regenerate_cli(tree, tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run" / "data_prep_summary.json").read_text())["regenerate"]["engine"] == {}


class EchoAuth(BaseHTTPRequestHandler):
    """A server that puts the request's Authorization header in its 401 body (seen in the wild)."""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        auth = self.headers.get("Authorization", "")
        raw = f"401 Unauthorized: bad token {auth}; raw {auth[7:]}; api_key={auth[7:]}".encode()
        self.send_response(401)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_echoing_the_key_leaves_it_in_no_output_and_no_file(tmp_path: Path) -> None:
    key = "sk-live-0123456789abcdefSECRET"
    srv = ThreadingHTTPServer(("127.0.0.1", 0), EchoAuth)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        tree = config_tree(tmp_path, backend="openai", server_urls=[f"http://127.0.0.1:{srv.server_address[1]}"],
                           api_key_env="TEST_ECHO_KEY", concurrency=2, batch_size=2)
        write_prompts(parse_config(tree), [[user(f"q{i}")] for i in range(6)])
        r = _regenerate_cli(tree, tmp_path, env={"TEST_ECHO_KEY": key})
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == 2
    assert "HTTP 401" in r.stdout + r.stderr and "[REDACTED]" in r.stdout + r.stderr  # the failure is shown
    for text in (r.stdout, r.stderr):
        assert key not in text and key[:12] not in text
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "data_prep_summary.json" for p in files)
    for p in files:
        data = p.read_bytes()
        assert key.encode() not in data and key[:12].encode() not in data, p


@pytest.mark.real
def test_hf_backend_batching_and_finish_reasons(tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path, max_new_tokens=12)
    backend = HFChatBackend(cfg.target, cfg.regenerate)
    short = [user("What is the capital of France? Answer in one word.")]
    long = [{"role": "system", "content": "You are a storyteller."},
            user("Write a long story about a dragon who learns to write compilers.")]
    alone = backend.complete([short])[0]
    story, padded = backend.complete([long, short])
    assert padded == alone, "batching with a longer chat changed a greedy answer"
    assert alone.finish_reason == "stop" and "Paris" in alone.text and "<|im_end|>" not in alone.text
    assert story.finish_reason == "length" and story.text.strip()
    built = backend.build_s  # where a process's load went: each part named, none left out
    assert set(built["target_s_by_part"]) == {"imports_s", "source_s", "tokenizer_s", "weights_s", "to_device_s"}
    assert sum(built["target_s_by_part"].values()) == pytest.approx(built["target_s"], abs=0.06)


@pytest.mark.usefixtures("regenerate_loads_the_session_smollm2")
@pytest.mark.real
def test_real_smollm2_answers_that_loop_at_512_tokens_end_at_their_loop(tmp_path: Path, smollm2, monkeypatch) -> None:
    """Greedy SmolLM2 loops on most MT-Bench writing prompts. At max_new_tokens=512 without stop_loops
    these run to the cap with a loop at the end; with it they end as "loop" after a few hundred tokens, and what
    is kept is the start of the answer generated without it, token for token. A prompt answered without a loop
    is the same answer either way. The cut answers are the hf backend's (its engine's, seen through ``Stream.poll``):
    its text and loop counts are those tokens'."""
    from common.config import DatasetConfig
    from data_prep.loss_mask import prompt_text
    from engine import continuous_batching as cb
    from engine.batched import BatchedTarget
    from engine.loops import loop_start
    from engine.requests import Generated
    from eval.prompts import load_eval_prompts
    from target_model import hf_model

    tok = smollm2.tokenizer
    mtbench = load_eval_prompts(DatasetConfig(name="mtbench", kind="mtbench"), 80)
    chats = [[user(mtbench[i])] for i in (4, 11, 10, 21)]  # a character, Sheldon, Elon Musk; the red house riddle
    ids = [tok(prompt_text(tok, c), add_special_tokens=False)["input_ids"] for c in chats]
    cfg = make_cfg(tmp_path, max_new_tokens=512, batch_size=4)
    r = cfg.regenerate
    assert r.stop_loops and (r.loop_min_repeat_tokens, r.loop_max_period) == (64, 256)  # the defaults
    plain = cb.generate(BatchedTarget(smollm2.model), ids, 512, hf_model.stop_token_ids(tok), cpu_slots=4)

    seen: dict[int, Generated] = {}
    poll = cb.Stream.poll

    def spy(stream: cb.Stream) -> list:
        assert stream.loops and (stream.loops.min_repeat_tokens, stream.loops.max_period) == (64, 256)
        done = poll(stream)
        seen.update(done)
        return done

    monkeypatch.setattr(cb.Stream, "poll", spy)
    answers = HFChatBackend(cfg.target, r).complete(chats)
    cut = [seen[i] for i in range(len(chats))]
    looped = 0
    for p, o in zip(plain, cut, strict=True):
        if o.finish_reason == "loop":
            looped += 1
            assert p.finish_reason == "length" and len(p.tokens) == 512
            assert loop_start(p.tokens) is not None  # the uncut answer still ends in a loop at the cap
            assert len(o.tokens) < o.generated < 512 and o.tokens == p.tokens[:len(o.tokens)]
        else:
            assert (o.tokens, o.finish_reason) == (p.tokens, p.finish_reason)
    assert looped >= 2 and cut[3].finish_reason == "stop"
    for a, o in zip(answers, cut, strict=True):
        assert a.finish_reason == o.finish_reason and a.text == tok.decode(o.tokens, skip_special_tokens=True)
        assert a.loop_tokens == ((o.generated, len(o.tokens)) if o.finish_reason == "loop" else None)


MULTI_TURN = [  # (system?, user turns): 1 to 4 user turns, a source answer between them (replaced)
    (None, ["Name three fruits.", "Which of them is the sweetest?", "Write a haiku about it."]),
    ("You are terse.", ["What is 2 + 2?", "And times 3?"]),
    (None, ["Say hello in French."]),
    (None, ["List the planets of the solar system in order from the sun, one per line, with one fact each.",
            "Which one is the largest?", "How many moons does it have?", "Thanks!"]),
    (None, ["Translate 'good morning' into Spanish.", "And into German?"]),
    (None, ["Give me a word that rhymes with cat.", "Another one?", "One more?"]),
]


def multi_turn_chats() -> list[list[dict[str, str]]]:
    chats = []
    for system, turns in MULTI_TURN:
        chat = [{"role": "system", "content": system}] if system else []
        for t in turns:
            chat += [user(t), {"role": "assistant", "content": "(the source's answer, replaced)"}]
        chats.append(chat)
    return chats


@pytest.mark.usefixtures("regenerate_loads_the_session_smollm2")
@pytest.mark.real
def test_real_smollm2_multi_turn_stream_answers_every_turn_as_greedy_generate_alone(tmp_path: Path, smollm2,
                                                                                    monkeypatch) -> None:
    """The stream over conversations, fp32, 3 rows for 6 conversations of 1-4 turns, so turns of different
    conversations share steps and rows are refilled mid-run: every turn's answer equals HF ``generate``'s
    greedy answer to that turn's prompt alone (the chat so far, the target's earlier answers in it, rendered
    by ``loss_mask.prompt_text``), finish reason included; a conversation whose next prompt no longer leaves
    room for an answer ends there (context_full), as the reference's budget says. Later turns continue in
    their conversation's row: the engine prefills only what follows the ids the row holds (the real template and
    tokenizer: the answer's text tokenized again, then the end-of-turn marker and the next user turn)."""
    from data_prep.loss_mask import prompt_text
    from data_prep.prompt_prefetch import PromptPrefetch
    from target_model import hf_model

    # chunks of 2 first prompts, fewer than the rows: the stream opens only what the thread has ready
    monkeypatch.setattr(PromptPrefetch, "CHUNK", 2)
    max_new_tokens, max_context = 20, 130
    cfg = make_cfg(tmp_path, max_new_tokens=max_new_tokens, batch_size=3, max_context_tokens=max_context)
    ids = write_prompts(cfg, multi_turn_chats())
    summary = run_regenerate(cfg, profile=True)
    records = {r["id"]: r for r in assert_each_id_once(cfg, ids)}
    tok, stops = smollm2.tokenizer, hf_model.stop_token_ids(smollm2.tokenizer)
    answers = dropped = 0
    for pid, (system, turns) in zip(ids, MULTI_TURN, strict=True):
        msgs, reasons = records[pid]["messages"], records[pid]["finish_reasons"]
        asked = [m for m in msgs if m["role"] != "assistant"]
        assert [m["content"] for m in asked] == ([system] if system else []) + turns[:len(reasons)]
        turn = 0
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            ids_in = tok(prompt_text(tok, msgs[:i]), add_special_tokens=False)["input_ids"]
            budget = min(max_new_tokens, max_context - len(ids_in))
            out = smollm2.model.generate(torch.tensor([ids_in]), max_new_tokens=budget, do_sample=False,
                                         eos_token_id=stops, pad_token_id=tok.pad_token_id)[0, len(ids_in):].tolist()
            end = next((j for j, t in enumerate(out) if t in stops), None)
            assert m["content"] == tok.decode(out if end is None else out[:end], skip_special_tokens=True), (pid, i)
            assert reasons[turn] == ("length" if end is None else "stop"), (pid, turn)
            turn += 1
            answers += 1
        if len(reasons) < len(turns):  # ended for lack of room: the next turn's prompt leaves none
            dropped += len(turns) - len(reasons)
            nxt = tok(prompt_text(tok, msgs + [user(turns[len(reasons)])]), add_special_tokens=False)["input_ids"]
            assert len(nxt) >= max_context, pid
    assert answers == summary.turns >= 10 and dropped == summary.turns_dropped_context_full >= 1
    assert summary.engine["rows"] == 3 and summary.answer_tokens > 0
    e = summary.engine
    assert e["continued"] > 0 and e["reused_prefix_tokens"] > e["prefill_tokens"] / 2, e
    assert e["prefill_s"] > 0 and e["decode_s"] > 0 and sum(e["steps_by_live_rows"].values()) == e["steps"]
    # the follow-ups above were tokenized from their previous prompts' ids, and every answer is generate's for
    # the whole prompt tokenized anew
    assert e["prompt_shortcuts"] > 0 and e["prompt_tokens_kept"] > 0 and e["prompt_shortcut_off"] is None, e
    # and every first turn was rendered and tokenized on the prefetch thread (the answers above hold for them)
    assert e["prompts_prefetched"] == len(ids) and e["prompts_tokenized_whole"] == 0, e
    assert e["prefetch_error"] is None, e
    # profiled: the caller's time by part (chat templates, tokenizing, detokenizing, writing conversations)
    assert set(e["caller_s_by_part"]) == {"render_s", "tokenize_s", "detokenize_s", "write_s"}, e
    assert e["host_samples"]["samples"] > 0, e


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen, log: Path, limit_s: float,
                    causes: dict[int, str] | None = None) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= n:
            return
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[:3]} exited early ({exit_reason(proc.returncode, causes)}): "
                        f"{log.read_text()[-2000:]}")
        time.sleep(0.02)
    pytest.fail(f"no record written to {path} within {limit_s} s")


@pytest.mark.usefixtures("regenerate_loads_the_session_smollm2")
@pytest.mark.real
def test_kill9_during_hf_regenerate_loses_only_conversations_in_flight(tmp_path: Path) -> None:
    """The stream writes a conversation the moment its last turn is answered. A subprocess regenerating 10
    conversations of 1-4 turns through 2 rows is killed with SIGKILL once the first is on disk: every line
    there is a whole conversation, each of its turns answered; the rerun skips those and finishes the rest; and
    the file then holds, id for id, what an uninterrupted run writes."""
    chats = multi_turn_chats() + [[user(f"Name a fruit that starts with the letter {c}.")] for c in "ABCD"]
    tree = config_tree(tmp_path / "killed", backend="hf", batch_size=2, max_new_tokens=8)
    cfg = parse_config(tree)
    ids = write_prompts(cfg, chats)
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(tree))
    code = ("import sys; from common.config import load_config; from data_prep.regenerate import run_regenerate; "
            "run_regenerate(load_config(sys.argv[1]))")
    log = tmp_path / "child.log"
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}  # 1 thread: see LlamaServer
    proc = subprocess.Popen([sys.executable, "-c", code, str(cfg_file)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "wb"))
    try:
        _wait_for_lines(cfg.conversations_path, 1, proc, log, limit_s=180)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()

    before = cfg.conversations_path.read_bytes()
    whole = before[: before.rfind(b"\n") + 1]
    done_before = whole.count(b"\n")
    assert proc.returncode == -signal.SIGKILL and 1 <= done_before < len(ids), "the kill did not land mid-run"
    turns = {pid: sum(m["role"] == "user" for m in chat) for pid, chat in zip(ids, chats, strict=True)}
    for line in whole.splitlines():
        rec = json.loads(line)  # whole, and complete: every turn answered
        assert len(rec["finish_reasons"]) == turns[rec["id"]] and rec["messages"][-1]["role"] == "assistant"
    summary = run_regenerate(cfg)
    assert summary.already_done == done_before and summary.written == len(ids) - done_before
    assert summary.duplicate_ids == 0 and summary.missing == 0
    assert cfg.conversations_path.read_bytes().startswith(whole)
    resumed = {r["id"]: r for r in assert_each_id_once(cfg, ids)}
    straight = make_cfg(tmp_path / "straight", backend="hf", batch_size=2, max_new_tokens=8)
    write_prompts(straight, chats)
    run_regenerate(straight)
    for r in assert_each_id_once(straight, ids):
        assert (resumed[r["id"]]["messages"], resumed[r["id"]]["finish_reasons"]) == (r["messages"],
                                                                                   r["finish_reasons"])
        assert r["backend"] == "hf" and len(r["finish_reasons"]) == turns[r["id"]]


def test_a_server_killed_by_a_signal_is_named_with_its_likely_cause(tmp_path: Path) -> None:
    """A llama.cpp built for another CPU dies with SIGILL on its first completion; the watcher must say so and
    name the fix, not only "exited (-4)". A real child kills itself with SIGILL and goes through the same watch."""
    server = LlamaServer(tmp_path / "server.log",
                         [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGILL)"])
    try:
        with pytest.raises(pytest.fail.Exception) as failed:
            server.wait_ready(limit_s=30)
    finally:
        server.kill()
    assert server.proc.returncode == -signal.SIGILL
    message = str(failed.value)
    assert "killed by SIGILL (signal 4)" in message, message
    assert "CMAKE_ARGS=-DGGML_NATIVE=OFF (make setup does)" in message, message


@pytest.mark.real
@pytest.mark.server
def test_real_llama_cpp_server_killed_mid_run_then_resumed(tmp_path: Path) -> None:
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama_cpp is not importable in this venv: pip install 'llama-cpp-python[server]'")
    chats = [[user(f"Give one word that rhymes with {w}."), {"role": "assistant", "content": "dropped"},
              user("Now another one.")] for w in ("cat", "dog", "sun", "tree", "blue", "light")]
    servers: list[LlamaServer] = []
    try:
        servers.append(LlamaServer(tmp_path / "server1.log"))
        servers[0].wait_ready()
        # A slow answer on a loaded machine must not read as a dead server: a long timeout, few retries.
        regen = {"max_new_tokens": 24, "max_retries": 1, "timeout_s": 120, "top_k": 40, "concurrency": 1,
                 "batch_size": 1}
        cfg = openai_cfg(tmp_path, [servers[0].url], **regen)
        ids = write_prompts(cfg, chats)
        result: dict[str, Any] = {}

        def first_run() -> None:
            try:
                result["first"] = run_regenerate(cfg)
            except StepFailed as e:  # the server died: most prompts failed, so the step is not done
                result["first"], result["error"] = e.summary, str(e)

        thread = threading.Thread(target=first_run, daemon=True)
        thread.start()
        _wait_for_lines(cfg.conversations_path, 1, servers[0].proc, servers[0].log, limit_s=120,
                        causes=LLAMA_CPP_CAUSES)
        servers[0].kill()
        thread.join(timeout=120)
        assert not thread.is_alive()
        first = result["first"]
        assert first.written >= 1 and first.missing == len(ids) - first.written > 0
        assert set(first.failed) <= {"connection", "connection_refused", "timeout"}
        assert "prompts failed" in result["error"]
        servers.append(LlamaServer(tmp_path / "server2.log"))
        servers[1].wait_ready()
        second = run_regenerate(openai_cfg(tmp_path, [servers[1].url], **regen))
    finally:
        for s in servers:
            s.kill()
    assert second.already_done == first.written and second.missing == 0, second.failure_examples
    assert second.duplicate_ids == 0
    records = assert_each_id_once(cfg, ids)
    for r in records:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert "dropped" not in [m["content"] for m in r["messages"]]
        assert set(r["finish_reasons"]) <= {"stop", "length"} and r["backend"] == "openai"


def test_a_second_writer_on_the_run_dir_fails_at_once_naming_the_first(tmp_path: Path, fake: Any,
                                                                       capsys: pytest.CaptureFixture) -> None:
    from data_prep.steps import run_steps

    tree = config_tree(tmp_path, backend="openai", server_urls=[fake.url])
    write_prompts(parse_config(tree), [[user("q")]])
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(tree))
    hold = ("import sys, time; from common.locking import run_lock\n"
            "with run_lock(sys.argv[1], 'data_prep regenerate'):\n    print('held', flush=True); time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "run")], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert run_steps("regenerate", cfg_file) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{tmp_path / 'run'} is in use by pid {holder.pid}" in err[0], err
        assert not (tmp_path / "run" / "conversations.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert run_steps("regenerate", cfg_file) == 0


class ScriptedBackend:
    """Answers "a<turn>" for each chat; a chat whose last user turn contains "[full]" gets context_full, one
    with "[broken]" the error a broken engine or server would give ("engine_error")."""

    name, batch_size = "scripted", 4

    def complete(self, batch: list[list[dict[str, str]]], tools: list[Any] | None = None) -> list[Any]:
        from data_prep.backends import CONTEXT_FULL, Completion

        return [Completion(finish_reason=CONTEXT_FULL) if "[full]" in chat[-1]["content"]
                else Completion(error="engine_error", detail="scripted") if "[broken]" in chat[-1]["content"]
                else Completion(text=f"a{len(chat) // 2 + 1}", finish_reason="stop") for chat in batch]


class ScriptedStream:
    """ScriptedBackend's answers through the stream interface the hf backend has: chats queue in submission
    order and one comes out per poll, while later ones keep arriving. ``lines_seen`` records how many
    conversations the output file held when each answer came out."""

    def __init__(self, backend: ScriptedBackend, out: Path, rows: int, poll_s: float = 0.0):
        self.backend, self.out, self.rows, self.poll_s = backend, out, rows, poll_s
        self.queue: list[tuple[Any, list[dict[str, str]], Any]] = []
        self.lines_seen: list[tuple[Any, int]] = []

    @property
    def wants(self) -> int:
        return self.rows - len(self.queue)

    def submit(self, items: list[tuple[Any, list[dict[str, str]], Any]]) -> None:
        self.queue += items

    def results(self) -> Iterator[list[tuple[Any, Any]]]:
        while self.queue:
            key, chat, tools = self.queue.pop(0)
            time.sleep(self.poll_s)
            self.lines_seen.append((key, self.out.read_bytes().count(b"\n") if self.out.exists() else 0))
            yield [(key, self.backend.complete([chat], [tools])[0])]

    def tokens_per_s(self) -> float:
        return 0.0

    def stats(self) -> dict[str, Any]:
        return {"scripted": True}


class ScriptedStreamBackend(ScriptedBackend):
    def __init__(self, out: Path, rows: int = 8, poll_s: float = 0.0):
        self.out, self.rows, self.poll_s, self.streams = out, rows, poll_s, []

    def stream(self, wanted: int, profile: Any = None) -> ScriptedStream:
        self.streams.append(ScriptedStream(self, self.out, min(self.rows, wanted), self.poll_s))
        return self.streams[-1]


def test_the_stream_writes_each_conversation_when_it_ends_while_others_run(tmp_path: Path) -> None:
    """One stream over every conversation: a turn is submitted when the previous answer comes back, and a
    conversation is on disk the moment its last answer is, while longer ones are still being answered."""
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate

    cfg = make_cfg(tmp_path)
    ids = write_prompts(cfg, [[user("a1")], [user("b1"), user("b2"), user("b3")], [user("c1"), user("c2")]])
    backend = ScriptedStreamBackend(cfg.conversations_path, rows=8, poll_s=0.02)  # a poll takes a moment
    summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), backend)
    records = {r["id"]: r for r in assert_each_id_once(cfg, ids)}
    assert [m["content"] for m in records[ids[1]]["messages"]] == ["b1", "a1", "b2", "a2", "b3", "a3"]
    assert summary.written == 3 and summary.engine == {"scripted": True}
    seen = dict(backend.streams[0].lines_seen)  # the last answer each conversation got, and the file then
    assert seen[ids[1]] == 2, "the 1- and 2-turn conversations were not written before the 3-turn one ended"
    assert seen[ids[2]] == 1 and seen[ids[0]] == 0
    # the stream opens conversations as it has room: the longest work first, all three at once here
    assert [key for key, _ in backend.streams[0].lines_seen[:3]] == [ids[1], ids[2], ids[0]]
    # when each was open: the 3-turn one, opened with the others, was open longest and written last
    spans = summary.spans
    assert spans["conversations"] == 3 and spans["longest"] == spans["settled_last"]
    assert spans["longest"]["turns"] == 3 and spans["longest"]["span_s"] == spans["span_s"]["100"]
    assert spans["opened_last_s"] <= spans["longest"]["span_s"]


def _in_processing_order(tagged: list[str], streaming: bool) -> list[list[dict[str, str]]]:
    """One-turn chats that regenerate takes up in this order: the stream opens the longest prompts first,
    rounds take the shortest first (``regenerate``'s sort), so the padding grows or shrinks along the list (in
    steps of 10 characters, more than the tags differ by)."""
    n = len(tagged)
    return [[user("x" * 10 * (n - k if streaming else k + 1) + " " + text)] for k, text in enumerate(tagged)]


@pytest.mark.parametrize("streaming", [False, True])
def test_real_failures_in_a_row_stop_the_run_leaving_the_rest_untried(tmp_path: Path, streaming: bool) -> None:
    """Real failures in a row (a broken engine or a dead server) trip the breaker; a prompt that exceeds the
    context among them neither counts towards the run of failures nor breaks it."""
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate

    cfg = make_cfg(tmp_path, max_consecutive_failures=3)
    write_prompts(cfg, _in_processing_order(["[broken]", "[broken]", "[full]"] + ["[broken]"] * 8, streaming))
    backend = ScriptedStreamBackend(cfg.conversations_path, rows=1) if streaming else ScriptedBackend()
    backend.batch_size = 1
    summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), backend)
    assert summary.failed == {"engine_error": 3, "prompt_exceeds_context": 1}
    assert summary.tried == 4 and summary.written == 0
    assert summary.stopped == "3 prompts in a row failed (regenerate.max_consecutive_failures=3); 7 not tried"


@pytest.mark.parametrize("streaming", [False, True])
def test_prompts_that_exceed_the_context_are_counted_but_do_not_stop_the_run(tmp_path: Path,
                                                                             streaming: bool) -> None:
    """A prompt longer than the target's context is a verdict on that prompt, not a sign of a dead engine: 25
    of them taken up first (more than max_consecutive_failures) leave the run going; each is counted and
    reported by its reason, and the run passes the failure-share check like any run with a few failed
    prompts (a real dataset has a few such prompts, and the stream reports them first)."""
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate
    from data_prep.regenerate_summary import check_failures

    cfg = make_cfg(tmp_path, max_consecutive_failures=20, max_failure_share=0.25)
    ids = write_prompts(cfg, _in_processing_order(["[full]"] * 25 + ["q"] * 100, streaming))
    backend = ScriptedStreamBackend(cfg.conversations_path, rows=4) if streaming else ScriptedBackend()
    backend.batch_size = 5
    summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), backend)
    if streaming:
        assert [k for k, _ in backend.streams[0].lines_seen[:25]] == ids[:25], "the long prompts were not first"
    assert summary.stopped is None
    assert summary.failed == {"prompt_exceeds_context": 25} and summary.tried == 125 and summary.written == 100
    assert_each_id_once(cfg, ids[25:])
    assert "failed prompt_exceeds_context: 25" in summary.to_markdown()
    check_failures(cfg, summary)  # 20 % of the prompts tried, under the share allowed: no StepFailed


def test_mostly_too_long_prompts_end_with_an_error_naming_the_settings(tmp_path: Path) -> None:
    """Prompts too long for the context do not trip the breaker, but a dataset that is mostly too long still
    fails the run (max_failure_share) with a message that says which settings to change."""
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate
    from data_prep.regenerate_summary import check_failures

    cfg = make_cfg(tmp_path, max_consecutive_failures=5)
    write_prompts(cfg, [[user(f"{'x' * 100} long {i} [full]")] for i in range(90)]
                  + [[user(f"q{i}")] for i in range(10)])
    backend = ScriptedStreamBackend(cfg.conversations_path, rows=4)
    summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), backend)
    assert summary.stopped is None and summary.tried == 100 and summary.written == 10
    with pytest.raises(StepFailed, match=r"90 of 100 prompts failed \(prompt_exceeds_context: 90; .*"
                                         r"max_failure_share=0\.05.*regenerate\.max_context_tokens.*"
                                         r"data\.max_prompt_chars") as failed:
        check_failures(cfg, summary)
    assert "\n" not in str(failed.value)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_full_context_ends_the_conversation_and_is_counted(tmp_path: Path, streaming: bool) -> None:
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate

    cfg = make_cfg(tmp_path)
    write_prompts(cfg, [[user("q1"), {"role": "assistant", "content": "old"}, user("q2 [full]"), user("q3")],
                        [user("q1 [full]")], [user("q1"), user("q2")]])
    backend = ScriptedStreamBackend(cfg.conversations_path) if streaming else ScriptedBackend()
    summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), backend)
    records = {r["id"]: r for r in read_conversations(cfg)}
    assert records["test-0000"]["messages"] == [user("q1"), {"role": "assistant", "content": "a1"}]
    assert records["test-0000"]["finish_reasons"] == ["stop"]
    assert len(records["test-0002"]["finish_reasons"]) == 2
    assert "test-0001" not in records and summary.failed == {"prompt_exceeds_context": 1}
    assert summary.turns_dropped_context_full == 2
    assert "2 later user turns left out (context full)" in summary.to_markdown()


def test_part_files_merge_once_after_a_kill(tmp_path: Path) -> None:
    from data_prep.regenerate_devices import merge_parts, part_path

    out = tmp_path / "conversations.jsonl"
    line = lambda i: json.dumps({"id": f"c{i}", "messages": []}) + "\n"  # noqa: E731
    out.write_text(line(0) + line(1))
    part_path(out, 0).write_text(line(1) + line(2) + '{"id": "c9", "mess')  # c1 merged before the kill; torn tail
    part_path(out, 1).write_text(line(3))
    assert merge_parts(out) == 2
    assert merge_parts(out) == 0 and not list(tmp_path.glob("*.part-*"))
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["c0", "c1", "c2", "c3"]


@pytest.mark.usefixtures("regenerate_loads_the_session_smollm2")
@pytest.mark.real
def test_two_devices_share_the_prompts_and_match_one_device(tmp_path: Path) -> None:

    chats = [[user(f"Give one word that rhymes with {w}.")] for w in ("cat", "dog", "sun", "tree", "blue")]
    one = make_cfg(tmp_path / "one", max_new_tokens=8, batch_size=8)
    two = make_cfg(tmp_path / "two", max_new_tokens=8, batch_size=8, devices=["cpu", "cpu"])
    ids = write_prompts(one, chats)
    write_prompts(two, chats)
    run_regenerate(one)
    summary = run_regenerate(two)
    assert summary.backend == "hf x2 (cpu, cpu)" and summary.written == len(ids) and summary.missing == 0
    assert not list(two.root.glob("*.part-*"))
    by_id = lambda cfg: {r["id"]: r["messages"] for r in assert_each_id_once(cfg, ids)}  # noqa: E731
    assert by_id(one) == by_id(two)


def _on_two_devices(cfg: RunConfig) -> Any:
    """regenerate_on_devices over two worker processes. The openai backend stands in for the target (no model
    to load): the spawned workers, their part files and the summing are the same for any backend."""
    from data_prep.regenerate_devices import regenerate_on_devices
    from data_prep.regenerate_files import load_prompt_records

    return regenerate_on_devices(cfg, load_prompt_records(cfg.prompts_path, None), ["cpu:0", "cpu:1"])


def test_failure_limits_apply_to_all_devices_together(tmp_path: Path, fake: Any) -> None:
    from data_prep.regenerate_devices import share_of
    from data_prep.regenerate_summary import check_failures

    # 1 failed prompt in 12 is under max_failure_share 0.1 for the run, though more than that of its device's share.
    cfg = openai_cfg(tmp_path / "one", [fake.url], max_failure_share=0.1)
    ids = write_prompts(cfg, [[user("[400x9] bad")]] + [[user(f"q{i}")] for i in range(11)])
    assert 1 / sum(share_of(i, 2) == share_of(ids[0], 2) for i in ids) > 0.1
    summary = _on_two_devices(cfg)
    check_failures(cfg, summary)
    assert summary.failed == {"http_400": 1} and summary.tried == 12 and summary.written == 11
    # The parent's seconds by phase, and each worker's own (spawned: its age is its own process's).
    assert_phases_add_up(summary.phases, {"startup_s", "resume_s", "step_s", "validate_s"})
    assert len(summary.device_phases) == 2
    for worker in summary.device_phases:
        assert_phases_add_up(worker, set(PHASES) - {"prompts_read_s", "devices_s"})
        assert worker.get("process_s", 0) <= summary.phases["step_s"] + 0.01  # started and ended inside the step
    assert "  - device worker 1: " in summary.to_markdown()
    assert summary.records == 11 and summary.missing == 1 and not list(cfg.root.glob("*.part-*"))
    # One failure on each device: 2 of 12 together is more than 0.1.
    cfg = openai_cfg(tmp_path / "two", [fake.url], max_failure_share=0.1)
    chats = [[user(f"[400x9] r{i}" if i in (0, 1) else f"r{i}")] for i in range(12)]
    ids = write_prompts(cfg, chats)
    assert share_of(ids[0], 2) != share_of(ids[1], 2)
    with pytest.raises(StepFailed, match=r"2 of 12 prompts failed \(http_400: 2; .*max_failure_share=0\.1"):
        check_failures(cfg, _on_two_devices(cfg))
    # A device whose prompts fail in a row stops its share; the parent names it.
    cfg = openai_cfg(tmp_path / "dead", [fake.url], max_consecutive_failures=2, max_failure_share=1.0)
    ids = write_prompts(cfg, [[user(f"[400x9] s{i}")] for i in range(16)])
    summary = _on_two_devices(cfg)
    assert summary.tried == 4 and summary.failed == {"http_400": 4}
    with pytest.raises(StepFailed, match=r"4 of 4 prompts failed .*stopped early: cpu:0: 2 prompts in a row "
                                         r"failed \(regenerate\.max_consecutive_failures=2\); \d+ not tried; "
                                         r"cpu:1: 2 prompts"):
        check_failures(cfg, summary)


class Hang(BaseHTTPRequestHandler):
    """A server that accepts a request and never answers (within the test)."""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(60)

    def log_message(self, *args: Any) -> None:
        pass


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_device_workers_die_with_the_regenerating_process(tmp_path: Path) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hang)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    tree = config_tree(tmp_path, backend="openai", server_urls=[f"http://127.0.0.1:{srv.server_address[1]}"],
                       timeout_s=120, concurrency=1, batch_size=1)
    write_prompts(parse_config(tree), [[user(f"q{i}")] for i in range(8)])
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(tree))
    code = ("import sys; from common.config import load_config; "
            "from data_prep.regenerate_files import load_prompt_records; "
            "from data_prep.regenerate_devices import regenerate_on_devices\ncfg = load_config(sys.argv[1])\n"
            "regenerate_on_devices(cfg, load_prompt_records(cfg.prompts_path, None), ['cpu:0', 'cpu:1'])\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(cfg_file)], cwd=REPO)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(0.2)
            workers = [k for k in _children(proc.pid)
                       if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text(errors="replace")]
        assert len(workers) == 2, "the two device workers did not start"
        time.sleep(3)  # let them reach the (hanging) server
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers), "a device worker outlived its parent"
    finally:
        proc.kill()
        proc.wait()
        for w in workers:  # not left behind when the test fails
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        srv.shutdown()
        srv.server_close()


@pytest.mark.usefixtures("regenerate_loads_the_session_smollm2")
def test_chats_answered_without_the_engine_leave_room_for_the_next_ones(tmp_path: Path) -> None:
    """First turns too long for the context are answered at once, without the engine (``prompt_exceeds_context``),
    in a batch. While the caller handles that batch it opens more conversations, which may be too long as well:
    every prompt is tried, none is lost between the batch and the next."""
    from data_prep.backends import make_chat_backend
    from data_prep.regenerate_files import load_prompt_records
    from data_prep.regenerate_loop import regenerate

    cfg = make_cfg(tmp_path, max_new_tokens=8, slots=2, batch_size=2, max_context_tokens=40, max_failure_share=1.0,
                   max_consecutive_failures=100)
    write_prompts(cfg, [[user(f"{i} " + "a long question about the weather in every city " * 6)] for i in range(7)])
    backend = make_chat_backend(cfg.target, cfg.regenerate)
    summary = regenerate(cfg, load_prompt_records(cfg.prompts_path, None), backend)
    assert summary.tried == 7 and summary.failed == {"prompt_exceeds_context": 7}


def test_text_completions_go_to_the_same_servers_with_the_same_retries(tmp_path: Path, fake: Any) -> None:
    from data_prep.backends import text_url

    assert text_url("http://h:1") == text_url("http://h:1/v1/") == "http://h:1/v1/completions"
    assert text_url("http://h:1/v1/chat/completions") == "http://h:1/v1/completions"
    backend = make_chat_backend(TargetConfig(name="smollm2-135m-instruct"),
                                openai_cfg(tmp_path, [fake.url], max_retries=2).regenerate)
    try:
        out = list(backend.complete_text([{"prompt": "<u>[503x2] hi"}, {"prompt": "<u>[400x1] no"}, {"prompt": "x"}]))
    finally:
        backend.close()
    assert [(c.text, c.finish_reason, c.error) for c in out] == [
        ("echo <u>[503x2] hi", "stop", None), ("", "", "http_400"), ("echo x", "stop", None)]
    assert {r["path"] for r in fake.requests} == {"/v1/completions"}
    assert all(r["body"]["model"] == "default" for r in fake.requests)

"""bench/h200_pipeline.sh's phases that need no GPU: derive writes the run's config with the overrides applied."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def carried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder the phases read carried files from (CARRIED), empty and the test's own: what this checkout's .gpu/
    holds (conversations a device call returned, say) must not stand in for what a phase does."""
    folder = tmp_path / "carried"
    folder.mkdir()
    monkeypatch.setenv("CARRIED", str(folder))
    return folder


def run_phases(*phases: str, **env: str) -> subprocess.CompletedProcess:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"  # the script calls python3
    return subprocess.run(["bash", "bench/h200_pipeline.sh", *phases], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PATH": path, "DEADLINE": "200", **env}, timeout=120)


def test_derive_writes_the_config_with_the_overrides(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = run_phases("derive", CONFIG="configs/smollm2-135m-h200.yaml", RUN=str(run),
                     OVERRIDES=f"run_dir={run} train.max_steps=3500 drafter.init_from=drafters/smollm2-135m-eagle3")
    assert out.returncode == 0, out.stdout + out.stderr
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["run_dir"] == str(run)
    assert cfg["train"]["max_steps"] == 3500
    assert cfg["drafter"]["init_from"] == "drafters/smollm2-135m-eagle3"
    assert cfg["train"]["lr"] == 3.0e-3  # the base config's, untouched


def test_derive_reports_a_bad_override_as_a_failed_phase(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = run_phases("derive", CONFIG="configs/smollm2-135m-h200.yaml", RUN=str(run),
                     OVERRIDES="train.no_such_key=1")
    assert out.returncode != 0
    assert "=== derive FAILED" in out.stdout
    assert not (run / "config.yaml").exists()


def test_out_returns_the_logs_and_the_conversations_asked_for_within_the_limits(tmp_path: Path) -> None:
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    out.mkdir()
    (run / "conversations.jsonl").write_text('{"id": "a", "messages": []}\n')
    (run / "train_log.jsonl").write_text('{"step": 1, "loss": 1.0}\n')

    done = run_phases("out", RUN=str(run), OUT=str(out), OUT_CONVERSATIONS="1")

    assert done.returncode == 0, done.stdout + done.stderr
    assert {"logs.tar.gz", "conversations.jsonl.gz.part-aa"} <= {p.name for p in out.iterdir()}
    assert "out: returning" in done.stdout


def test_with_self_joins_every_turn_and_each_self_prompt_run_into_a_run_of_its_own(tmp_path: Path) -> None:
    runs = {name: tmp_path / name for name in ("mt", "self-1", "self-2")}
    for name, d in runs.items():
        d.mkdir()
        (d / "conversations.jsonl").write_text("".join(f'{{"id": "{name}-{i}"}}\n' for i in range(2)))
    symbol_runs = tmp_path / "symbol-runs" / "symbol_runs.jsonl"  # a file is taken as itself
    symbol_runs.parent.mkdir()
    symbol_runs.write_text('{"id": "runs-0-00000000"}\n')
    stage = tmp_path / "stage"
    env = {"MULTI_TURN": str(runs["mt"]), "WITH_SELF": f"{runs['self-1']} {runs['self-2']} {symbol_runs}"}

    done = run_phases("with-self", RUN=str(stage), **env)

    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line.split('"')[3] for line in (stage / "conversations.jsonl").read_text().splitlines()]
    assert ids == ["mt-0", "mt-1", "self-1-0", "self-1-1", "self-2-0", "self-2-1", "runs-0-00000000"]
    refused = run_phases("with-self", RUN=str(runs["self-2"]), **env)  # it would read the file it writes
    assert refused.returncode != 0 and "holds data of its own" in refused.stdout
    assert len((runs["self-2"] / "conversations.jsonl").read_text().splitlines()) == 2


def test_symbol_runs_cuts_the_multi_turn_conversations_first_answers(tmp_path: Path) -> None:
    missing = tmp_path / "mt"
    done = run_phases("symbol-runs", MULTI_TURN=str(missing), SYMBOL_RUNS=str(tmp_path / "runs"),
                      SYMBOL_RUNS_COUNT="9", SYMBOL_RUNS_SEED="2")
    out = done.stdout + done.stderr
    assert "FAILED" in out and f"data.symbol_runs.conversations: {missing}/conversations.jsonl is not a file" in out
    config = yaml.safe_load((tmp_path / "runs" / "config.yaml").read_text())
    assert config["run_dir"] == str(tmp_path / "runs")
    assert config["drafter"]["init_from"] == "drafters/smollm2-135m-eagle3"  # runs of tokens the shipped one drafts
    assert config["data"]["symbol_runs"] == {**config["data"]["symbol_runs"], "count": 9, "seed": 2,
                                             "conversations": f"{missing}/conversations.jsonl"}


def test_self_prompts_refuses_a_systems_file_that_is_not_a_json_list_of_system_turns(tmp_path: Path) -> None:
    for i, text in enumerate(("[null, 'single quotes']", '{"writing": "You write."}', "[]", "[null, 3]")):
        bad = tmp_path / f"systems-{i}.json"
        bad.write_text(text)
        done = run_phases("self-prompts", SELF=str(tmp_path / "self"), SELF_SYSTEMS_FILE=str(bad))
        assert done.returncode != 0 and f"SELF_SYSTEMS_FILE={bad} is not a JSON list" in done.stdout, text
        assert not (tmp_path / "self").exists()


def test_self_prompts_with_follow_up_continue_its_conversations_under_their_own_systems(tmp_path: Path) -> None:
    missing = tmp_path / "earlier" / "conversations.jsonl"
    refused = run_phases("self-prompts", SELF=str(tmp_path / "self"), SELF_FOLLOW_UP=str(missing),
                         SELF_SYSTEMS_FILE="configs/self-prompt-systems.json")
    assert refused.returncode != 0 and "SELF_FOLLOW_UP and SELF_SYSTEMS_FILE together" in refused.stdout
    assert not (tmp_path / "self").exists()
    bad = tmp_path / "starts.json"
    bad.write_text('["Make it", null]')
    refused = run_phases("self-prompts", SELF=str(tmp_path / "self"), SELF_FOLLOW_UP=str(missing),
                         SELF_TURN_STARTS_FILE=str(bad))
    assert refused.returncode != 0 and f"SELF_TURN_STARTS_FILE={bad} is not a JSON list of texts" in refused.stdout
    starts = "configs/follow-up-starts.json"
    done = run_phases("self-prompts", SELF=str(tmp_path / "self"), SELF_FOLLOW_UP=str(missing), SELF_COUNT="7",
                      SELF_SEED="3", SELF_TURN_STARTS_FILE=starts)
    assert done.returncode != 0 and f"data.synthesize.follow_up: {missing} is not a file" in done.stdout + done.stderr
    synthesize = yaml.safe_load((tmp_path / "self" / "config.yaml").read_text())["data"]["synthesize"]
    assert synthesize == {**synthesize, "count": 7, "seed": 3, "follow_up": str(missing), "systems": [None],
                          "turn_starts": json.loads((REPO / starts).read_text())}


def test_a_regeneration_cut_short_leaves_whole_conversations(tmp_path: Path) -> None:
    """A regenerate phase that ends early (here its config names no prompts, so it fails at once; on the GPU machine,
    the deadline) leaves the conversations it finished as whole lines, which a later phase may train on."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "conversations.jsonl").write_text('{"id": "a", "messages": []}\n{"id": "b", "mess')
    derived = run_phases("derive", CONFIG="configs/smollm2-135m-h200.yaml", RUN=str(run), OVERRIDES=f"run_dir={run}")
    assert derived.returncode == 0, derived.stdout + derived.stderr

    done = run_phases("regenerate", RUN=str(run), CONFIG=str(run / "config.yaml"))

    assert "=== regenerate FAILED" in done.stdout
    assert (run / "conversations.jsonl").read_text() == '{"id": "a", "messages": []}\n'
    assert not (run / ".regenerated").exists()


def test_carried_conversations_stand_in_for_regeneration(tmp_path: Path, carried: Path) -> None:
    """Conversations an earlier machine returned (`out` with OUT_CONVERSATIONS=1: gzip in parts), carried in
    CARRIED/conversations, are joined and unpacked by regenerate instead of regenerating."""
    run = tmp_path / "run"
    lines = "".join(f'{{"id": "c{i}", "messages": []}}\n' for i in range(300))
    packed = gzip.compress(lines.encode())
    (carried / "conversations").mkdir()
    half = len(packed) // 2
    (carried / "conversations" / "conversations.jsonl.gz.part-aa").write_bytes(packed[:half])
    (carried / "conversations" / "conversations.jsonl.gz.part-ab").write_bytes(packed[half:])
    derived = run_phases("derive", CONFIG="configs/smollm2-135m-h200.yaml", RUN=str(run), OVERRIDES=f"run_dir={run}")
    assert derived.returncode == 0, derived.stdout + derived.stderr

    done = run_phases("regenerate", RUN=str(run), CONFIG=str(run / "config.yaml"))

    assert done.returncode == 0 and "=== regenerate: done before (or carried)" in done.stdout, done.stdout
    assert (run / "conversations.jsonl").read_text() == lines and (run / ".regenerated").exists()


def test_gpu_tests_runs_file_by_file_and_a_rerun_skips_the_files_that_passed(tmp_path: Path) -> None:
    """A deadline may cut the phase: what passed is kept, so the next call on the machine goes on from there."""
    good, bad = tmp_path / "test_good.py", tmp_path / "test_bad.py"
    good.write_text("def test_ok():\n    assert True\n")
    bad.write_text("def test_fails():\n    assert False\n")
    run = tmp_path / "run"
    env = {"RUN": str(run), "GPU_TESTS": f"{good} {bad}"}

    first = run_phases("gpu-tests", **env)
    assert "=== gpu-tests FAILED" in first.stdout, first.stdout
    assert (run / "logs" / "gpu-tests.passed").read_text().splitlines() == [str(good)]

    second = run_phases("gpu-tests", **env)
    assert f"{good}: passed on this machine before" in second.stdout
    assert "1 failed" in second.stdout and "=== gpu-tests FAILED" in second.stdout

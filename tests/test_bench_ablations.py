"""The ablations' data rows (bench/ablations.py): first turns whole or with short answers, from multi-turn
conversations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bench.ablations import (
    DATA_ROWS,
    both_answers,
    first_turns,
    measure,
    row_overrides,
    same_conversations,
    sampled_subset,
    summarize,
)
from eval.batched_eval import greedy_references


class WordTokenizer:
    """One token a word: enough to cut answers by token count."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": text.split()}

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


def write_cpu_config(tmp_path: Path) -> Path:
    """A run config on the real target, on the CPU, measured on MT-Bench: <tmp_path>/cfg.yaml."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "target": {"name": "smollm2-135m-instruct", "device": "cpu"},
        "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]},
        "eval": {"datasets": [{"name": "mtbench", "kind": "mtbench", "path": "builtin"}]}}))
    return cfg


REC = {"id": "c", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a b c d"},
                               {"role": "user", "content": "more"}, {"role": "assistant", "content": "e f"}],
       "finish_reasons": ["stop", "loop"]}


def test_first_turns_keep_the_first_answer_whole_or_cut() -> None:
    whole = first_turns([REC], WordTokenizer(), keep=None)[0]
    assert [m["content"] for m in whole["messages"]] == ["hi", "a b c d"] and whole["finish_reasons"] == ["stop"]
    cut = first_turns([REC], WordTokenizer(), keep=2)[0]
    assert [m["content"] for m in cut["messages"]] == ["hi", "a b"] and cut["finish_reasons"] == ["length"]


def test_data_rows_change_the_data_not_the_config() -> None:
    class Cfg:
        class target:  # noqa: N801 (a stand-in for the config section)
            aux_layer_ids = None

        class train:  # noqa: N801
            lr = 1e-3

    rows = row_overrides(Cfg, 1536, 30)
    assert all(rows[name] == [] for name in DATA_ROWS)
    assert rows["lk_alpha"] == ["train.loss=lk_alpha"] and rows["lr_x3"] == ["train.lr=0.003"]


def test_sampled_answers_are_the_same_conversations_in_order_and_a_missing_one_is_named(tmp_path) -> None:
    recs = [{"id": "a"}, {"id": "b"}]
    sampled = [{"id": "b", "t": 1}, {"id": "c", "t": 1}, {"id": "a", "t": 1}]
    assert [r["id"] for r in same_conversations(recs, sampled, tmp_path / "s.jsonl")] == ["a", "b"]
    with pytest.raises(ValueError, match=r"s\.jsonl: 1 of the 2 conversations are missing \(first: b\)"):
        same_conversations(recs, sampled[2:], tmp_path / "s.jsonl")


def test_both_answers_keep_each_conversation_twice_under_unique_ids() -> None:
    both = both_answers([{"id": "a", "t": 0}, {"id": "b", "t": 0}], [{"id": "a", "t": 1}, {"id": "b", "t": 1}])
    assert [(r["id"], r["t"]) for r in both] == [("a", 0), ("b", 0), ("a@sampled", 1), ("b@sampled", 1)]


def test_a_cut_sampled_regeneration_leaves_every_row_the_conversations_it_holds_in_order() -> None:
    recs = [{"id": "a"}, {"id": "b"}, {"id": "c"}]
    assert sampled_subset(recs, [{"id": "c"}, {"id": "a"}, {"id": "z"}]) == [{"id": "a"}, {"id": "c"}]


def test_each_temperature_is_read_against_the_baseline_with_the_oracle_beside(bench_results, tmp_path) -> None:
    def row(name: str, overrides: list[str], tau0: float, tau1: float, mb: float = 29.2) -> None:
        rec = {"name": name, "overrides": overrides, "tau": {"mtbench": tau0, "humaneval": tau0},
               "at_temperature": {"1": {"tau": {"mtbench": tau1, "humaneval": tau1}}}, "drafter_mb": mb}
        (tmp_path / f"row-{name}.json").write_text(json.dumps(rec))

    row("baseline", [], 2.0, 1.3)
    row("lk_alpha", ["train.loss=lk_alpha"], 2.1, 1.2)
    row("answers_sampled", [], 1.9, 1.5)
    row("draft_vocab_32k", ["drafter.draft_vocab_size=32000"], 2.1, 1.3, mb=48.1)
    (tmp_path / "oracle-T1.json").write_text(json.dumps({"mtbench": 1.7, "humaneval": 2.0}))

    keep = summarize(tmp_path, ["baseline", "lk_alpha", "answers_sampled", "draft_vocab_32k", "ttt_3"], 0.02,
                     {"temperatures": [0.0, 1.0]}, name="ablations_sampled")

    # the decision reads T = 0; a data row is reported, never kept; nor is a lever whose drafter may not ship
    assert keep == ["train.loss=lk_alpha"]
    got = json.loads(bench_results.read_text())["ablations_sampled"]
    assert got["not_kept_too_large"] == {"draft_vocab_32k": "48.1 MB drafter > 32 MB"}
    rows = {r["name"]: r for r in got["rows"]}
    assert rows["lk_alpha"]["delta_mean_tau"] == pytest.approx(0.1)
    assert rows["lk_alpha"]["at_temperature"]["1"]["delta_mean_tau"] == pytest.approx(-0.1)
    assert rows["answers_sampled"]["at_temperature"]["1"]["delta_mean_tau"] == pytest.approx(0.2)
    assert got["oracle_tau"] == {"1": {"mtbench": 1.7, "humaneval": 2.0}}
    assert got["rows_missing"] == ["ttt_3"]


@pytest.mark.real
def test_a_row_is_measured_at_zero_and_at_one_below_the_oracle_the_worker_records(tmp_path, smollm2) -> None:
    from drafter.factory import fresh_drafter, shape_for_target
    from drafter.vocab_map import build_vocab_map
    from eval.oracle_cache import oracle_acceptance
    from eval.quality import setup

    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "target": {"name": "smollm2-135m-instruct", "device": "cpu", "aux_layer_ids": [2, 15, 27]},
        "data": {"sources": [{"kind": "lines", "path": "unused.txt"}]},
        "eval": {"num_steps": 3, "max_new_tokens": 8,
                 "datasets": [{"name": "mtbench", "kind": "mtbench", "path": "builtin"}]}}))
    cfg, target, prompts = setup(cfg_path, limit=2)
    d2t, t2d = build_vocab_map(torch.zeros(target.vocab_size), 512)
    drafter = fresh_drafter(shape_for_target(target.hf_config, 512, (2, 15, 27)), target.embed_weight().detach(),
                            d2t, t2d)
    refs = greedy_references(target, prompts, cfg.eval.max_new_tokens)

    cold = measure(target, drafter, [2, 15, 27], prompts, cfg, 0.0, refs)
    hot = measure(target, drafter, [2, 15, 27], prompts, cfg, 1.0, None)
    oracle = oracle_acceptance(target, [2, 15, 27], prompts, 3, 1.0, cfg.eval.max_new_tokens, cfg.eval.acceptance,
                               cfg.eval.seed, cache_dir=tmp_path / "oracle")

    assert cold["lossless_mismatches"] == {"mtbench": 0} and set(cold["tau"]) == {"mtbench"}
    assert "lossless_mismatches" not in hot and len(hot["alpha"]["mtbench"]) == 3
    assert 1.0 <= hot["tau"]["mtbench"] <= oracle["mtbench"]["tau"] <= 4.0  # an untrained drafter: at most the ceiling


@pytest.mark.real
def test_a_sampled_file_that_lacks_a_conversation_is_one_line_before_any_row_runs(tmp_path, monkeypatch, capsys,
                                                                                  bench_results) -> None:
    from bench import ablations

    cfg = write_cpu_config(tmp_path)
    conv, sampled = tmp_path / "conversations.jsonl", tmp_path / "sampled.jsonl"
    conv.write_text("".join(json.dumps(dict(REC, id=i)) + "\n" for i in ("a", "b")))
    sampled.write_text(json.dumps(dict(REC, id="a")) + "\n")
    argv = ["ablations.py", "--config", str(cfg), "--conversations", str(conv), "--out", str(tmp_path / "out"),
            "--rows", "baseline,answers_sampled", "--steps", "1"]

    monkeypatch.setattr(sys, "argv", [*argv, "--sampled-conversations", str(sampled)])
    assert ablations.main() == 2
    want = f"error: {sampled}: 1 of the 2 conversations are missing (first: b); regenerate the same prompts file"
    assert capsys.readouterr().err.splitlines()[-1] == want
    assert not (tmp_path / "out" / "data-subset.jsonl").exists() and not bench_results.exists()

    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stop:
        ablations.main()
    assert stop.value.code == 2 and "--rows answers_sampled needs --sampled-conversations" in capsys.readouterr().err

    monkeypatch.setattr(sys, "argv", [*argv[:-4], "--rows", "baseline", "--sampled-subset"])
    with pytest.raises(SystemExit) as stop:
        ablations.main()
    assert stop.value.code == 2 and "--sampled-subset needs --sampled-conversations" in capsys.readouterr().err


def test_the_self_prompts_row_trains_on_both_sets_and_a_shared_id_is_one_line(tmp_path, monkeypatch, capsys,
                                                                              bench_results) -> None:
    from bench import ablations

    recs = [dict(REC, id="sharegpt-a"), dict(REC, id="sharegpt-b")]
    own = [dict(REC, id="openai-x")]
    ablations.write_data(tmp_path, ["baseline", "self_prompts"], recs, None, own, WordTokenizer(), 0)
    rows = [json.loads(x)["id"] for x in (tmp_path / "data-self_prompts.jsonl").read_text().splitlines()]
    assert rows == ["sharegpt-a", "sharegpt-b", "openai-x"]
    assert [json.loads(x)["id"] for x in (tmp_path / "data-subset.jsonl").read_text().splitlines()] == rows[:2]

    cfg = write_cpu_config(tmp_path)
    conv, mine = tmp_path / "conversations.jsonl", tmp_path / "self.jsonl"
    conv.write_text("".join(json.dumps(r) + "\n" for r in recs))
    mine.write_text(json.dumps(recs[1]) + "\n")
    argv = ["ablations.py", "--config", str(cfg), "--conversations", str(conv), "--out", str(tmp_path / "out"),
            "--rows", "baseline,self_prompts", "--steps", "1"]
    monkeypatch.setattr(sys, "argv", [*argv, "--self-conversations", str(mine)])
    assert ablations.main() == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: --self-conversations: 1 ids are in --conversations too (first: sharegpt-b); give conversations of "
        "the target's own prompts")
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stop:
        ablations.main()
    assert stop.value.code == 2 and "--rows self_prompts needs --self-conversations" in capsys.readouterr().err


def test_warm_started_rows_name_their_start_by_path_and_weights(tmp_path, monkeypatch, bench_results) -> None:
    """A later stage's rows start from drafter.init_from; the object names it by path and by the sha256 of its
    weights, since the path (the shipped drafter's, say) may hold other weights by the time someone reads it."""
    from bench import ablations
    from drafter.sglang_checkpoint import fingerprint

    class Finished:  # a worker that ends at once, having measured nothing: main records the object and returns
        returncode = 0

        def __init__(self, *args, **kwargs) -> None:
            pass

        def poll(self) -> int:
            return 0

    shipped = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m-eagle3"
    cfg = write_cpu_config(tmp_path)
    cfg.write_text(yaml.safe_dump(yaml.safe_load(cfg.read_text()) | {"drafter": {"init_from": str(shipped)}}))
    conv = tmp_path / "conversations.jsonl"
    conv.write_text(json.dumps(REC) + "\n")
    monkeypatch.setattr(ablations.subprocess, "Popen", Finished)
    monkeypatch.setattr(sys, "argv", ["ablations.py", "--config", str(cfg), "--conversations", str(conv),
                                      "--out", str(tmp_path / "out"), "--rows", "baseline", "--steps", "1"])
    assert ablations.main() == 1  # no row landed
    got = json.loads(bench_results.read_text())["ablations"]
    assert got["init_from"] == str(shipped) and got["init_from_fingerprint"] == fingerprint(shipped)
    assert got["rows_missing"] == ["baseline"]

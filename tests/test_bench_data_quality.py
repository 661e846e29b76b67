"""bench/data_quality.py: its figures on hand-made conversations, a label written beside the other, and bad input as
one line naming the file (and line) with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import data_quality
from target_model.hf_model import load_tokenizer, resolve_source

LOOP = "Sure. " + "Let me say it again. " * 40


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)


def conv(i: int, answers: list[str], reasons: list[str]) -> dict:
    msgs = []
    for a in answers:
        msgs += [{"role": "user", "content": "q"}, {"role": "assistant", "content": a}]
    return {"id": f"c{i}", "messages": msgs, "finish_reasons": reasons}


def test_the_figures_of_a_looping_a_cut_and_a_plain_answer(tok) -> None:
    records = [conv(0, [LOOP, "Paris."], ["length", "stop"]), conv(1, ["Sure. Let me say it again"], ["loop"])]
    f = data_quality.measure(records, tok)
    n_loop = len(tok(LOOP, add_special_tokens=False)["input_ids"])  # 2 + 6 * 40 + a ragged " "
    assert n_loop == 243
    assert (f["conversations"], f["answers"], f["answer_tokens"]) == (2, 3, n_loop + 2 + 7)
    assert (f["capped_share"], f["loop_cut_share"]) == (round(1 / 3, 4), round(1 / 3, 4))
    assert f["loop_token_share"] == round((n_loop - 7) / f["answer_tokens"], 4)  # the copies after the first
    chars = len(LOOP) + len("Paris.") + len("Sure. Let me say it again")
    # the text repeats with a period of 21 characters from the "." after "Sure": the first window seen before
    # starts one period later, at 4 + 21
    after = len(LOOP) - (len("Sure") + len("Let me say it again. "))
    assert f["after_first_repeat_char_share"] == round(after / chars, 4)
    assert f["median_answer_tokens"] == 7 and f["mean_answer_tokens"] == round(f["answer_tokens"] / 3, 1)


def test_a_label_is_written_beside_the_other(bench_results) -> None:
    bench_results.write_text(json.dumps({"other": {"x": 1}}))
    data_quality.save({"before": {"answers": 3}})
    data_quality.save({"after": {"answers": 2}})
    data = json.loads(bench_results.read_text())
    assert data["other"] == {"x": 1}
    assert data["data_quality"]["before"]["answers"] == 3 and data["data_quality"]["after"]["answers"] == 2
    assert "command" in data["data_quality"]["before"] and "date" in data["data_quality"]
    data_quality.save({"before": {"answers": 5}})
    assert json.loads(bench_results.read_text())["data_quality"]["after"]["answers"] == 2


def test_the_figures_of_greedy_answers_a_loop_a_stop_and_a_cap() -> None:
    loop = [5, 6] + [1, 2, 3] * 30  # 92 tokens at the cap: 87 copies after the first block
    stopped = [7, 8, 9, 0]  # 0 is the stop token: not an answer token
    capped_no_loop = list(range(10, 102))
    f = data_quality.measure_answers([loop, stopped, capped_no_loop], {0}, max_new=92)
    assert (f["answers"], f["answer_tokens"], f["loop_answers"], f["loop_tokens"]) == (3, 92 + 3 + 92, 1, 87)
    assert f["loop_token_share"] == round(87 / 187, 4) and f["capped_share"] == round(2 / 3, 4)
    assert f["mean_answer_tokens"] == round(187 / 3, 1) and f["median_answer_tokens"] == 92


def test_eval_sets_smoke_writes_eval_greedy_beside_the_other_labels(bench_results, monkeypatch) -> None:
    data_quality.save({"before": {"answers": 3}})
    monkeypatch.setattr("sys.argv", ["data_quality.py", "--config", "configs/smollm2-135m.yaml", "--set",
                                     "eval.max_new_tokens=8", "--set", "target.device=cpu", "--eval-sets",
                                     "--limit", "2"])
    assert data_quality.main() == 0
    dq = json.loads(bench_results.read_text())["data_quality"]
    assert dq["before"]["answers"] == 3
    f = dq["eval_greedy"]
    assert (f["limit"], f["max_new_tokens"], f["dtype"]) == (2, 8, "float32") and "--eval-sets" in f["command"]
    for name in ("mtbench", "humaneval"):
        d = f[name]
        assert d["answers"] == 2 and 0 < d["answer_tokens"] <= 2 * 8
        assert 0 <= d["loop_tokens"] <= d["answer_tokens"] and d["loop_answers"] <= d["answers"]
        assert 0 <= d["capped_share"] <= 1 and d["seconds"] >= 0



GOOD = json.dumps(conv(0, ["Paris."], ["stop"]))
NO_REASONS = json.dumps({k: v for k, v in conv(1, ["Hi."], []).items() if k != "finish_reasons"})


@pytest.mark.parametrize(("lines", "error"), [
    (None, ": not found; "),
    ([GOOD, '{"id": "c1", "mess'], ":2: not JSON"),
    ([GOOD, "", NO_REASONS], ":3: no finish_reasons; "),  # counted as read_conversations counts: line 2 is blank
    ([json.dumps(conv(0, ["Paris.", "Rome."], ["stop"]))], ":1: 1 finish_reasons for 2 answers; "),
], ids=["missing", "torn-line", "no-reasons", "short-reasons"])
def test_a_bad_conversations_file_is_one_line_naming_it_and_exit_2(lines: list[str] | None, error: str, tmp_path: Path,
                                                                  bench_results, monkeypatch, capsys) -> None:
    """Before the tokenizer loads, and nothing is recorded."""
    path = tmp_path / "conversations.jsonl"
    if lines is not None:
        path.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr("sys.argv", ["data_quality.py", "--config", "configs/smollm2-135m.yaml", "--label", "before",
                                     "--conversations", str(path)])
    assert data_quality.main() == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {path}{error}"), line
    assert not bench_results.exists()


def test_a_missing_config_is_one_line_and_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", ["data_quality.py", "--config", str(tmp_path / "none.yaml"), "--label", "before"])
    assert data_quality.main() == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {tmp_path / 'none.yaml'}: no such config file"), line

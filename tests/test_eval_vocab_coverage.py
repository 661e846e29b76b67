"""The target tokens a drafter can never draft (``drafter.vocab_map``), counted over the target's outputs, and
``python -m eval coverage``: the same over a run's answers with no model loaded."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from table_tokenizer import Table

from drafter.sglang_checkpoint import load_tensors
from drafter.vocab_map import draft_vocab_mask, outside_draft_vocab
from eval.__main__ import main as eval_main
from eval.commands import coverage_command
from eval.vocab_coverage import answer_tokens
from target_model.hf_model import load_tokenizer, resolve_source

SHIPPED = "drafters/smollm2-135m-eagle3"


def test_the_draft_vocab_mask_is_the_drafters_t2d() -> None:
    class Drafter:
        t2d = torch.tensor([False, True, True, False])

    assert draft_vocab_mask(Drafter()).tolist() == [False, True, True, False]


def test_tokens_outside_the_draft_vocab_are_counted_per_output_with_the_commonest_named() -> None:
    vocab = torch.tensor([True, True, False, False])  # ids 2 ("<<") and 3 ("~") cannot be drafted
    figs = outside_draft_vocab([[0, 2, 1, 3, 3], [1, 1], [3]], vocab, Table(["x", "=", "<<", "~"]), top=1)
    assert figs["tokens"] == 8 and figs["outside"] == 4 and figs["share"] == 0.5
    assert figs["prompts_with_any"] == 2  # the second output lies wholly inside
    assert figs["commonest"] == [{"token": "~", "count": 3}]


def test_a_drafter_covering_every_token_misses_none() -> None:
    figs = outside_draft_vocab([[0, 1], []], torch.ones(2, dtype=torch.bool), Table(["x", "="]))
    assert figs == {"tokens": 2, "outside": 0, "share": 0.0, "prompts_with_any": 0, "commonest": []}
    assert outside_draft_vocab([], torch.ones(2, dtype=torch.bool), Table(["x", "="]))["share"] == 0.0


def test_answers_are_the_assistant_turns_with_their_reasoning_first() -> None:
    convs = [{"messages": [{"role": "user", "content": "=="}, {"role": "assistant", "content": "<<="},
                           {"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]},
             {"messages": [{"role": "assistant", "content": "~", "reasoning_content": "x="}]}]
    assert answer_tokens(convs, Table(["x", "=", "<<", "~"])) == [[2, 1], [0, 1, 3]]  # the empty answer is none


def _run(tmp_path, conversations: list[dict]) -> str:
    (tmp_path / "conversations.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations))
    return str(tmp_path)


@pytest.mark.real
def test_coverage_reads_the_runs_answers_and_each_drafters_t2d(tmp_path, capsys) -> None:
    tok = load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)
    answers = ["The planet Mars has two moons, Phobos and Deimos.", "def odd(xs):\n    return [x for x in xs if x % 2]"]
    run = _run(tmp_path, [{"id": f"c{i}", "messages": [{"role": "user", "content": "Tell me."},
                                                        {"role": "assistant", "content": a}]}
                          for i, a in enumerate(answers)])
    assert coverage_command("configs/smollm2-135m.yaml", [SHIPPED], [f"run_dir={run}"]) == 0
    report = json.loads((tmp_path / "draft_vocab_coverage.json").read_text())
    t2d = load_tensors(SHIPPED, ["t2d"])["t2d"].bool()
    ids = [tok.encode(a, add_special_tokens=False) for a in answers]
    outside = sum(not t2d[t] for a in ids for t in a)
    figs = report["drafters"][SHIPPED]
    assert report["conversations_read"] == 2 and report["answers"] == 2 and figs["draft_vocab_size"] == 16384
    assert figs["tokens"] == sum(map(len, ids)) and figs["outside"] == outside > 0  # " Mars", " odd": outside it
    assert {"token": " Mars", "count": 1} in figs["commonest"]
    assert f"{SHIPPED}: {100 * outside / figs['tokens']:.2f} % of" in capsys.readouterr().out


@pytest.mark.real
def test_a_drafter_for_a_smaller_vocabulary_is_a_one_line_error(tmp_path, capsys) -> None:
    run = _run(tmp_path, [{"id": "c", "messages": [{"role": "assistant", "content": "Hello."}]}])
    small = tmp_path / "small"
    small.mkdir()
    save_file({"t2d": torch.ones(1000, dtype=torch.bool)}, str(small / "model.safetensors"))
    assert eval_main(["coverage", "--config", "configs/smollm2-135m.yaml", "--checkpoint", str(small),
                      "--set", f"run_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {small}: t2d covers 1000 target ids, the target's tokenizer has 49152: a drafter for "
                   "another vocabulary"]

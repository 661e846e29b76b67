"""The ablations' data rows (bench/ablations.py): first turns whole or with short answers, from multi-turn
conversations."""

from __future__ import annotations

from bench.ablations import DATA_ROWS, first_turns, row_overrides


class WordTokenizer:
    """One token a word: enough to cut answers by token count."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": text.split()}

    def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


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

"""train.max_answer_tokens: only the first N tokens of each assistant turn carry loss, the tokens after them
stay in the sample as context; applied where samples are rendered (capture's render_all, used by the store
and by online training), and a store captured with another cap is refused by training."""

from __future__ import annotations

import types

import pytest
import torch

from common.config import parse_config
from data_prep import capture
from data_prep.loss_mask import render_with_mask
from target_model.hf_model import load_tokenizer, resolve_source

CONV = [
    {"role": "user", "content": "Count to twenty."},
    {"role": "assistant", "content": " ".join(str(i) for i in range(1, 21))},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "You are welcome."},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i - start))
            start = None
    return out


def test_only_the_first_tokens_of_each_answer_carry_loss(tok) -> None:
    full = render_with_mask(tok, CONV, 4096)
    capped = render_with_mask(tok, CONV, 4096, max_answer_tokens=5)
    assert capped.input_ids == full.input_ids  # the tail stays as context
    (a, long_n), (b, short_n) = runs(full.loss_mask)
    assert (long_n, short_n) == (51, 5)  # a token per digit and space, <|im_end|>; "You are welcome.<|im_end|>"
    assert runs(capped.loss_mask) == [(a, 5), (b, 5)]
    assert runs(render_with_mask(tok, CONV, 4096, max_answer_tokens=4).loss_mask) == [(a, 4), (b, 4)]
    assert render_with_mask(tok, CONV, 4096, max_answer_tokens=1000).loss_mask == full.loss_mask


@pytest.mark.parametrize("pool", [False, True])
def test_render_all_caps_in_process_and_in_its_pool(tok, monkeypatch, pool: bool) -> None:
    if pool:
        monkeypatch.setattr(capture, "RENDER_POOL_MIN", 1)
    convs = [{"id": f"c{i}", "messages": CONV} for i in range(4)]
    samples, _ = capture.render_all(convs, tok, 4096, workers=2 if pool else 1, max_answer_tokens=3)
    uncapped, _ = capture.render_all(convs, tok, 4096, workers=1)
    for s, u in zip(samples, uncapped, strict=True):
        assert s.input_ids == u.input_ids and [n for _, n in runs(s.loss_mask)] == [3, 3]


def _cfg(tmp_path, **train):
    return parse_config({"run_dir": str(tmp_path), "target": {"name": "smollm2-135m-instruct", "device": "cpu"},
                         "data": {"sources": [{"kind": "lines", "path": "unused"}]}, "train": train,
                         "eval": {"datasets": [{"name": "x", "kind": "lines"}]}})


def test_training_from_a_store_captured_with_another_cap_is_refused(tmp_path, monkeypatch) -> None:
    from data_prep.store import StoreError
    from train import data

    monkeypatch.setattr(data, "read_manifest", lambda store: {"max_answer_tokens": None})
    with pytest.raises(StoreError, match=r"captured with train.max_answer_tokens=None, the config says 256; rerun "
                                         r"`python -m data_prep capture`"):
        data.store_data(_cfg(tmp_path, max_answer_tokens=256))
    monkeypatch.setattr(data, "read_manifest", lambda store: {"max_answer_tokens": 256})
    with pytest.raises(StoreError, match="captured with train.max_answer_tokens=256, the config says None"):
        data.store_data(_cfg(tmp_path))


def test_online_training_renders_with_the_cap(tmp_path, tok, monkeypatch) -> None:
    import json

    from train import data

    (tmp_path / "conversations.jsonl").write_text(
        "".join(json.dumps({"id": f"c{i}", "messages": CONV}) + "\n" for i in range(6)))
    stub = types.SimpleNamespace(tokenizer=tok, num_layers=30, name="stub", hidden_size=8, vocab_size=4,
                                 embed_weight=lambda: torch.zeros(4, 8), lm_head_weight=lambda: torch.zeros(4, 8),
                                 fingerprint=lambda: "0")
    monkeypatch.setattr(data, "load_target_from_config", lambda cfg: stub)
    td = data.online_data(_cfg(tmp_path, source="online", max_answer_tokens=4, holdout_fraction=0.0),
                          torch.device("cpu"))
    assert len(td.train) == 6
    for i in range(6):
        assert [n for _, n in runs(td.train[i]["loss_mask"].tolist())] == [4, 4]

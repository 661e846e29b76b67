"""The SGLang capture backend against an engine that checks its arguments as sglang 0.5.23's ServerArgs does for
aux capture (``handle_aux_hidden_state_capture``) and answers with bodies shaped like its ``Engine.generate``
(``meta_info``: ``hidden_states`` [prompt rows, then one per new token], ``input_top_logprobs`` with None first,
``output_top_logprobs``; entries ``(logprob, token_id, None)`` without a tokenizer). sglang itself cannot be
installed here: what these tests pin is our side of those arguments and that body, and that a short body is an
error."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import load_config
from data_prep.capture_sample import CaptureError
from data_prep.capture_sglang import SGLANG_DEFAULT_CHUNK, SGLangCaptureBackend

REPO = Path(__file__).resolve().parents[1]
AUX_IDS = (2, 15, 27)
AUX_WIDTH = 6  # 3 aux layers x hidden 2
TOPK = 3


def top_entries(position: int) -> list[tuple[float, int, None]]:
    """Position p's top-k: token ids 100p, 100p+1, ... (the first the argmax), descending logprobs."""
    return [(-0.1 * (j + 1), 100 * position + j, None) for j in range(TOPK)]


class FakeEngine:
    """Records its ServerArgs keywords; answers each prompt as sglang does, keeping ``rows_kept`` prompt rows at most
    (what a chunked prompt's last chunk returns)."""

    made: list[FakeEngine] = []
    rows_kept: int | None = None

    def __init__(self, **kwargs: Any) -> None:
        if kwargs.get("enable_return_aux_hidden_states"):  # 0.5.23's rules for capture without a draft
            ids = kwargs.get("return_aux_hidden_state_layer_ids")
            if (kwargs.get("speculative_algorithm") or "").upper() not in ("EAGLE3", "DFLASH", "DSPARK"):
                raise ValueError("--enable-return-aux-hidden-states needs --speculative-algorithm EAGLE3")
            if kwargs.get("speculative_draft_model_path") is not None:
                raise ValueError("--enable-return-aux-hidden-states captures without a draft")
            if ids is not None and (not ids or min(ids) < 0 or len(set(ids)) != len(ids)):
                raise ValueError(f"--return-aux-hidden-state-layer-ids {ids}")
        elif kwargs.get("return_aux_hidden_state_layer_ids") is not None:
            raise ValueError("--return-aux-hidden-state-layer-ids requires --enable-return-aux-hidden-states.")
        self.kwargs = kwargs
        FakeEngine.made.append(self)

    def generate(self, *, input_ids: list[list[int]], sampling_params: dict, return_hidden_states: bool,
                 return_logprob: bool, logprob_start_len: int, top_logprobs_num: int) -> list[dict[str, Any]]:
        assert return_hidden_states and return_logprob and logprob_start_len == 0 and top_logprobs_num == TOPK
        assert sampling_params == {"max_new_tokens": 1, "temperature": 0.0}
        outs = []
        for seq in input_ids:
            n = len(seq) if self.rows_kept is None else min(len(seq), self.rows_kept)
            prompt_rows = [[float(t)] * AUX_WIDTH for t in range(len(seq) - n, len(seq))]
            outs.append({"output_ids": [7], "meta_info": {
                "hidden_states": [prompt_rows, [[9.0] * AUX_WIDTH]],
                "input_top_logprobs": [None] + [top_entries(p) for p in range(1, len(seq))],
                "output_top_logprobs": [top_entries(len(seq))],
            }})
        return outs


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> type[FakeEngine]:
    FakeEngine.made, FakeEngine.rows_kept = [], None
    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FakeEngine))
    return FakeEngine


def backend(max_length: int) -> SGLangCaptureBackend:
    cfg = load_config(REPO / "configs" / "smollm2-135m.yaml",
                      ["capture.backend=sglang", "capture.teacher=topk", f"capture.topk={TOPK}",
                       "drafter.init_from=null", f"capture.max_length={max_length}"])
    return SGLangCaptureBackend(cfg, AUX_IDS)


@pytest.mark.parametrize(("max_length", "chunk"), [(2048, SGLANG_DEFAULT_CHUNK), (20000, 20000)])
def test_no_capture_sequence_is_ever_chunked(fake_sglang: type[FakeEngine], max_length: int, chunk: int) -> None:
    backend(max_length)
    kwargs = fake_sglang.made[-1].kwargs
    assert kwargs["chunked_prefill_size"] == chunk >= max_length


def test_the_target_alone_captures_the_ids_a_drafter_config_carries(fake_sglang: type[FakeEngine]) -> None:
    """No drafter is loaded (nothing reserved for one); the ids go to the hook serving calls, unchanged."""
    backend(2048)
    kwargs = fake_sglang.made[-1].kwargs
    assert kwargs["enable_return_aux_hidden_states"] and kwargs["speculative_algorithm"] == "EAGLE3"
    assert kwargs["return_aux_hidden_state_layer_ids"] == list(AUX_IDS)
    assert "speculative_draft_model_path" not in kwargs


def test_every_position_gets_its_own_row_and_next_token_distribution(fake_sglang: type[FakeEngine]) -> None:
    (sample,) = backend(2048).run([[11, 12, 13, 14]])
    assert sample["aux"].shape == (4, AUX_WIDTH) and sample["aux"][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    # position t's teacher is the distribution of token t+1: input entry t+1, the last from the first output
    assert sample["target_argmax"].tolist() == [100, 200, 300, 400]
    assert sample["topk_ids"].shape == sample["topk_logprobs"].shape == (4, TOPK)
    assert sample["topk_ids"].dtype == torch.int32 and torch.all(sample["topk_logprobs"] < 0)


def test_a_prompt_that_came_back_short_is_an_error_not_a_short_sample(fake_sglang: type[FakeEngine]) -> None:
    capture = backend(2048)
    fake_sglang.rows_kept = 2  # a chunked prompt: only its last chunk's rows
    with pytest.raises(CaptureError, match="returned 2 hidden-state rows for a 4-token sample"):
        capture.run([[11, 12, 13, 14]])

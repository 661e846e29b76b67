"""The loss mask covers exactly the assistant text (+ end-of-turn marker), for two template families."""

from __future__ import annotations

import copy
import types

import pytest
from loss_mask_spans import masked_spans

from data_prep.loss_mask import LossMaskError, render_with_mask

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4, of course."},
    {"role": "user", "content": "And\n3+3?"},
    {"role": "assistant", "content": "It is 6.\nDone!"},
]

# Llama-3 style: header blocks, <|eot_id|> ends a turn, no newline after it, content trimmed.
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@pytest.mark.real
def test_chatml_mask_is_assistant_content_plus_im_end(smollm2):
    tok = smollm2.tokenizer
    r = render_with_mask(tok, CONV, max_length=4096)
    assert masked_spans(tok, r) == ["4, of course.<|im_end|>", "It is 6.\nDone!<|im_end|>"]
    assert r.prefix_fallbacks == 0
    # The newline after <|im_end|> is not in the mask; the token after the last masked one is "\n".
    last = max(i for i, m in enumerate(r.loss_mask) if m)
    assert r.input_ids[last] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.decode(r.input_ids[last + 1:]) == "\n"


@pytest.mark.real
def test_llama3_style_template_mask(smollm2):
    tok = copy.deepcopy(smollm2.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3
    r = render_with_mask(tok, CONV, max_length=4096)
    assert masked_spans(tok, r) == ["4, of course.<|eot_id|>", "It is 6.\nDone!<|eot_id|>"]
    assert r.input_ids[-1] == tok.convert_tokens_to_ids("<|eot_id|>") and r.loss_mask[-1] == 1


@pytest.mark.real
def test_truncation_and_no_assistant(smollm2):
    tok = smollm2.tokenizer
    full = render_with_mask(tok, CONV, max_length=4096)
    cut = render_with_mask(tok, CONV, max_length=20)
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]
    assert render_with_mask(tok, CONV[:2], max_length=4096).num_loss_tokens == 0
    opening = render_with_mask(tok, [{"role": "assistant", "content": "Hi!"}, *CONV[1:3]], max_length=4096)
    assert masked_spans(tok, opening) == ["4, of course.<|im_end|>"]


@pytest.mark.real
def test_template_that_rewrites_history_is_refused(smollm2):
    tok = copy.deepcopy(smollm2.tokenizer)
    # Drops earlier assistant turns (like reasoning templates stripping old thoughts): no stable prefix.
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(LossMaskError) as e:
        render_with_mask(tok, CONV, max_length=4096)
    assert e.value.reason == "template_not_prefix_stable"


# ---------------------------------------------------------------- cut answers: no loss on their end-of-turn
CUT_CONV = [
    {"role": "user", "content": "Tell me about rain."},
    {"role": "assistant", "content": "Rain falls.\nRain falls."},
    {"role": "user", "content": "And snow?"},
    {"role": "assistant", "content": "Snow is cold."},
]


@pytest.fixture(scope="module")
def tok():
    from target_model.hf_model import load_tokenizer, resolve_source

    return load_tokenizer(resolve_source("smollm2-135m-instruct", None), False)


@pytest.mark.parametrize("reason", ["loop", "length"])
def test_a_cut_answer_has_no_loss_on_its_end_of_turn(tok, reason: str) -> None:
    from data_prep.capture import render_all

    rec = {"id": "c", "messages": CUT_CONV, "finish_reasons": [reason, "stop"]}
    [s], _ = render_all([rec], tok, 4096, workers=1)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ends = [i for i, t in enumerate(s.input_ids) if t == im_end]
    # the template's default system turn, the user, the cut answer, the user, the answer that stopped
    assert [s.loss_mask[i] for i in ends] == [0, 0, 0, 0, 1]
    assert masked_spans(tok, types.SimpleNamespace(input_ids=s.input_ids, loss_mask=s.loss_mask)) == [
        "Rain falls.\nRain falls.", "Snow is cold.<|im_end|>"]


def _eot_loss(tok, r) -> list[int]:
    """The loss on each <|im_end|> of a rendered chat (SmolLM2 adds a system turn when there is none)."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    return [m for t, m in zip(r.input_ids, r.loss_mask, strict=True) if t == im_end]


@pytest.mark.parametrize(("reasons", "answer_eots"), [
    (["stop", "loop"], [1, 0]), (["length", "stop"], [0, 1]), (["tool_calls", "length"], [1, 0]),
    (["loop", "loop"], [0, 0]), (["stop", "stop"], [1, 1]), (["abort", "stop"], [0, 1]),  # any other reason: cut
])
def test_each_answer_goes_by_its_own_finish_reason(tok, reasons, answer_eots) -> None:
    r = render_with_mask(tok, CUT_CONV, 4096, finish_reasons=reasons)
    assert _eot_loss(tok, r) == [0, 0, answer_eots[0], 0, answer_eots[1]]
    whole = render_with_mask(tok, CUT_CONV, 4096)
    assert r.input_ids == whole.input_ids and r.unlocated_ends == 0  # the marker stays as context
    # a cut answer loses exactly its end-of-turn marker, nothing of its text
    assert sum(whole.loss_mask) - sum(r.loss_mask) == answer_eots.count(0)


def test_without_finish_reasons_every_answer_keeps_its_end_of_turn(tok) -> None:
    """Source data never regenerated: today's mask, the same as answers that all stopped."""
    r = render_with_mask(tok, CUT_CONV, 4096)
    assert _eot_loss(tok, r) == [0, 0, 1, 0, 1]
    assert r.loss_mask == render_with_mask(tok, CUT_CONV, 4096, finish_reasons=["stop", "stop"]).loss_mask


def test_an_opening_assistant_turn_has_no_finish_reason(tok) -> None:
    """Regenerate never writes an opening assistant turn (it answers nothing, no loss): the reasons are those of
    the answers after it, and a record whose count differs is skipped and counted."""
    from data_prep.capture import render_all

    chat = [{"role": "assistant", "content": "Hi! Ask me anything."}, *CUT_CONV]
    r = render_with_mask(tok, chat, 4096, finish_reasons=["loop", "stop"])
    assert _eot_loss(tok, r) == [0, 0, 0, 0, 0, 1]  # system, opening, user, cut answer, user, stopped answer
    assert masked_spans(tok, r) == ["Rain falls.\nRain falls.", "Snow is cold.<|im_end|>"]
    recs = [{"id": "ok", "messages": chat, "finish_reasons": ["loop", "stop"]},
            {"id": "bad", "messages": chat, "finish_reasons": ["stop", "loop", "stop"]}]
    samples, left_out = render_all(recs, tok, 4096, workers=1)
    assert [s.id for s in samples] == ["ok"] and left_out.skipped == {"finish_reasons_mismatch": 1}


def test_a_cut_answer_whose_text_the_template_changes_keeps_its_span_and_is_counted(tok) -> None:
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + (m['content'] | upper if m['role'] == "
                         "'assistant' else m['content']) + '<|im_end|>\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    r = render_with_mask(tok, CUT_CONV, 4096, finish_reasons=["loop", "stop"])
    assert r.unlocated_ends == 1 and _eot_loss(tok, r) == [0, 1, 0, 1]


def test_a_trimming_template_ends_a_cut_span_at_the_trimmed_text(tok) -> None:
    tok = copy.deepcopy(tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.chat_template = LLAMA3
    chat = [*CONV[:2], {"role": "assistant", "content": "4, of course. \n"}, *CONV[3:]]
    r = render_with_mask(tok, chat, 4096, finish_reasons=["length", "stop"])
    assert masked_spans(tok, r) == ["4, of course.", "It is 6.\nDone!<|eot_id|>"] and r.unlocated_ends == 0


def test_training_refuses_a_store_captured_before_cut_answers_lost_their_end_of_turn(tmp_path, monkeypatch) -> None:
    from common.config import parse_config
    from data_prep.store import StoreError
    from train import data

    cfg = parse_config({"run_dir": str(tmp_path), "target": {"name": "smollm2-135m-instruct", "device": "cpu"},
                        "data": {"sources": [{"kind": "lines", "path": "unused"}]},
                        "eval": {"datasets": [{"name": "x", "kind": "lines"}]}})
    monkeypatch.setattr(data, "read_manifest", lambda store: {"max_answer_tokens": None})
    with pytest.raises(StoreError, match=r"captured before cut answers \(finish reason length, loop\) lost the loss "
                                         r"on their end-of-turn marker, .*; rerun `python -m data_prep capture`"):
        data.store_data(cfg)
    monkeypatch.setattr(data, "read_manifest", lambda store: {"max_answer_tokens": None,
                                                               "end_of_turn_loss": "specforge"})
    with pytest.raises(StoreError, match="captured with end_of_turn_loss specforge, capture.backend hf wants "
                                         "ended_answers; rerun"):
        data.store_data(cfg)


COUNT = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"},
         {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "1 2 3 4 5 6 7 8 9 10"}]
LATE = [{"role": "user", "content": " ".join(["word"] * 60)}, {"role": "assistant", "content": "Yes."}]


def test_the_rendering_counts_what_max_length_and_the_answer_cap_take(tok) -> None:
    """Cut at 64 tokens (the second answer runs to 89) with a 5-token answer cap: the tokens past 64 and the loss
    tokens among them (under the cap), and the answer tokens the cap takes out of the loss, so the three loss
    figures add up to the uncapped, uncut loss."""
    from data_prep.loss_mask import Cuts

    full, capped = render_with_mask(tok, COUNT, 4096), render_with_mask(tok, COUNT, 4096, max_answer_tokens=5)
    r = render_with_mask(tok, COUNT, 64, max_answer_tokens=5)
    assert len(full.input_ids) == 89 and full.cuts == Cuts()
    want = Cuts(1, 89 - 64, sum(capped.loss_mask[64:]), full.num_loss_tokens - capped.num_loss_tokens)
    assert r.cuts == want and want.truncated_loss_tokens > 0 and want.capped_loss_tokens > 0
    assert r.num_loss_tokens + want.truncated_loss_tokens + want.capped_loss_tokens == full.num_loss_tokens
    assert render_with_mask(tok, COUNT, 64).cuts == Cuts(1, 25, sum(full.loss_mask[64:]), 0)


def test_render_all_reports_the_cuts_of_its_samples_and_why_it_skipped(tok) -> None:
    from data_prep.capture import render_all
    from data_prep.loss_mask import Cuts

    recs = [{"id": "count", "messages": COUNT}, {"id": "late", "messages": LATE},
            {"id": "short", "messages": CONV}, {"id": "none", "messages": CONV[:2]}]
    samples, left_out = render_all(recs, tok, 64, workers=1, max_answer_tokens=5)
    assert [s.id for s in samples] == ["count", "short"]
    # every loss token of "late" lay past max_length; "none" has no answer
    assert left_out.skipped == {"loss_past_max_length": 1, "no_loss_tokens": 1}
    parts = [render_with_mask(tok, c, 64, max_answer_tokens=5).cuts for c in (COUNT, CONV)]
    assert left_out.cuts == parts[0] + parts[1] and left_out.cuts.truncated_samples == 1
    assert left_out.cuts.capped_loss_tokens > parts[0].capped_loss_tokens  # the short chat's answers are capped too
    assert str(left_out) == (f"skipped: loss_past_max_length: 1, no_loss_tokens: 1; samples cut at capture.max_length: "
                             f"1 (25 tokens, {left_out.cuts.truncated_loss_tokens} loss tokens); tokens out of the "
                             f"loss by train.max_answer_tokens: {left_out.cuts.capped_loss_tokens}")
    assert render_all(recs[2:3], tok, 4096, workers=1)[1].cuts == Cuts()

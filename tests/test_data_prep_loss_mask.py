"""The loss mask covers exactly the assistant text (+ end-of-turn marker), for two template families."""

from __future__ import annotations

import copy

import pytest

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


def _masked_spans(tok, r) -> list[str]:
    spans, cur = [], []
    for t, m in zip(r.input_ids, r.loss_mask, strict=True):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


@pytest.mark.real
def test_chatml_mask_is_assistant_content_plus_im_end(smollm2):
    tok = smollm2.tokenizer
    r = render_with_mask(tok, CONV, max_length=4096)
    assert _masked_spans(tok, r) == ["4, of course.<|im_end|>", "It is 6.\nDone!<|im_end|>"]
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
    assert _masked_spans(tok, r) == ["4, of course.<|eot_id|>", "It is 6.\nDone!<|eot_id|>"]
    assert r.input_ids[-1] == tok.convert_tokens_to_ids("<|eot_id|>") and r.loss_mask[-1] == 1


@pytest.mark.real
def test_truncation_and_no_assistant(smollm2):
    tok = smollm2.tokenizer
    full = render_with_mask(tok, CONV, max_length=4096)
    cut = render_with_mask(tok, CONV, max_length=20)
    assert cut.input_ids == full.input_ids[:20] and cut.loss_mask == full.loss_mask[:20]
    assert render_with_mask(tok, CONV[:2], max_length=4096).num_loss_tokens == 0
    opening = render_with_mask(tok, [{"role": "assistant", "content": "Hi!"}, *CONV[1:3]], max_length=4096)
    assert _masked_spans(tok, opening) == ["4, of course.<|im_end|>"]


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

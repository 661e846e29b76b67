"""Eagle3Drafter math: the KV-cache path, the TTT diag path, GQA, RoPE and RMSNorm against references."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from drafter.model import DrafterShape, Eagle3Drafter, RMSNorm, apply_rope, attention, causal_mask


def test_kv_cache_path_equals_full_forward(tiny_drafter: Eagle3Drafter) -> None:
    torch.manual_seed(1)
    b, t, p = 2, 9, 4
    ids = torch.randint(0, tiny_drafter.shape.vocab_size, (b, t))
    hidden = torch.randn(b, t, tiny_drafter.shape.hidden_size)
    pos = torch.arange(t).expand(b, t) + 3  # positions need not start at 0
    with torch.no_grad():
        full = tiny_drafter.step(ids, hidden, pos, mask=causal_mask(t, 0))
        pre = tiny_drafter.step(ids[:, :p], hidden[:, :p], pos[:, :p], mask=causal_mask(p, 0))
        k, v, outs = pre.k, pre.v, [pre.prenorm]
        for i in range(p, t):
            o = tiny_drafter.step(ids[:, i:i + 1], hidden[:, i:i + 1], pos[:, i:i + 1], past=(k, v),
                                  mask=causal_mask(1, i))
            k, v = torch.cat([k, o.k], 2), torch.cat([v, o.v], 2)
            outs.append(o.prenorm)
    torch.testing.assert_close(torch.cat(outs, 1), full.prenorm, rtol=0, atol=1e-5)
    torch.testing.assert_close(k, full.k, rtol=0, atol=1e-6)
    torch.testing.assert_close(v, full.v, rtol=0, atol=1e-6)
    torch.testing.assert_close(tiny_drafter.logits(torch.cat(outs, 1)), tiny_drafter.logits(full.prenorm),
                               rtol=0, atol=1e-5)


def test_left_padding_stays_finite_and_does_not_change_real_rows(tiny_drafter: Eagle3Drafter) -> None:
    """A fully masked query row (left padding) must not produce NaN that later leaks via the cache."""
    torch.manual_seed(2)
    h = tiny_drafter.shape.hidden_size
    ids = torch.randint(0, tiny_drafter.shape.vocab_size, (1, 5))
    hidden = torch.randn(1, 5, h)
    padded_ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids], 1)
    padded_hidden = torch.cat([torch.randn(1, 2, h), hidden], 1)
    keep = torch.tensor([[False, False, True, True, True, True, True]])
    with torch.no_grad():
        ref = tiny_drafter.step(ids, hidden, torch.arange(5)[None], mask=causal_mask(5, 0))
        out = tiny_drafter.step(padded_ids, padded_hidden, (torch.arange(7) - 2).clamp(min=0)[None],
                                mask=causal_mask(7, 0, keep))
        assert torch.isfinite(out.prenorm).all()
        torch.testing.assert_close(out.prenorm[:, 2:], ref.prenorm, rtol=0, atol=1e-5)
        # The padded rows' outputs feed a next step whose cache holds their keys: still finite.
        nxt = tiny_drafter.step(padded_ids, out.prenorm, torch.arange(7)[None] + 1, past=(out.k, out.v),
                                mask=causal_mask(7, 7, torch.cat([keep, keep], 1)))
        assert torch.isfinite(nxt.prenorm).all()


def _loop_attention(q, k, v, mask, diag):
    """Per (batch, head, query) softmax over its allowed keys plus its same-position diag keys."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            g = hi // groups
            for ti in range(t):
                m = mask[bi if mask.shape[0] > 1 else 0, 0, ti]
                keys = [k[bi, g, s] for s in range(k.shape[2]) if m[s]] + [dk[bi, g, ti] for dk, _ in diag]
                vals = [v[bi, g, s] for s in range(v.shape[2]) if m[s]] + [dv[bi, g, ti] for _, dv in diag]
                if not keys:  # a padding query: no defined answer, compared nowhere
                    continue
                keys, vals = torch.stack(keys).double(), torch.stack(vals).double()
                w = torch.softmax(keys @ q[bi, hi, ti].double() / math.sqrt(d), 0)
                out[bi, hi, ti] = w @ vals
    return out


@pytest.mark.parametrize("n_diag", [0, 1, 3])
def test_diag_attention_equals_per_query_loop(n_diag: int) -> None:
    """The TTT pattern: step-0 keys under the causal mask plus, per query, earlier steps' same-position keys."""
    torch.manual_seed(3)
    b, h, kv, t, d = 2, 4, 2, 6, 8
    q = torch.randn(b, h, t, d)
    k, v = torch.randn(b, kv, t, d), torch.randn(b, kv, t, d)
    diag = [(torch.randn(b, kv, t, d), torch.randn(b, kv, t, d)) for _ in range(n_diag)]
    mask = causal_mask(t, 0, torch.tensor([[True] * t, [False] + [True] * (t - 1)]))
    got = attention(q, k, v, mask, diag)
    want = _loop_attention(q, k, v, mask, diag)
    rows = mask[:, 0].any(-1) | (n_diag > 0)  # rows with at least one key (others are padding)
    rows = rows[:, None, :, None].expand_as(got)
    torch.testing.assert_close(got.double()[rows], want[rows], rtol=0, atol=1e-5)


def test_gqa_matches_repeat_kv_and_sdpa() -> None:
    torch.manual_seed(4)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    mask = causal_mask(5, 0)
    want = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 3), repeat_kv(v, 3), attn_mask=mask)
    torch.testing.assert_close(attention(q, k, v, mask), want, rtol=0, atol=1e-5)
    # Grouping is real: swapping the kv heads changes the result.
    assert not torch.allclose(attention(q, k.flip(1), v.flip(1), mask), want, atol=1e-3)


@pytest.mark.parametrize("scaling", [
    None,
    {"type": "linear", "factor": 4.0},  # legacy spelling, as old config.json files carry it
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_matches_transformers(scaling: dict | None) -> None:
    shape = DrafterShape(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=50, draft_vocab_size=20, aux_layer_ids=(0, 1, 2),
                         rope_theta=500000.0, rope_scaling=scaling, max_position_embeddings=1024)
    params = {"rope_theta": 500000.0, "rope_type": "default"}
    if scaling:
        params.update({k: v for k, v in scaling.items() if k != "type"}, rope_type=scaling.get("type") or
                      scaling["rope_type"])
    ref = LlamaRotaryEmbedding(LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=16,
                                           max_position_embeddings=1024, rope_parameters=params))
    pos = torch.tensor([[0, 1, 7, 63, 64, 500, 1000]])
    cos_ref, sin_ref = ref(torch.zeros(1, 1, dtype=torch.float32), pos)
    m = Eagle3Drafter(shape)
    cos, sin = m.rope(pos, torch.float32)
    torch.testing.assert_close(cos, cos_ref, rtol=0, atol=0)  # exact: the same formula, op for op
    torch.testing.assert_close(sin, sin_ref, rtol=0, atol=0)
    if scaling:  # the scaled frequencies really differ from plain RoPE
        plain = Eagle3Drafter(DrafterShape(**{**shape.as_dict(), "rope_scaling": None}))
        assert not torch.allclose(plain.rope(pos, torch.float32)[0], cos)
    x = torch.randn(1, 4, pos.shape[1], 16)
    want, _ = apply_rotary_pos_emb(x, x, cos_ref, sin_ref)
    torch.testing.assert_close(apply_rope(x, cos, sin), want, rtol=0, atol=1e-6)


def test_bf16_drafter_keeps_fp32_rope_frequencies() -> None:
    """At the K2 drafter's RoPE (head_dim 128, theta 1e6) a bf16-rounded inv_freq puts cos/sin off by
    up to ~1 at position 8,000; SGLang serves fp32 frequencies, so a cast must not round them."""
    shape = DrafterShape(hidden_size=64, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=128, vocab_size=50, draft_vocab_size=20, aux_layer_ids=(0, 1, 2),
                         rope_theta=1_000_000.0, max_position_embeddings=131072)
    torch.manual_seed(0)
    fp32 = Eagle3Drafter(shape)
    bf16 = Eagle3Drafter(shape).to(torch.bfloat16)
    assert bf16.fc.weight.dtype == torch.bfloat16 and bf16.inv_freq.dtype == torch.float32
    assert torch.equal(bf16.inv_freq, fp32.inv_freq)
    pos = torch.tensor([[8000]])
    for a, b in zip(bf16.rope(pos, torch.float32), fp32.rope(pos, torch.float32), strict=True):
        assert (a - b).abs().max() <= 1e-6
    rounded = (pos[..., None].float() * fp32.inv_freq.to(torch.bfloat16).float()).cos()
    assert (rounded - (pos[..., None].float() * fp32.inv_freq).cos()).abs().max() > 0.1  # what a cast did
    assert bf16.to(torch.float16).half().inv_freq.dtype == torch.float32  # every later cast too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_llama(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    ours, ref = RMSNorm(24, 1e-5), LlamaRMSNorm(24, eps=1e-5)
    w = torch.rand(24) + 0.5
    with torch.no_grad():
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    x = (torch.randn(3, 7, 24) * 4).to(dtype)
    ours, ref = ours.to(dtype), ref.to(dtype)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)  # exact: the same ops in the same order


def test_logits_and_target_ids(tiny_drafter: Eagle3Drafter) -> None:
    s = tiny_drafter.shape
    chosen = torch.sort(torch.randperm(s.vocab_size)[: s.draft_vocab_size]).values
    t2d = torch.zeros(s.vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    tiny_drafter.set_vocab_map(chosen - torch.arange(s.draft_vocab_size), t2d)
    draft_ids = torch.tensor([[0, 5, s.draft_vocab_size - 1]])
    assert torch.equal(tiny_drafter.to_target_ids(draft_ids), chosen[draft_ids])
    logits = tiny_drafter.logits(torch.randn(1, 3, s.hidden_size))
    assert logits.shape == (1, 3, s.draft_vocab_size)


def test_shape_rejects_impossible_numbers(tiny_shape: DrafterShape) -> None:
    base = tiny_shape.as_dict()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DrafterShape(**{**base, "draft_vocab_size": base["vocab_size"] + 1})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DrafterShape(**{**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="aux_layer_ids"):
        DrafterShape(**{**base, "aux_layer_ids": (1, 2)})


def test_embeddings_frozen_and_checked(tiny_drafter: Eagle3Drafter) -> None:
    assert not tiny_drafter.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="vocab_size, hidden_size"):
        tiny_drafter.set_embeddings(torch.zeros(3, 3))

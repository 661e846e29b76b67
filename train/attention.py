"""Fast TTT attention for CUDA: flex_attention over step 0's causal keys, merged by log-sum-exp with
the same-position (diagonal) keys of later steps. Same maths as ``drafter.model.attention``, which
materialises the (T, T) scores; this never does, so a 2k-4k context fits and runs at kernel speed.

It serves ``Eagle3Drafter.step`` as ``attn_fn`` in the pattern ``train.ttt.ttt_forward`` builds: keys
are step 0's T keys (step 0), or those followed by the call's own T keys (step i > 0, the own keys
being the newest diagonal entry); ``mask`` is that fixed pattern and is not read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

try:  # torch >= 2.9 names the log-sum-exp output an "aux" request; older ones a flag
    from torch.nn.attention.flex_attention import AuxRequest

    LSE_KWARGS: dict = {"return_aux": AuxRequest(lse=True)}
except ImportError:  # pragma: no cover - depends on the installed torch
    LSE_KWARGS = {"return_lse": True}

_compiled = None


def _flex():
    """flex_attention is only fast compiled; CPU runs it eagerly (forward only, for tests).

    Compiled with dynamic shapes: token-budget batches vary in rows (4 of 4,096 tokens, 168 of 97) and in
    length (multiples of 16), and a static compile per shape hit torch's recompile limit (8) within a few
    dozen steps, after which flex ran unfused. Dynamic, one graph serves every batch of 2+ rows and 256+
    positions; a batch of one row, or of one 128-token block, takes one more each (size-1 dims specialise),
    so a run compiles at most a handful (tests/test_train_ttt.py counts them)."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=True)
    return _compiled


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@lru_cache(maxsize=256)  # a batch's length is a multiple of 16 (train.loop.pad_multiple): 256 cover 4k positions
def causal_block_mask(t: int, device: str) -> BlockMask:
    return create_block_mask(_causal, None, None, t, t, device=device)


def _diag_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """q (B, h, T, d) . k (B, kv, T, d) per position, GQA-grouped like repeat_interleave: (B, h, T)."""
    b, h, t, d = q.shape
    kv = k.shape[1]
    qg = q.float().view(b, kv, h // kv, t, d)
    return ((qg * k.float().unsqueeze(2)).sum(-1) * scale).view(b, h, t)


def _expand(v: Tensor, heads: int) -> Tensor:
    return v.repeat_interleave(heads // v.shape[1], 1)


def ttt_flex_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
                       diag: Sequence[tuple[Tensor, Tensor]] = ()) -> Tensor:
    t = q.shape[2]
    if keys.shape[2] not in (t, 2 * t):
        raise ValueError(f"ttt_flex_attention: {keys.shape[2]} keys for {t} queries; expected T or 2T")
    diag = list(diag)
    if keys.shape[2] == 2 * t:
        diag.append((keys[:, :, t:], values[:, :, t:]))
        keys, values = keys[:, :, :t], values[:, :, :t]
    run = _flex() if q.is_cuda else flex_attention
    out, extra = run(q, keys.contiguous(), values.contiguous(), block_mask=causal_block_mask(t, str(q.device)),
                     enable_gqa=keys.shape[1] != q.shape[1], **LSE_KWARGS)
    lse = extra.lse if hasattr(extra, "lse") else extra
    if not diag:
        return out
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.stack([lse.float()] + [_diag_scores(q, k, scale) for k, _ in diag], dim=-1)  # (B,h,T,1+n)
    w = torch.softmax(scores, dim=-1)
    merged = w[..., :1] * out.float()
    for j, (_, v) in enumerate(diag):
        merged = merged + w[..., 1 + j:2 + j] * _expand(v, q.shape[1]).float()
    return merged.to(q.dtype)

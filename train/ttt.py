"""The training-time-test (TTT) step: one unrolled EAGLE-3 loss, pure (no optimizer, no I/O).

Indexing (ARCHITECTURE.md, Conventions). Row index ``t`` of unroll step ``i`` runs at RoPE position
``t + i``, reads the embedding of token ``t + 1 + i`` and is trained toward the target distribution
computed at ``j = t + 1 + i`` (which predicts token ``j + 1``). Step 0's hidden is ``fc(aux[t])``;
step ``i > 0`` reads step ``i - 1``'s pre-norm output at the same row — exactly what a chain draft at
serve time sees after ``i`` accepted draft tokens.

Supervision at ``j``: ``label[j] = loss_mask[j + 1]`` (the token being predicted is assistant text);
the loss also needs the target's argmax at ``j`` inside the draft vocab (the drafter cannot emit
anything else); accuracy keeps those rows as misses, so it is what serving would see.

Loss = sum_i decay**i * mean over step i's loss rows of CE(teacher_j, draft_i,t). The teacher is the
target distribution restricted to the draft vocab and renormalised, computed once (draft rows only). ``Objective``
can replace the CE by the LK losses on the expected acceptance instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from drafter.model import AttentionFn, Eagle3Drafter, attention, causal_mask

CE_CHUNK_ROWS = 1024  # rows of the (rows, draft_vocab) logits handled at a time by the soft CE (eager: CPU)
# On CUDA the chunk functions are fused compiled kernels that read the logits without an fp32 copy of them, so a
# chunk bounds no memory there; each chunk only costs a compiled call on the host (dynamo's guards, AOT's wrapper)
# and a copy of its gradient into the whole. A SmolLM2 batch of 16,384 rows would be 16 chunks, 224 compiled calls a
# step over 7 draft steps; one chunk makes it one a draft step each way.
CUDA_CE_CHUNK_ROWS = 1 << 16


@dataclass(frozen=True)
class Objective:
    """What each TTT step minimises. "kl": the cross-entropy to the teacher (EAGLE's and SpecForge's default). The LK
    losses (arXiv 2602.23881, as SpecForge's main branch offers them) target the expected acceptance
    alpha = sum_v min(p(v), q(v)) of the draft distribution q under the target's p (its probabilities on the draft
    vocab, not renormalised: mass outside the draft vocab is never accepted): "lk_alpha" minimises -mean log alpha;
    "lk_lambda" minimises w * CE + (1 - w) * (1 - mean alpha) with w = kl_scale * exp(-kl_decay * mean alpha) (alpha
    detached there), which moves from imitation to acceptance as acceptance grows."""

    kind: str = "kl"
    kl_scale: float = 1.0
    kl_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("kl", "lk_alpha", "lk_lambda"):
            raise ValueError(f"objective {self.kind!r}: expected kl, lk_alpha or lk_lambda")

    @property
    def needs_mass(self) -> bool:
        """Whether the step needs the target's probability mass on the draft vocab (``draft_mass``)."""
        return self.kind != "kl"

    def step_loss(self, ce: Tensor, alpha: Tensor | None, weight: Tensor, count: Tensor) -> Tensor:
        """One TTT step's loss from its mean CE over the loss rows and, for LK, each row's expected acceptance."""
        if self.kind == "kl":
            return ce
        n = count.clamp(min=1)
        if self.kind == "lk_alpha":
            log_alpha = torch.where(alpha > 0, torch.log(alpha.clamp_min(1e-30)), torch.zeros_like(alpha))
            return -(log_alpha * weight).sum() / n
        mean_alpha = (alpha * weight).sum() / n
        w = self.kl_scale * torch.exp(-self.kl_decay * mean_alpha.detach())
        return w * ce + (1 - w) * (1 - mean_alpha)


KL = Objective()


@torch.no_grad()
def draft_mass(last_hidden: Tensor, head_rows: Tensor, lm_head: Tensor, chunk_rows: int = 4096) -> Tensor:
    """(B, T) fp32: the target's probability mass on the draft vocab at each position, exp(logsumexp over the draft
    rows - logsumexp over every row of ``lm_head``); the full-vocab logits are made ``chunk_rows`` positions at a
    time. The teacher (renormalised over the draft vocab) times this is p on the draft vocab."""
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    out = []
    for chunk in flat.split(chunk_rows):
        full = torch.logsumexp((chunk.to(lm_head.dtype) @ lm_head.t()).float(), -1)
        draft = torch.logsumexp((chunk.to(head_rows.dtype) @ head_rows.t()).float(), -1)
        out.append(torch.exp(draft - full))
    return torch.cat(out).reshape(last_hidden.shape[:-1])


def expected_acceptance(logits: Tensor, p_on_draft: Tensor) -> Tensor:
    """(B, L): sum_v min(p(v), q(v)) per row, q = softmax(logits) over the draft vocab; differentiable in q."""
    return torch.minimum(p_on_draft, torch.softmax(logits.float(), -1)).sum(-1)


@dataclass
class Supervision:
    """What the target says at every position ``j`` (computed once, shared by all unroll steps)."""

    teacher_logp: Tensor  # (B, T, Vd) fp32 log-probs over the draft vocab
    target_argmax: Tensor  # (B, T) int64 target id
    label: Tensor  # (B, T) bool: the token after j is supervised
    in_vocab: Tensor  # (B, T) bool: target_argmax[j] is in the draft vocab


@dataclass
class TTTResult:
    loss: Tensor  # scalar, differentiable
    step_losses: Tensor  # (n,) detached per-step mean CE
    correct: Tensor  # (n, B, T) bool: draft argmax == target argmax (row t of step i)
    scored: Tensor  # (n, B, T) bool: rows counted by accuracy (label at j = t + 1 + i)


def draft_index(t2d: Tensor) -> Tensor:
    """target id -> draft id, -1 outside the draft vocab."""
    index = torch.full(t2d.shape, -1, dtype=torch.long, device=t2d.device)
    index[t2d] = torch.arange(int(t2d.sum()), device=t2d.device)
    return index


def teacher_from_hidden(last_hidden: Tensor, head_rows: Tensor) -> Tensor:
    """Target log-probs renormalised over the draft vocab. ``head_rows`` = lm_head[draft ids] (Vd, H):
    only those rows are multiplied, never the full target vocab."""
    logits = torch.matmul(last_hidden.to(head_rows.dtype), head_rows.t())
    return torch.log_softmax(logits.float(), dim=-1)


def teacher_from_topk(topk_ids: Tensor, topk_logprobs: Tensor, t2d: Tensor) -> Tensor:
    """Stored top-k target log-probs scattered onto draft ids and renormalised; rows with no top-k
    entry in the draft vocab come out uniform (they carry no loss: their argmax is outside)."""
    vd = int(t2d.sum())
    idx = draft_index(t2d)[topk_ids.long()]  # (B, T, k)
    keep = idx >= 0
    logp = torch.full((*topk_ids.shape[:-1], vd + 1), float("-inf"), device=topk_ids.device)
    logp.scatter_(-1, torch.where(keep, idx, vd), topk_logprobs.float().masked_fill(~keep, float("-inf")))
    logp = logp[..., :vd]
    logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
    return torch.where(torch.isfinite(logp).any(-1, keepdim=True), logp, torch.full_like(logp, -math.log(vd)))


def sharpen(teacher_logp: Tensor, temperature: float) -> Tensor:
    """The teacher's log-probs at ``temperature`` (train.teacher_temperature), renormalised: below 1 the mass moves
    toward its argmax, which is what greedy verification accepts; 1 returns them unchanged."""
    if temperature == 1.0:
        return teacher_logp
    return torch.log_softmax(teacher_logp / temperature, dim=-1)


def supervision(teacher_logp: Tensor, target_argmax: Tensor, loss_mask: Tensor, t2d: Tensor) -> Supervision:
    argmax = target_argmax.long()
    label = F.pad(loss_mask.bool()[:, 1:], (0, 1), value=False)
    return Supervision(teacher_logp, argmax, label, t2d[argmax])


def _ce_rows(z: Tensor, probs: Tensor, zrow: Tensor, prow: Tensor) -> tuple[Tensor, Tensor]:
    """Rows ``zrow`` of the logits z (R, V) against rows ``prow`` of the teacher probs (P, V), both flattened:
    per row CE(p, softmax(z)) = logsumexp(z) - p . z (p sums to 1), and the logsumexp. A chunk is named by row
    indices, not cut by slicing, so a compiled kernel always sees the same whole tensors: slices of the teacher at
    each TTT step's offset, or a batch's last short chunk, would otherwise each take a graph of their own."""
    zf, p = z.index_select(0, zrow).float(), probs.index_select(0, prow)
    lse = torch.logsumexp(zf, -1)
    return lse - (p * zf).sum(-1), lse


def _ce_grad(z: Tensor, probs: Tensor, zrow: Tensor, prow: Tensor, lse: Tensor, w: Tensor) -> Tensor:
    zc, p = z.index_select(0, zrow), probs.index_select(0, prow)
    return ((torch.exp(zc.float() - lse.unsqueeze(-1)) - p) * w.unsqueeze(-1)).to(z.dtype)


_fused: dict[str, object] = {}


def compiled_kernels():
    """The two chunk functions compiled with dynamic shapes: every batch shape, TTT step and chunk shares a
    graph (a chunk of one row would specialise: ``_chunks`` never makes one); tests/test_train_ttt.py counts
    them over a run of batch shapes."""
    if not _fused:
        _fused["rows"] = torch.compile(_ce_rows, dynamic=True)
        _fused["grad"] = torch.compile(_ce_grad, dynamic=True)
    return _fused["rows"], _fused["grad"]


def _kernels(device: torch.device):
    """On CUDA the two chunk functions are compiled into fused kernels: eager, each elementwise pass
    over a (rows, 32000) chunk is a full fp32 round trip through memory, and those passes dominate
    the step for small drafters."""
    return compiled_kernels() if device.type == "cuda" else (_ce_rows, _ce_grad)


def _chunks(b: int, rows: int, t: int, offset: int, device: torch.device
            ) -> list[tuple[int, int, Tensor, Tensor]]:
    """(first, end, logit rows, teacher rows) per chunk (``CE_CHUNK_ROWS``; ``CUDA_CE_CHUNK_ROWS`` on CUDA) of the
    flattened (b * rows) logits: logit row r is batch r // rows, position offset + r % rows of the (b * t)-row
    teacher. A last chunk of one row joins the one before it. The bounds come as host ints: reading them off the
    device index would wait for the GPU at every chunk of every TTT step's backward."""
    total = b * rows
    bounds = list(range(0, total, CUDA_CE_CHUNK_ROWS if device.type == "cuda" else CE_CHUNK_ROWS)) + [total]
    if len(bounds) > 2 and bounds[-1] - bounds[-2] == 1:
        del bounds[-2]
    out = []
    for a, e in zip(bounds, bounds[1:], strict=False):
        r = torch.arange(a, e, device=device)
        out.append((a, e, r, torch.div(r, rows, rounding_mode="floor") * t + offset + r % rows))
    return out


class _SoftCE(torch.autograd.Function):
    """sum_rows w * CE(p, softmax(z)) in row chunks: eager (CPU), no fp32 copy of the whole (rows, Vd) logits is
    alive at once; compiled (CUDA), one chunk a call (``CUDA_CE_CHUNK_ROWS``). Backward reuses the forward's
    logsumexp."""

    @staticmethod
    def forward(ctx, logits: Tensor, probs: Tensor, weight: Tensor, offset: int) -> Tensor:
        # logits (B, L, V), probs (B, T, V): logits[:, r] is scored against probs[:, offset + r]; weight (B, L)
        rows_fn, _ = _kernels(logits.device)
        b, rows, v = logits.shape
        z, p, w = logits.reshape(b * rows, v), probs.reshape(-1, v), weight.reshape(-1)
        chunks = _chunks(b, rows, probs.shape[1], offset, logits.device)
        total = logits.new_zeros((), dtype=torch.float32)
        lses = []
        for _, _, zrow, prow in chunks:
            row, lse = rows_fn(z, p, zrow, prow)
            total = total + (row * w[zrow]).sum()
            lses.append(lse)
        ctx.save_for_backward(logits, probs, weight, torch.cat(lses))
        ctx.offset = offset
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, probs, weight, lse = ctx.saved_tensors
        _, grad_fn = _kernels(logits.device)
        b, rows, v = logits.shape
        z, p, w = logits.reshape(b * rows, v), probs.reshape(-1, v), (weight * grad).reshape(-1)
        parts = [grad_fn(z, p, zrow, prow, lse[a:e], w[a:e])
                 for a, e, zrow, prow in _chunks(b, rows, probs.shape[1], ctx.offset, logits.device)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # one chunk: its gradient is the whole, uncopied
        return out.view_as(logits), None, None, None


def soft_cross_entropy(logits: Tensor, probs: Tensor, weight: Tensor, offset: int = 0) -> Tensor:
    """Weighted sum over rows of CE(probs, softmax(logits)); gradient flows to ``logits`` only. ``logits`` (B, L,
    V) row r is scored against ``probs`` (B, T, V) row offset + r (a TTT step passes the whole teacher and its
    offset, not a slice of it)."""
    return _SoftCE.apply(logits, probs.detach(), weight.detach().float(), offset)


def ttt_forward(model: Eagle3Drafter, input_ids: Tensor, aux: Tensor, sup: Supervision, ttt_length: int,
                decay: float, attn_fn: AttentionFn = attention, objective: Objective = KL,
                mass: Tensor | None = None) -> TTTResult:
    """Unroll ``ttt_length`` draft steps over right-padded rows (one sample per row, so the causal
    mask alone keeps valid queries off padding). ``mass`` (B, T): ``draft_mass``, for an LK ``objective``."""
    if objective.needs_mass and mass is None:
        raise ValueError(f"objective {objective.kind}: needs the target's mass on the draft vocab (draft_mass)")
    b, t = input_ids.shape
    dev = input_ids.device
    probs = sup.teacher_logp.exp()
    causal = causal_mask(t, 0, device=dev)  # (1, 1, T, T)
    own = torch.eye(t, dtype=torch.bool, device=dev)[None, None]
    step_mask = torch.cat([causal, own], dim=-1)  # step i > 0: step 0's prefix + its own row
    hidden = model.project_aux(aux)
    first: tuple[Tensor, Tensor] | None = None
    diag: list[tuple[Tensor, Tensor]] = []
    loss = hidden.new_zeros((), dtype=torch.float32)
    step_losses, correct, scored = [], [], []
    steps = min(ttt_length, t - 1)
    # Step i reads the embeddings of tokens 1 + i .. (zeros past the end): one window of a single projection.
    embed_all = model.embed_projections(F.pad(input_ids[:, 1:], (0, steps), value=0), hidden.dtype)
    for i in range(steps):
        positions = (torch.arange(t, device=dev) + i)[None]
        out = model.step(None, hidden, positions, past=first, mask=causal if first is None else step_mask,
                         diag=list(diag), attn_fn=attn_fn, embed_part=[p[:, i:i + t] for p in embed_all])
        if first is None:
            first = (out.k, out.v)
        else:
            diag.append((out.k, out.v))
        hidden = out.prenorm
        n = t - 1 - i  # rows with a target position j = row + 1 + i < T
        logits = model.logits(out.prenorm[:, :n])
        label = sup.label[:, 1 + i:]
        weight = (label & sup.in_vocab[:, 1 + i:]).float()
        count = weight.sum()
        ce = soft_cross_entropy(logits, probs, weight, offset=1 + i) / count.clamp(min=1)
        alpha = None
        if objective.needs_mass:  # p on the draft vocab at j = row + 1 + i: the teacher times its mass there
            p = probs[:, 1 + i:1 + i + n] * mass[:, 1 + i:1 + i + n, None]
            alpha = expected_acceptance(logits, p)
        loss = loss + decay ** i * objective.step_loss(ce, alpha, weight, count)
        step_losses.append(ce.detach())
        with torch.no_grad():
            hit = model.to_target_ids(logits.argmax(-1)) == sup.target_argmax[:, 1 + i:]
        correct.append(F.pad(hit, (0, t - n), value=False))
        scored.append(F.pad(label, (0, t - n), value=False))
    return TTTResult(loss, torch.stack(step_losses), torch.stack(correct), torch.stack(scored))

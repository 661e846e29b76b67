"""Speculative decoding for many prompts at once: the acceptance statistics of a full eval in one pass.

Acceptance (tau, alpha_k) depends only on what the drafter proposes and what the target verifies, not on
timing, so every prompt can run in one batch: each row keeps its own position in a position-indexed
cache (``engine.batched``), accepts its own number of drafts per cycle, and reads nothing that a
rejected draft left behind (keys beyond a row's committed length are overwritten before they are read).
Per row, the cycle is the one ``eval.speculative.Engine`` runs at batch size 1 (same positions, same
draft-extend from the target's aux states, same acceptance rule chosen by name through
``eval.speculative.acceptance_rule``), which a test checks token by token.
Timings, which do depend on the batch, still come from the batch-1 engine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from tqdm import tqdm

from drafter.model import Eagle3Drafter, StepOutput
from engine.attention import position_mask, position_masked_attention
from engine.batched import BatchedTarget
from engine.kv_cache import KVCache
from eval.speculative import AcceptRule, Draft, acceptance_rule, pick

# Padded prompt tokens per prefill call, on any device. Smaller than generate's
# (engine.stream_admission.GENERATE_PREFILL_TOKENS): this prefill keeps the target's aux states (3H) at every
# position and runs the drafter over the same positions.
SPECULATIVE_PREFILL_TOKENS = 32768


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)  # drafts kept per verify cycle
    first_drafts: list[int] = field(default_factory=list)  # each cycle's first draft, a target id


def cycle_starts(accepted: Sequence[int]) -> list[int]:
    """Where each verify cycle's tokens start in a row's ``tokens``, which begin with the prefill's token: cycle i
    produces ``accepted[i] + 1`` tokens from where the previous one stopped."""
    out, pos = [], 1
    for a in accepted:
        out.append(pos)
        pos += a + 1
    return out


class BatchedDrafter:
    """The drafter over a position-indexed cache of ``slots`` rows (the same layout as the target's)."""

    def __init__(self, drafter: Eagle3Drafter, slots: int, max_len: int):
        s = drafter.shape
        self.d = drafter.eval()
        p = drafter.fc.weight
        self.k = torch.zeros(slots, s.num_key_value_heads, max_len, s.head_dim, dtype=p.dtype, device=p.device)
        self.v = torch.zeros_like(self.k)
        self.scale = s.head_dim ** -0.5

    @torch.no_grad()
    def step(self, rows: slice, ids: Tensor, hidden: Tensor, positions: Tensor) -> StepOutput:
        """One decoder pass for ``ids``/``hidden`` (B, T) at ``positions``; keys land at their positions."""
        b = ids.shape[0]
        index = torch.arange(b, device=ids.device)[:, None]
        k_rows, v_rows = self.k[rows], self.v[rows]
        span = int(positions.max()) + 1
        mask = position_mask(positions, span, self.d.shape.num_attention_heads // self.d.shape.num_key_value_heads)

        def attend(q: Tensor, k: Tensor, v: Tensor, _mask: Tensor | None, _diag: Sequence) -> Tensor:
            k_rows[index, :, positions] = k.transpose(1, 2)
            v_rows[index, :, positions] = v.transpose(1, 2)
            return position_masked_attention(q, k_rows[:, :, :span], v_rows[:, :, :span], mask, self.scale)

        return self.d.step(ids, hidden, positions, attn_fn=attend)


@torch.no_grad()
def speculative_batch(target: BatchedTarget, drafter: Eagle3Drafter | None, prompts: Sequence[Sequence[int]], k: int,
                      max_new: int, stop_ids: Sequence[int], temperature: float = 0.0, seed: int = 0,
                      desc: str = "speculative", acceptance: str = "sglang") -> list[RowResult]:
    """Chain-draft ``k`` tokens per cycle for every prompt; per row, the tokens and drafts kept per cycle.

    ``target.aux_layer_ids`` must be the drafter's. At T > 0 each row draws from its own generator,
    seeded by ``seed`` and the row index, and accepts by the rule ``acceptance`` names (eval.acceptance):
    SGLang's drafts greedily, ``speculative_sampling`` samples its drafts from q.

    ``drafter`` None is the **oracle**: it proposes the target's own greedy tokens (k target steps ahead), the best
    any drafter that drafts greedily can do. At T = 0 it keeps every draft; at T > 0 under SGLang's rule a draft d
    is kept with probability p(d), so the oracle's tau is the ceiling the target's own confidence sets.
    """
    accept, sample_drafts = acceptance_rule(acceptance, temperature)
    if drafter is None and sample_drafts:
        raise ValueError(f"the oracle drafts greedily; eval.acceptance {acceptance!r} samples its drafts")
    dev, n = target.device, len(prompts)
    stops = set(stop_ids)
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    max_len = int(lens.max()) + max_new + k + 2
    cache = target.new_cache(n, max_len)
    d = drafter
    dr = BatchedDrafter(d, n, max_len) if d is not None else None
    draft_targets = d.to_target_ids(torch.arange(d.shape.draft_vocab_size, device=dev)) if d is not None else None
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(n)] if temperature > 0 else None
    results = [RowResult() for _ in range(n)]
    done = [False] * n

    def emit(i: int, toks: Sequence[int]) -> None:
        for tok in toks:
            results[i].tokens.append(tok)
            if tok in stops or len(results[i].tokens) >= max_new:
                done[i] = True
                return

    last = _prefill(target, cache, d, dr, prompts, lens, temperature, gens, emit)
    committed = lens.clone()  # target positions with a cached key and known aux: all but the newest token
    newest = torch.tensor([r.tokens[-1] for r in results], device=dev)

    bar = tqdm(total=n, initial=sum(done), desc=desc, unit=" seq")
    rows = slice(0, n)
    while not all(done):
        draft_ids, probs = _draft(target, cache, d, dr, k, newest, committed, last, temperature, sample_drafts,
                                  draft_targets, gens)
        # -- verify [newest, d1..dk] at positions committed..committed+k -------------------------------
        ids = torch.cat([newest[:, None], draft_ids], 1)
        pos = committed[:, None] + torch.arange(k + 1, device=dev)[None]
        out = target.forward(cache, rows, ids, pos, fresh=False, all_logits=True, aux=d is not None)
        accepted, nexts = _accept(accept, out.logits, draft_ids, probs, d, temperature, gens, done)
        firsts = draft_ids[:, 0].tolist()
        for i in range(n):
            if not done[i]:
                a = accepted[i]
                results[i].accepted.append(a)
                results[i].first_drafts.append(firsts[i])
                emit(i, draft_ids[i, :a].tolist() + [nexts[i]])
                if done[i]:
                    bar.update(1)
        # -- draft-extend over the accepted positions (padding rows beyond a are overwritten later) ----
        acc = torch.tensor(accepted, device=dev)
        nxt_t = torch.tensor(nexts, device=dev)
        live = torch.tensor([not x for x in done], device=dev)
        if d is not None:
            ext = torch.cat([draft_ids, draft_ids[:, -1:]], 1)
            ext[torch.arange(n, device=dev), acc] = nxt_t
            step = dr.step(rows, ext, d.project_aux(out.aux.to(d.fc.weight.dtype)), pos)
            last = torch.where(live[:, None, None], step.prenorm[torch.arange(n, device=dev), acc][:, None], last)
        committed = torch.where(live, committed + acc + 1, committed)
        newest = torch.where(live, nxt_t, newest)
    bar.close()
    return results


def _prefill(target: BatchedTarget, cache: KVCache, d: Eagle3Drafter | None, dr: BatchedDrafter | None,
             prompts: Sequence[Sequence[int]], lens: Tensor, temperature: float,
             gens: list[torch.Generator] | None, emit: Callable[[int, Sequence[int]], None]) -> Tensor | None:
    """The target over each prompt (its first answer token emitted), then the drafter over the same positions;
    returns the drafter's pre-norm hidden state at each prompt's last position (None for the oracle)."""
    dev, n = target.device, len(prompts)
    last = torch.zeros(n, 1, d.shape.hidden_size, dtype=d.fc.weight.dtype, device=dev) if d is not None else None
    for a, b in _groups([len(p) for p in prompts], SPECULATIVE_PREFILL_TOKENS):
        width = max(len(p) for p in prompts[a:b])
        ids = torch.zeros(b - a, width, dtype=torch.long, device=dev)
        for j, p in enumerate(prompts[a:b]):
            ids[j, : len(p)] = torch.tensor(p, device=dev)
        pos = torch.arange(width, device=dev)[None].expand(b - a, width)
        out = target.forward(cache, torch.arange(a, b, device=dev), ids, pos, fresh=True,
                             logits_at=lens[a:b] - 1, aux=d is not None)
        first = [pick(out.logits[j], temperature, gens[a + j] if gens else None) for j in range(b - a)]
        for j, tok in enumerate(first):
            emit(a + j, [tok])
        if d is None:
            continue
        # drafter position t reads aux(t) and token t+1: the prompt shifted by one, then the first answer token
        nxt = torch.cat([ids[:, 1:], torch.zeros(b - a, 1, dtype=torch.long, device=dev)], 1)
        nxt[torch.arange(b - a, device=dev), lens[a:b] - 1] = torch.tensor(first, device=dev)
        hid = d.project_aux(out.aux.to(d.fc.weight.dtype))
        step = dr.step(slice(a, b), nxt, hid, pos)
        last[a:b] = step.prenorm[torch.arange(b - a, device=dev), lens[a:b] - 1][:, None]
    return last


def _draft(target: BatchedTarget, cache: KVCache, d: Eagle3Drafter | None, dr: BatchedDrafter | None, k: int,
           newest: Tensor, committed: Tensor, last: Tensor | None, temperature: float, sample_drafts: bool,
           draft_targets: Tensor | None, gens: list[torch.Generator] | None) -> tuple[Tensor, list[Tensor]]:
    """``k`` drafts per row as target ids (B, k), greedy over the draft vocab (sampled from q when the rule
    samples its drafts, with q per step returned); the oracle runs the target itself ``k`` steps ahead."""
    n, rows = newest.shape[0], slice(0, newest.shape[0])
    drafts, probs, hidden = [], [], last
    for i in range(k):
        if d is None:  # the oracle: the target's own greedy next token (its keys land where verify writes them)
            prev = newest if i == 0 else drafts[-1]
            out = target.forward(cache, rows, prev[:, None], (committed + i)[:, None], fresh=False, all_logits=True)
            drafts.append(out.logits[:, -1].argmax(-1))
            continue
        if i:
            out = dr.step(rows, drafts[-1][:, None], hidden, (committed - 1 + i)[:, None])
            hidden = out.prenorm
        logits = d.logits(hidden)[:, -1].float()
        if sample_drafts:
            q = torch.softmax(logits / temperature, -1)
            choice = torch.stack([torch.multinomial(q[j].cpu(), 1, generator=gens[j]) for j in range(n)])
            probs.append(q)
            drafts.append(draft_targets[choice.squeeze(-1).to(newest.device)])
        else:
            drafts.append(draft_targets[logits.argmax(-1)])
    return torch.stack(drafts, 1), probs


def _groups(lengths: Sequence[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive index ranges whose padded size (rows x longest) stays within ``budget``: contiguous,
    unlike ``common.batching.length_batches``, because the drafter's prefill reads its cache rows in place
    (a slice)."""
    out, start, longest = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and max(longest, n) * (i - start + 1) > budget:
            out.append((start, i))
            start, longest = i, 0
        longest = max(longest, n)
    out.append((start, len(lengths)))
    return out


def _accept(accept: AcceptRule, logits: Tensor, drafts: Tensor, probs: list[Tensor], d: Eagle3Drafter | None,
            temperature: float, gens: list[torch.Generator] | None, done: list[bool]) -> tuple[list[int], list[int]]:
    """Per row: drafts kept and the target's own next token, by the batch-1 engine's rule. ``probs`` (the
    draft distributions, per step (B, draft vocab)) only when the rule samples its drafts (never the oracle's)."""
    draft_targets = (d.to_target_ids(torch.arange(d.shape.draft_vocab_size, device=logits.device)).cpu()
                     if probs else None)
    pairs = []
    for i in range(logits.shape[0]):
        if done[i]:
            pairs.append((0, 0))
            continue
        full = None
        if probs:
            full = torch.zeros(len(probs), d.shape.vocab_size)
            for j, q in enumerate(probs):
                full[j, draft_targets] = q[i].cpu()
        row = logits[i] if temperature <= 0 else logits[i].cpu()
        pairs.append(accept(row, Draft(drafts[i].tolist(), full), temperature, gens[i] if gens else None))
    return [a for a, _ in pairs], [t for _, t in pairs]

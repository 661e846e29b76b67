"""Speculative decoding with chain drafting at batch size 1, and the plain decode loop it is timed against.

The acceptance rules are plain functions with one signature, ``rule(logits (k+1, V), draft, temperature,
generator) -> (accepted, next token)``, selected by name (``acceptance_rule``), so any engine (this one, a
batched one calling them per row) verifies the same way.

Both loops share the prefill and the target's HF KV cache code. One cycle: the proposer drafts k
tokens, one target forward over ``[last emitted, d1..dk]`` verifies them, the target cache is cropped
to the accepted prefix, and the proposer re-extends its own cache over the accepted positions from the
target's aux states (SGLang's draft-extend). Positions follow ARCHITECTURE.md: drafter position t
reads the target's aux at t and token t+1, and draft step i runs at RoPE position t+i.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from drafter.model import Eagle3Drafter, causal_mask
from eval.lossless import first_divergence
from target_model.hf_model import TargetModel

__all__ = ["ACCEPTANCE_RULES", "Draft", "Eagle3Proposer", "Engine", "Generation", "accept_greedy", "accept_sampled",
           "accept_sglang", "acceptance_rule", "first_divergence"]


@dataclass
class Draft:
    tokens: list[int]  # k target ids
    probs: Tensor | None  # (k, V) draft distribution over target ids; None = deterministic proposals


class Proposer(Protocol):
    """What the engine needs from a drafter; the Eagle3 one is real, oracles plug in for tests."""

    def reset(self) -> None: ...

    def extend(self, tokens: Tensor, aux: Tensor, start: int) -> None:
        """Commit known positions start..start+m-1: aux (m, 3H) and the token after each (m,).
        Anything cached at or after ``start`` (rejected or draft-step entries) is dropped first."""

    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Draft: ...


class Eagle3Proposer:
    """Chain drafting with the EAGLE-3 drafter and its own KV cache."""

    def __init__(self, drafter: Eagle3Drafter, aux_layer_ids: Sequence[int]):
        self.drafter = drafter.eval()
        self.aux_layer_ids = list(aux_layer_ids)  # the target layers this drafter reads
        self.target_ids = drafter.to_target_ids(torch.arange(drafter.shape.draft_vocab_size,
                                                             device=drafter.d2t.device))
        self.reset()

    def reset(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.length = 0
        self.last: Tensor | None = None  # prenorm at the last committed position: the first draft step

    @torch.no_grad()
    def extend(self, tokens: Tensor, aux: Tensor, start: int) -> None:
        d = self.drafter
        if start > self.length:
            raise ValueError(f"extend at {start} leaves a gap after {self.length} cached positions")
        past = None
        if start:
            past = (self.keys[:, :, :start], self.values[:, :, :start])
        dev = d.d2t.device
        hidden = d.project_aux(aux.to(dev, d.fc.weight.dtype)[None])
        positions = torch.arange(start, start + tokens.numel(), device=dev)[None]
        out = d.step(tokens.to(dev)[None], hidden, positions, past=past,
                     mask=causal_mask(tokens.numel(), start, device=dev))
        self.keys = out.k if past is None else torch.cat([past[0], out.k], 2)
        self.values = out.v if past is None else torch.cat([past[1], out.v], 2)
        self.length = start + tokens.numel()
        self.last = out.prenorm[:, -1:]

    @torch.no_grad()
    def propose(self, k: int, temperature: float, generator: torch.Generator | None) -> Draft:
        """Draft-step entries live only in a local cache, so rejected ones need no rollback."""
        d = self.drafter
        keys, values, hidden = self.keys, self.values, self.last
        tokens: list[int] = []
        probs: list[Tensor] = []
        for i in range(k):
            if i:
                pos = torch.tensor([[self.length - 1 + i]], device=hidden.device)
                out = d.step(torch.tensor([[tokens[-1]]], device=hidden.device), hidden, pos, past=(keys, values))
                keys, values = torch.cat([keys, out.k], 2), torch.cat([values, out.v], 2)
                hidden = out.prenorm
            logits = d.logits(hidden)[0, -1].float()
            if temperature > 0:
                q = torch.softmax(logits / temperature, -1)
                draft_id = int(torch.multinomial(q.cpu(), 1, generator=generator))
                full = torch.zeros(d.shape.vocab_size, device=q.device)
                full[self.target_ids] = q  # zero probability outside the draft vocab
                probs.append(full)
            else:
                draft_id = int(logits.argmax())
            tokens.append(int(self.target_ids[draft_id]))
        return Draft(tokens, torch.stack(probs) if probs else None)


def _tokens(draft: Draft | Sequence[int]) -> list[int]:
    return list(draft.tokens if isinstance(draft, Draft) else draft)


def accept_greedy(logits: Tensor, draft: Draft | Sequence[int], temperature: float = 0.0,
                  generator: torch.Generator | None = None) -> tuple[int, int]:
    """T=0: keep the longest prefix equal to the target's argmax; the next token is the argmax after it.
    logits: (k+1, V). Returns (accepted, next token)."""
    tokens = _tokens(draft)
    greedy = logits.argmax(-1).tolist()
    a = 0
    while a < len(tokens) and tokens[a] == greedy[a]:
        a += 1
    return a, greedy[a]


def accept_sglang(logits: Tensor, draft: Draft | Sequence[int], temperature: float,
                  generator: torch.Generator | None) -> tuple[int, int]:
    """SGLang's EAGLE verify at T > 0 for a chain of greedy drafts (``--speculative-eagle-topk 1``).

    SGLang calls ``tree_speculative_sampling_target_only`` with ``draft_probs`` all zero (unless
    ``--speculative-use-rejection-sampling``); the kernel (sglang 0.5.23's
    kernels/jit/include/sgl_kernel/speculative/sampling.cuh) keeps draft i iff its coin is below p_i(d_i)
    (thresholds ``speculative_accept_threshold_single``/``_acc`` at their default 1; p = 0 never); on ROCm SGLang
    verifies greedily at any T unless rejection sampling is on. At the first rejection it writes p(d) into
    ``draft_probs[d]`` and samples from relu(p - draft_probs): p without d, renormalised; after k kept drafts, the
    bonus from p. p is softmax(logits / T) (top-k/top-p renormalised there when set; eval sets neither).
    ``draft.probs`` is not read: the drafts are the drafter's argmax.
    """
    p = torch.softmax(logits.float().cpu() / temperature, -1)  # (k+1, V)
    for i, tok in enumerate(_tokens(draft)):
        if float(torch.rand((), generator=generator)) < p[i, tok]:
            continue
        residual = p[i].clone()
        residual[tok] = 0.0
        residual = residual if residual.sum() > 0 else p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(_tokens(draft)), int(torch.multinomial(p[-1], 1, generator=generator))


def accept_sampled(logits: Tensor, draft: Draft | Sequence[int], temperature: float,
                   generator: torch.Generator | None) -> tuple[int, int]:
    """T>0 speculative sampling (Leviathan et al. / Chen et al.): keep draft d_i with probability
    min(1, p(d_i)/q(d_i)); on rejection sample the residual max(0, p - q); after k kept, the bonus from p.
    Drafts without probabilities count as deterministic (q one-hot), which makes this SGLang's rule."""
    draft = draft if isinstance(draft, Draft) else Draft(list(draft), None)
    p = torch.softmax(logits.float().cpu() / temperature, -1)  # (k+1, V)
    for i, tok in enumerate(draft.tokens):
        if draft.probs is None:
            q = torch.zeros_like(p[i])
            q[tok] = 1.0
        else:
            q = draft.probs[i].float().cpu()
        if float(torch.rand((), generator=generator)) * q[tok] < p[i, tok]:
            continue
        residual = (p[i] - q).clamp_min(0)
        residual = residual if residual.sum() > 0 else p[i]
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(draft.tokens), int(torch.multinomial(p[-1], 1, generator=generator))


AcceptRule = Callable[[Tensor, "Draft | Sequence[int]", float, "torch.Generator | None"], tuple[int, int]]
ACCEPTANCE_RULES: dict[str, AcceptRule] = {"greedy": accept_greedy, "sglang": accept_sglang,
                                           "speculative_sampling": accept_sampled}
SAMPLED_DRAFTS = frozenset({"speculative_sampling"})  # rules that need q: their proposer samples its drafts


def acceptance_rule(name: str, temperature: float) -> tuple[AcceptRule, bool]:
    """The rule for a setting and whether the proposer samples its drafts (else it drafts greedily, as SGLang's
    EAGLE worker does). At T = 0 every rule is greedy verification."""
    if name not in ACCEPTANCE_RULES:
        raise ValueError(f"eval.acceptance: unknown rule {name!r}; known: {sorted(ACCEPTANCE_RULES)}")
    if temperature <= 0:
        return accept_greedy, False
    return ACCEPTANCE_RULES[name], name in SAMPLED_DRAFTS


def top2_margin(logits: Tensor) -> float:
    """Top-1 minus top-2 logit: how far the greedy choice is from a tie."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def pick(logits: Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float().cpu() / temperature, -1), 1, generator=generator))


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions. transformers 5.x ``crop`` takes a negative count to remove
    (a positive argument, the old absolute length, raises there)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class Clock:
    """perf_counter that first waits for queued GPU work, so a phase is charged its own kernels."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class Generation:
    """One prompt's output and where its time went."""

    tokens: list[int]
    margins: list[float] = field(default_factory=list)  # plain loop: top-1 minus top-2 logit behind each token
    prefill_s: float = 0.0
    decode_s: float = 0.0  # plain loop: time of the steps after prefill
    steps: int = 0  # plain loop: tokens produced by decode steps (prefill's token excluded)
    step_s: list[float] = field(default_factory=list)  # plain loop: each decode step's seconds
    accepted: list[int] = field(default_factory=list)  # per verify cycle
    cycle_s: list[float] = field(default_factory=list)  # per verify cycle: its seconds, draft to extend
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0

    @property
    def cycle_tokens(self) -> int:
        return sum(self.accepted) + len(self.accepted)


class Engine:
    """The target with its stop tokens and aux layers; runs either loop on one tokenized prompt."""

    def __init__(self, target: TargetModel, aux_layer_ids: Sequence[int], stop_ids: Sequence[int]):
        self.target = target
        self.aux_ids = list(aux_layer_ids)  # default; a proposer with its own ``aux_layer_ids`` wins
        self.stop_ids = set(stop_ids)
        self.clock = Clock(target.device)

    def _forward(self, ids: Sequence[int], start: int, cache: Any, aux_ids: Sequence[int] | None = None):
        dev = self.target.device
        inp = torch.tensor([list(ids)], device=dev)
        pos = torch.arange(start, start + len(ids), device=dev)[None]
        return self.target.forward(inp, aux_ids or self.aux_ids, position_ids=pos, past_key_values=cache,
                                   use_cache=True)

    def _finish(self, out: list[int], new: Sequence[int], max_new: int) -> bool:
        """Append ``new`` up to the first stop token or the token budget; True when generation ends."""
        for tok in new:
            out.append(tok)
            if tok in self.stop_ids or len(out) >= max_new:
                return True
        return False

    @torch.no_grad()
    def plain(self, prompt: Sequence[int], max_new: int, temperature: float = 0.0,
              generator: torch.Generator | None = None) -> Generation:
        t0 = self.clock()
        res = self._forward(prompt, 0, None)
        cache, n = res.past_key_values, len(prompt)
        gen = Generation([])
        gen.margins.append(top2_margin(res.logits[0, -1]))
        done = self._finish(gen.tokens, [pick(res.logits[0, -1], temperature, generator)], max_new)
        t1 = last = self.clock()
        gen.prefill_s = t1 - t0
        while not done:
            res = self._forward(gen.tokens[-1:], n + len(gen.tokens) - 1, cache)
            gen.margins.append(top2_margin(res.logits[0, -1]))
            done = self._finish(gen.tokens, [pick(res.logits[0, -1], temperature, generator)], max_new)
            gen.steps += 1
            now = self.clock()
            gen.step_s.append(now - last)
            last = now
        gen.decode_s = last - t1
        return gen

    @torch.no_grad()
    def speculative(self, proposer: Proposer, prompt: Sequence[int], k: int, max_new: int,
                    temperature: float = 0.0, generator: torch.Generator | None = None,
                    acceptance: str = "sglang") -> Generation:
        """``acceptance`` names the T > 0 rule (``ACCEPTANCE_RULES``); drafts are sampled only for a rule that
        needs q, greedy otherwise."""
        accept, sample_drafts = acceptance_rule(acceptance, temperature)
        draft_temperature = temperature if sample_drafts else 0.0
        clock = self.clock
        aux_ids = getattr(proposer, "aux_layer_ids", None)
        t0 = clock()
        res = self._forward(prompt, 0, None, aux_ids)
        cache = res.past_key_values
        gen = Generation([])
        done = self._finish(gen.tokens, [pick(res.logits[0, -1], temperature, generator)], max_new)
        proposer.reset()
        if not done:
            known = torch.tensor(list(prompt[1:]) + gen.tokens[-1:])
            proposer.extend(known, res.aux[0], 0)
        gen.prefill_s = clock() - t0
        while not done:
            n_cached = len(prompt) + len(gen.tokens) - 1  # every position but the last emitted token
            t_start = clock()
            draft = proposer.propose(k, draft_temperature, generator)
            t_drafted = clock()
            res = self._forward(gen.tokens[-1:] + draft.tokens, n_cached, cache, aux_ids)
            t_verified = clock()
            a, nxt = accept(res.logits[0], draft, temperature, generator)
            gen.accepted.append(a)
            new = draft.tokens[:a] + [nxt]
            done = self._finish(gen.tokens, new, max_new)
            t_extend = clock()
            if not done:
                crop_cache(cache, n_cached + a + 1)
                proposer.extend(torch.tensor(new), res.aux[0, : a + 1], n_cached)
            t_end = clock()
            gen.draft_s += (t_drafted - t_start) + (t_end - t_extend)
            gen.verify_s += t_verified - t_drafted
            gen.overhead_s += t_extend - t_verified
            gen.cycle_s.append(t_end - t_start)
        return gen

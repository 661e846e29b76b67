"""Why real decoding accepts less than the held-out set says: teacher forcing and decoding on the same tokens.

At T = 0 lossless speculative decoding emits the target's greedy answer, so every verify cycle can be
replayed by teacher forcing: the drafter's TTT unroll (``train.ttt.ttt_forward``, the training loss's own
code) over ``[prompt, greedy answer]``, with the target's aux states from one pass over it. Cycle ``c``
starts after ``m_c`` answer tokens (``m_0 = 1``: prefill emits the first, ``m_{c+1} = m_c + a_c + 1``); its
draft ``i`` is TTT row ``P + m_c - 2`` of step ``i`` (ARCHITECTURE.md, Positions: row t of step i predicts
token t + 2 + i). If the engine feeds the drafter what training fed it, the replayed chain length equals the
accepted count of every cycle; the share that differ (``replay_agreement``) measures a train/decode mismatch.

Per dataset, with ``a_i`` chain-conditional (step i correct given steps 0..i-1 correct, the quantity decode's
alpha_i estimates):
- ``decode_alpha``: a_i of real decoding, over the cycles decoding ran;
- ``teacher_forced_acc``: a_i of teacher forcing over every position of the same greedy answers (the held-out
  set's definition, restricted to the eval's prompts and answer length);
- ``teacher_forced_acc_at_cycle_starts``: a_i of teacher forcing over the positions where cycles started.
Equal ``decode_alpha`` and ``..._at_cycle_starts`` with agreement near 1 rule out a mismatch; a gap between
``teacher_forced_acc`` and ``decode_alpha`` then comes from where cycles start (after a miss), not from the
engine; a gap between the eval's teacher-forced figures and the held-out set's comes from the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from common.config import RunConfig
from data_prep.capture import read_conversations, render_all
from data_prep.dataset import in_holdout
from drafter.model import Eagle3Drafter
from engine.batched import BatchedTarget
from eval.batched_eval import greedy_references
from eval.batched_speculative import speculative_batch
from target_model.hf_model import TargetModel, stop_token_ids
from train.ttt import supervision, ttt_forward
from train.ttt_metrics import conditional_acceptance


@dataclass
class ChainCounts:
    """Rows whose steps 0..i were all correct / rows whose steps 0..i-1 were, per step (scored rows only)."""

    steps: int
    through: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    hits: list[int] = field(default_factory=list)  # step i correct, whatever came before (held-out acc_i)
    scored: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("through", "reached", "hits", "scored"):
            setattr(self, name, [0] * self.steps)

    def add(self, correct: Tensor, scored: Tensor) -> None:
        """correct, scored: (steps, rows) bool."""
        prefix = torch.cumprod(correct.long(), 0).bool()
        before = torch.cat([torch.ones_like(prefix[:1]), prefix[:-1]])
        for i in range(self.steps):
            self.through[i] += int((prefix[i] & scored[i]).sum())
            self.reached[i] += int((before[i] & scored[i]).sum())
            self.hits[i] += int((correct[i] & scored[i]).sum())
            self.scored[i] += int(scored[i].sum())

    def conditional(self) -> list[float]:
        chain = torch.tensor([self.through, self.reached], dtype=torch.float64)
        return [round(float(a), 4) for a in conditional_acceptance(chain)]

    def unconditional(self) -> list[float]:
        return [round(h / s, 4) if s else float("nan") for h, s in zip(self.hits, self.scored, strict=True)]

    def tau(self) -> float:
        return round(float(1 + torch.cumprod(torch.tensor(self.conditional(), dtype=torch.float64), 0).sum()), 4)


@torch.no_grad()
def forced_rows(target: TargetModel, drafter: Eagle3Drafter, aux_ids: Sequence[int], ids: Sequence[int],
                loss_mask: Sequence[int], steps: int) -> tuple[Tensor, Tensor]:
    """Training's TTT unroll over one sequence, the target's aux states and argmax from one pass over it:
    (correct, scored), each (steps, T) bool. Row t of step i predicts token t + 2 + i; it is correct when the
    drafter's argmax is the target's argmax at t + 1 + i (outside the draft vocab: a miss, as in training)
    and scored when that token carries loss."""
    x = torch.tensor([list(ids)], device=target.device)
    out = target.forward(x, aux_ids)
    logits = out.logits.float()  # (1, T, V)
    draft_rows = drafter.to_target_ids(torch.arange(drafter.shape.draft_vocab_size, device=logits.device))
    teacher = torch.log_softmax(logits[..., draft_rows], -1)
    mask = torch.tensor([list(loss_mask)], device=logits.device)
    sup = supervision(teacher, logits.argmax(-1), mask, drafter.t2d.to(logits.device))
    dev, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    res = ttt_forward(drafter, x.to(dev), out.aux.to(dev, dtype), sup, steps, 1.0)
    return res.correct[:, 0].cpu(), res.scored[:, 0].cpu()


def teacher_forced(target: TargetModel, drafter: Eagle3Drafter, aux_ids: Sequence[int], prompt: Sequence[int],
                   answer: Sequence[int], steps: int) -> tuple[Tensor, Tensor]:
    """``forced_rows`` over [prompt, answer] with loss on the answer, by answer column r (the drafter row
    after answer token r): (correct, scored), each (steps, len(answer) - 1); step i of column r predicts
    ``answer[r + 1 + i]``."""
    p, n = len(prompt), len(answer)
    correct, scored = forced_rows(target, drafter, aux_ids, list(prompt) + list(answer), [0] * p + [1] * n, steps)
    cols = slice(p - 1, p - 1 + n - 1)
    return correct[:, cols], scored[:, cols]


def cycle_columns(accepted: Sequence[int]) -> list[int]:
    """Answer column of each cycle's first draft: cycle c starts after m_c tokens, at column m_c - 1."""
    cols, m = [], 1
    for a in accepted:
        cols.append(m - 1)
        m += a + 1
    return cols


def replayed_lengths(correct: Tensor, scored: Tensor, columns: Sequence[int], k: int) -> list[int | None]:
    """Teacher forcing's chain length (leading correct steps, at most k) at each column; None where the
    chain's k drafts do not all fall inside the answer (the replay cannot say what decoding saw there)."""
    out: list[int | None] = []
    for c in columns:
        if c >= correct.shape[1] or not bool(scored[:k, c].all()):
            out.append(None)
            continue
        run = 0
        while run < k and bool(correct[run, c]):
            run += 1
        out.append(run)
    return out


@dataclass
class DatasetGap:
    """The figures of one eval dataset (see the module docstring)."""

    k: int
    decode: ChainCounts = field(init=False)
    forced: ChainCounts = field(init=False)
    forced_at_starts: ChainCounts = field(init=False)
    compared: int = 0
    agreed: int = 0
    rows_skipped_diverged: int = 0  # decoded tokens differ from the greedy answer (lossless mismatch or tie)
    disagreements: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.decode, self.forced, self.forced_at_starts = ChainCounts(self.k), ChainCounts(self.k), ChainCounts(self.k)

    def add_row(self, row: int, decoded: Sequence[int], accepted: Sequence[int], greedy: Sequence[int],
                correct: Tensor, scored: Tensor) -> None:
        """One prompt: decoding's tokens and accepted counts, the greedy answer (at least as long, so the
        last cycles' drafts are covered) and teacher forcing's (correct, scored) over it."""
        k = self.k
        for a in accepted:  # decoding's own chain: steps 0..a-1 correct, step a missed (when a < k)
            self.decode.add(torch.tensor([[i < a] for i in range(k)]), torch.ones(k, 1, dtype=torch.bool))
        if list(greedy[: len(decoded)]) != list(decoded):
            self.rows_skipped_diverged += 1
            return
        inside = torch.zeros_like(scored)
        n = len(decoded)  # the eval's answer: columns whose predicted token is among the decoded ones
        for i in range(k):
            inside[i, : max(0, n - 1 - i)] = True
        self.forced.add(correct, scored & inside)
        columns = cycle_columns(accepted)
        valid = [c for c in columns if c < correct.shape[1]]
        self.forced_at_starts.add(correct[:, valid], scored[:, valid])
        for c, a, r in zip(columns, accepted, replayed_lengths(correct, scored, columns, k), strict=True):
            if r is None:
                continue
            self.compared += 1
            if r == a:
                self.agreed += 1
            elif len(self.disagreements) < 20:
                self.disagreements.append({"row": row, "column": c, "decode_accepted": a, "replayed": r})

    def summary(self) -> dict:
        return {"decode_alpha": self.decode.conditional(), "decode_tau": self.decode.tau(),
                "teacher_forced_acc": self.forced.conditional(),
                "teacher_forced_acc_unconditional": self.forced.unconditional(),
                "teacher_forced_tau": self.forced.tau(),
                "teacher_forced_acc_at_cycle_starts": self.forced_at_starts.conditional(),
                "replay_agreement": round(self.agreed / self.compared, 4) if self.compared else float("nan"),
                "cycles_compared": self.compared, "rows_skipped_diverged": self.rows_skipped_diverged,
                "disagreements": self.disagreements}


def measure_gap(target: TargetModel, drafter: Eagle3Drafter, aux_ids: Sequence[int],
                prompts: dict[str, list[list[int]]], k: int, max_new: int) -> dict[str, dict]:
    """Decode every prompt at T = 0 with the batched engine, replay each cycle by teacher forcing, and
    reduce per dataset (``DatasetGap.summary``)."""
    refs = greedy_references(target, prompts, max_new + k + 1)  # covers the last cycles' drafts
    engine, stops = BatchedTarget(target.model, aux_ids), stop_token_ids(target.tokenizer)
    out = {}
    for name, ps in prompts.items():
        rows = speculative_batch(engine, drafter, ps, k, max_new, stops, 0.0, desc=f"{name} k={k}")
        gap = DatasetGap(k)
        for i, (prompt, row, ref) in enumerate(zip(ps, rows, refs[name], strict=True)):
            correct, scored = teacher_forced(target, drafter, aux_ids, prompt, ref.tokens, k)
            gap.add_row(i, row.tokens, row.accepted, ref.tokens, correct, scored)
        out[name] = gap.summary() | {"prompts": len(ps), "k": k, "max_new_tokens": max_new}
    return out


def holdout_counts(target: TargetModel, drafter: Eagle3Drafter, aux_ids: Sequence[int], samples: Sequence,
                   steps: int) -> ChainCounts:
    """Teacher forcing over rendered training samples (``.input_ids``, ``.loss_mask``; rendered with
    ``max_answer_tokens`` for an answer's first tokens only, what an eval of that length decodes)."""
    counts = ChainCounts(steps)
    for s in samples:
        correct, scored = forced_rows(target, drafter, aux_ids, s.input_ids, s.loss_mask, steps)
        counts.add(correct, scored)
    return counts


def holdout_figures(cfg: RunConfig, target: TargetModel, drafter: Eagle3Drafter, aux_ids: Sequence[int],
                    conversations: Path, limit: int, k: int, first: int) -> dict:
    """Teacher forcing over the held-out split of ``conversations`` (at most ``limit``): whole answers, and their
    first ``first`` tokens (capture.max_length, the template kwargs and the split from ``cfg``)."""
    convs = read_conversations(conversations)
    out: dict = {"conversations": str(conversations)}
    for key, cap in (("", None), (f"_first{first}", first)):
        samples, _ = render_all(convs, target.tokenizer, cfg.capture.max_length, cfg.target.chat_template_kwargs,
                                max_answer_tokens=cap)
        held = [s for s in samples if in_holdout(s.id, cfg.train.holdout_fraction)][:limit]
        counts = holdout_counts(target, drafter, aux_ids, held, k)
        out["samples"] = len(held)
        out[f"acc{key}"], out[f"acc_chain{key}"] = counts.unconditional(), counts.conditional()
    return out


def cause(per_dataset: dict[str, dict], holdout_acc0: float | None, holdout_acc0_first: float | None,
          loopy_acc0: float | None = None) -> str:
    """The diagnosis in one sentence, from the figures (never a fixed text)."""
    agree = min(d["replay_agreement"] for d in per_dataset.values())
    cycles = sum(d["cycles_compared"] for d in per_dataset.values())
    parts = []
    if agree < 0.98:
        parts.append(f"train/decode mismatch: decoding replays teacher forcing in only {agree:.1%} of cycles "
                     f"(worst dataset; {cycles} compared)")
    else:
        parts.append(f"no train/decode mismatch: decoding replays teacher forcing in >= {agree:.1%} of {cycles} "
                     "cycles")
    for name, d in per_dataset.items():
        parts.append(f"{name}: decode alpha_0 {d['decode_alpha'][0]:.3f}, teacher-forced at cycle starts "
                     f"{d['teacher_forced_acc_at_cycle_starts'][0]:.3f}, teacher-forced over all answer positions "
                     f"{d['teacher_forced_acc'][0]:.3f}")
    if holdout_acc0 is not None and holdout_acc0_first is not None:
        decode0 = min(d["decode_alpha"][0] for d in per_dataset.values())
        parts.append(f"held-out acc_0 {holdout_acc0:.3f} over whole answers, {holdout_acc0_first:.3f} over their "
                     f"first tokens, {holdout_acc0_first - decode0:+.3f} from decoding's lowest alpha_0"
                     + (": what separates them is the data (held-out answers are not eval answers), not the engine"
                        if agree >= 0.98 else ""))
    if loopy_acc0 is not None:
        parts.append(f"held-out acc_0 {loopy_acc0:.3f} on answers regenerated without loop stops (their loop tails "
                     "are easy tokens)")
    return "; ".join(parts)

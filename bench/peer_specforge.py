"""SpecForge 0.2.0's EAGLE-3 trainer fed the batches our loop trains on, so that a τ difference is the trainer's.

Its own pieces, unmodified, from the ``specforge`` wheel (its EAGLE-3 path imports no sglang): the draft model
(``AutoDraftModel`` -> ``LlamaForCausalLMEagle3``), the TTT wrapper (``OnlineEagle3Model``), the step
(``Eagle3TrainStrategy``: its frozen ``TargetHead`` re-projects the target's last hidden state, its loss and decay)
and ``BF16Optimizer`` (fp32 master AdamW, clipping, warm-up + cosine). What it is fed is ours: the online target's
forward over exactly the samples, order and padding of ``python -m train`` with the same config (the same sampler,
seed and epochs), our vocab map, and the same number of optimizer steps.

Two recipes (``RECIPES``):
- ``ours``: our recipe on SpecForge's step: the initial weights our trainer starts from (``drafter.init``), our lr,
  warm-up and clip, and the loss mask aligned as ours is (below). The only difference left is the trainer.
- ``shipped``: SpecForge as it ships: its random init (the target's embedding only), lr 1e-4, warm-up 1.5 %, and
  its loss mask. SpecForge shifts the inputs and targets by one (``TargetHead.preprocess``) but not the mask, so
  row t (embedding of token t+1, teacher predicting token t+2) is supervised when token t is answer text; ours
  supervises it when token t+2 is (train/ttt.py). ``ours`` passes the mask shifted left by two, which makes
  SpecForge's position mask equal to ours row for row (tests/test_bench_peer_specforge.py checks it).

The trained draft model's state dict has SGLang's names, as ours does: it is saved through
``drafter.sglang_checkpoint.save_checkpoint`` and measured exactly like our drafter.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from common.config import RunConfig
from data_prep.dataset import TokenBudgetSampler
from drafter.model import Eagle3Drafter
from drafter.sglang_checkpoint import expected_tensors, hf_config, save_checkpoint
from train.build import build_drafter
from train.data import TrainingData, to_device, training_data
from train.loop import pad_multiple

MASK_SHIFT = 2  # our row t is supervised by loss_mask[t + 2]; SpecForge's by loss_mask[t]


@dataclass(frozen=True)
class Recipe:
    """What differs between SpecForge's recipe and ours, besides the trainer."""

    init_from_ours: bool  # start from our initial drafter (else SpecForge's random init, the target's embedding)
    lr: float | None  # None: the run config's train.lr
    warmup_ratio: float | None  # None: the run config's train.warmup_ratio
    align_mask: bool  # supervise the rows ours does (else SpecForge's own mask offset)


RECIPES = {"ours": Recipe(True, None, None, True), "shipped": Recipe(False, 1e-4, 0.015, False)}


def specforge_draft(drafter: Eagle3Drafter, init_from_ours: bool, attention_backend: str) -> nn.Module:
    """SpecForge's ``LlamaForCausalLMEagle3`` of ``drafter``'s shape (its config is the SGLang config.json ours
    writes), on ``drafter``'s device in bf16, with ``drafter``'s vocab map and frozen embedding, and all of its
    weights when ``init_from_ours``."""
    from specforge.modeling.auto import AutoDraftModel
    from transformers import LlamaConfig

    cfg = LlamaConfig(**hf_config(drafter.shape, getattr(drafter, "hf_config_extra", None)))
    cfg.target_hidden_size = drafter.shape.hidden_size
    cfg.pretraining_tp = 1
    device = drafter.fc.weight.device
    with torch.device(device):
        draft = AutoDraftModel.from_config(cfg, attention_backend=attention_backend, torch_dtype=torch.bfloat16)
    names = list(expected_tensors(drafter.shape)) + ["embed_tokens.weight"]
    ours = {**drafter.state_dict(), "fc.weight": drafter.servable_fc_weight()}
    take = names if init_from_ours else ["embed_tokens.weight", "d2t", "t2d"]
    own = draft.state_dict()
    with torch.no_grad():
        for name in take:
            own[name].copy_(ours[name].to(own[name].dtype))
    draft.freeze_embedding()
    return draft.to(device)


def back_to_ours(draft: nn.Module, like: Eagle3Drafter) -> Eagle3Drafter:
    """``draft``'s weights in a copy of ``like`` (our class, which the checkpoint writer and eval take): every
    tensor SGLang reads is copied, none is left as it was."""
    out = Eagle3Drafter(like.shape)
    out.set_embeddings(like.embed_tokens.weight.detach().cpu().float())
    state = draft.state_dict()
    with torch.no_grad():
        for name in expected_tensors(like.shape):
            out.state_dict()[name].copy_(state[name].detach().cpu())
    return out


def aligned_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """The loss mask that makes SpecForge supervise row t when token t+2 is answer text, as ours does."""
    return F.pad(loss_mask[:, MASK_SHIFT:], (0, MASK_SHIFT))


def train_batch(batch: dict[str, torch.Tensor], attention_mask: torch.Tensor, align_mask: bool) -> Any:
    """Our online batch (``TrainingData.complete``'s dict) as SpecForge's offline ``TrainBatch``: the aux states
    are its ``hidden_state``, the target's last hidden state its ``target`` (its TargetHead projects it)."""
    from specforge.runtime.contracts import TrainBatch

    mask = batch["loss_mask"].long()
    tensors = {"input_ids": batch["input_ids"].long(), "attention_mask": attention_mask.long(),
               "loss_mask": aligned_mask(mask) if align_mask else mask,
               "hidden_state": batch["aux"].to(torch.bfloat16), "target": batch["last_hidden"].to(torch.bfloat16)}
    return TrainBatch(sample_ids=[str(i) for i in range(mask.shape[0])], strategy="eagle3", tensors=tensors,
                      metadata={"target_repr": "hidden_state"})


def target_head(lm_head: torch.Tensor, device: torch.device, config_dir: Path) -> nn.Module:
    """SpecForge's frozen ``TargetHead`` over the target's lm_head (it reads only hidden and vocab sizes from the
    config file it is given)."""
    from specforge.modeling.target.target_head import TargetHead

    config_dir.mkdir(parents=True, exist_ok=True)
    vocab, hidden = lm_head.shape
    (config_dir / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden,
                                                        "vocab_size": vocab}))
    head = TargetHead(str(config_dir))
    with torch.no_grad():
        head.fc.weight.copy_(lm_head)
    head.freeze_weights()
    return head.eval().to(device=device, dtype=torch.bfloat16)


def our_batches(cfg: RunConfig, data: TrainingData, device: torch.device) -> tuple[int, Iterator[tuple[dict, dict]]]:
    """(total optimizer steps, the micro-batches in the order ``python -m train`` takes them on one process):
    the same sampler, seed, epoch shuffles and padding as train/loop.py's ``setup`` and ``train_steps``."""
    t = cfg.train
    sampler = TokenBudgetSampler(data.train.lengths, t.batch_tokens, shuffle=True, seed=t.seed)
    per_epoch = len(sampler) // t.grad_accum
    total = int(min(t.max_steps or math.inf, t.epochs * per_epoch))

    def gen() -> Iterator[tuple[dict, dict]]:
        for epoch in range(math.ceil(total / per_epoch)):
            sampler.set_epoch(epoch)
            batches = sampler.batches()[: per_epoch * t.grad_accum]
            for raw in data.loader(data.train, batches, device, pad_multiple(device)):
                moved = to_device(raw, device)
                yield moved, data.complete(moved)

    return total, gen()


def loss_tenths(losses: list[float]) -> dict[str, float | None]:
    """The mean loss over the first and the last tenth of the steps: one step's loss swings several-fold with its
    batch, so a single first and last step's say nothing of whether the row learned. The two trainers' losses are
    defined differently: compare within a row."""
    n = max(1, len(losses) // 10)
    return {"loss_first_tenth": sum(losses[:n]) / n if losses else None,
            "loss_last_tenth": sum(losses[-n:]) / n if losses else None}


def train(cfg: RunConfig, recipe: Recipe, out_dir: Path, device: torch.device) -> dict[str, Any]:
    """Train with SpecForge's step on our batches for as many optimizer steps as ``python -m train`` takes with
    ``cfg``, save the drafter at ``out_dir``, and return what was done (steps, tokens seen, the mean losses of the
    first and last tenth of the steps, seconds)."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.optimizer import BF16Optimizer
    from specforge.training.strategies.base import Eagle3TrainStrategy

    torch.manual_seed(cfg.train.seed)
    data = training_data(cfg, device)
    initial, how = build_drafter(cfg, data)  # what ours starts from: the same vocab map, and its init
    initial = initial.to(device)
    backend = "flex_attention" if device.type == "cuda" else "sdpa"
    draft = specforge_draft(initial, recipe.init_from_ours, backend)
    model = OnlineEagle3Model(draft_model=draft, length=cfg.train.ttt_length, attention_backend=backend)
    strategy = Eagle3TrainStrategy(model, target_head=target_head(data.head["lm_head.weight"], device,
                                                                  out_dir.with_name(out_dir.name + "-head")),
                                   ploss_decay=cfg.train.loss_decay)
    total, batches = our_batches(cfg, data, device)
    lr = recipe.lr if recipe.lr is not None else cfg.train.lr
    warmup = recipe.warmup_ratio if recipe.warmup_ratio is not None else cfg.train.warmup_ratio
    opt = BF16Optimizer(draft, lr=lr, weight_decay=cfg.train.weight_decay, max_grad_norm=cfg.train.max_grad_norm,
                        total_steps=total, warmup_ratio=warmup, lr_scheduler="cosine")
    accum, steps, micro, tokens, losses = cfg.train.grad_accum, 0, 0, 0, []
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="specforge", unit="step")
    for moved, batch in batches:
        out = strategy.forward_loss(train_batch(batch, moved["attention_mask"], recipe.align_mask))
        (out.loss / accum).backward()
        tokens += int(moved["attention_mask"].sum())
        micro += 1
        if micro % accum:
            continue
        opt.step()
        steps += 1
        losses.append(float(out.loss.detach()))
        bar.update(1)
        if steps >= total:
            break
    bar.close()
    save_checkpoint(back_to_ours(draft, initial), out_dir)
    return {"steps": steps, "tokens_seen": tokens, "initial": how if recipe.init_from_ours else "SpecForge's random "
            "init (the target's embedding, our vocab map)", "lr": lr, "warmup_ratio": warmup,
            "mask": "aligned with ours" if recipe.align_mask else "SpecForge's (unshifted)",
            **loss_tenths(losses),
            "train_s": round(time.perf_counter() - t0, 1), "attention_backend": backend}

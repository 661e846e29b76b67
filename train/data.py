"""Where training batches come from: the capture store (``train.source: store``), or conversations.jsonl
with the target run on the training GPU for every batch (``train.source: online``).

Online training has no store and so no disk ceiling: the store costs 8·H bytes a token (4.6 KB for
SmolLM2, 57 KB for K2.5), the conversations about 4. Both sources render the same samples in the same
order (capture's ``render_all``) and split them by the same id hash, so the token-budget sampler forms
the same batches and the TTT loss sees the same tokens; online, the aux states, final hidden state and
greedy token come from a target forward over the padded batch, exactly the forward capture runs
(``TargetModel.forward``), instead of from the shards. Keep the store for targets too large to share
the GPUs with training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from common.cli import own_process_group
from common.config import RunConfig
from data_prep.capture import LeftOut, end_of_turn_rule, read_conversations, render_all, teacher_signal
from data_prep.dataset import ShardDataset, collate, in_holdout
from data_prep.store import StoreError, load_target_head, read_manifest, token_counts
from drafter.factory import drafter_aux_ids
from target_model.aux_layers import resolve_aux_layer_ids
from target_model.hf_model import load_target_from_config

# Per-token batch tensors the model takes, and the attention mask an online batch gives the target.
BATCH_KEYS = ("input_ids", "loss_mask", "aux", "target_argmax", "last_hidden", "topk_ids", "topk_logprobs")
MOVED_KEYS = (*BATCH_KEYS, "attention_mask")


class SampleDataset(Dataset):
    """Rendered samples held in memory, items shaped like ``ShardDataset``'s (int32 ids, uint8 mask)."""

    def __init__(self, samples: list[Any]):
        self.samples = samples
        self.lengths = [len(s.input_ids) for s in samples]
        self.ids = [s.id for s in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def head(self, n: int) -> SampleDataset:
        return SampleDataset(self.samples[:n])

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.samples[i]
        return {"input_ids": torch.tensor(s.input_ids, dtype=torch.int32),
                "loss_mask": torch.tensor(s.loss_mask, dtype=torch.uint8), "id": s.id}


@dataclass
class TrainingData:
    """Everything the loop needs to know about its data, whichever the source."""

    source: str  # what to print: "store <dir>" | "online from <conversations.jsonl>"
    train: Dataset
    holdout: Dataset
    target: dict[str, Any]  # name, fingerprint, num_layers, hidden_size, vocab_size
    aux_layer_ids: tuple[int, int, int]
    teacher: str  # "hidden" | "topk"
    head: dict[str, Tensor]  # the target's embed_tokens.weight and lm_head.weight
    token_counts: Callable[[int], Tensor]  # vocab_size -> counts of input ids at loss positions
    complete: Callable[[dict[str, Tensor]], dict[str, Tensor]]  # a batch on the device -> the model's inputs
    left_out: LeftOut  # what rendering skipped and cut (online: this run's; store: capture's, from the manifest)

    def loader(self, ds: Dataset, batches: list[list[int]], device: torch.device, pad_to_multiple: int) -> DataLoader:
        """Collated batches in ``batches`` order, prepared ahead in worker processes and pinned on a GPU, so
        reading and padding overlap the step. The workers sit in a process group of their own: a SIGTERM to the
        trainer's group (``timeout``'s) leaves them reading while the trainer finishes its step and saves."""
        cuda = device.type == "cuda"
        return DataLoader(ds, batch_sampler=batches, num_workers=2 if cuda else 0, pin_memory=cuda,
                          prefetch_factor=4 if cuda else None, collate_fn=_Collate(pad_to_multiple),
                          worker_init_fn=own_process_group if cuda else None)


class _Collate:
    """Picklable collate for DataLoader workers."""

    def __init__(self, pad_to_multiple: int):
        self.pad_to_multiple = pad_to_multiple

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        return collate(samples, pad_to_multiple=self.pad_to_multiple)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Tensor]:
    return {k: batch[k].to(device, non_blocking=True) for k in MOVED_KEYS if k in batch}


def _model_inputs(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in batch.items() if k in BATCH_KEYS}


def store_data(cfg: RunConfig) -> TrainingData:
    """The capture store under run_dir/store."""
    store, frac = cfg.store_dir, cfg.train.holdout_fraction
    manifest = read_manifest(store)
    cap = manifest.get("max_answer_tokens")  # absent: a store without the key, read as no cap
    if cap != cfg.train.max_answer_tokens:
        raise StoreError(f"{store}: captured with train.max_answer_tokens={cap}, the config says "
                         f"{cfg.train.max_answer_tokens}; rerun `python -m data_prep capture` (it rewrites the shards "
                         "whose loss mask changes) or set train.max_answer_tokens back"
                         + (" (capture.backend specforge keeps SpecForge's loss mask: no cap)" if
                            cfg.capture.backend == "specforge" else ""))
    rule, wanted = manifest.get("end_of_turn_loss"), end_of_turn_rule(cfg.capture.backend)
    if rule != wanted:  # absent: captured when every answer's end-of-turn marker carried loss, cut ones too
        was = ("before cut answers (finish reason length, loop) lost the loss on their end-of-turn marker"
               if rule is None else f"with end_of_turn_loss {rule}")
        raise StoreError(f"{store}: captured {was}, capture.backend {cfg.capture.backend} wants {wanted}; rerun "
                         "`python -m data_prep capture` (it rewrites the shards whose loss mask changes)")
    return TrainingData(
        source=f"store {store}", train=ShardDataset(store, "train", frac), holdout=ShardDataset(store, "holdout", frac),
        target=manifest["target"], aux_layer_ids=tuple(manifest["aux_layer_ids"]), teacher=manifest["teacher"],
        head=load_target_head(store), token_counts=lambda vocab: token_counts(store, vocab),
        complete=_model_inputs, left_out=LeftOut.from_dict(manifest))


def online_data(cfg: RunConfig, device: torch.device) -> TrainingData:
    """conversations.jsonl rendered as capture renders it, and the target loaded on ``device``."""
    target = load_target_from_config(cfg.target.model_copy(update={"device": str(device)}))
    aux_ids = resolve_aux_layer_ids(cfg.target.aux_layer_ids,
                                    drafter_aux_ids(cfg.drafter.init_from, target.num_layers), target.num_layers)
    samples, left_out = render_all(read_conversations(cfg.conversations_path), target.tokenizer,
                                   cfg.capture.max_length, cfg.target.chat_template_kwargs,
                                   max_answer_tokens=cfg.train.max_answer_tokens)
    frac = cfg.train.holdout_fraction
    split = [in_holdout(s.id, frac) for s in samples]
    head = {"embed_tokens.weight": target.embed_weight().detach(), "lm_head.weight": target.lm_head_weight().detach()}
    lm_head = head["lm_head.weight"]

    def counts(vocab: int) -> Tensor:
        out = torch.zeros(vocab, dtype=torch.int64)
        for s in samples:
            ids, mask = torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool)
            out += torch.bincount(ids[mask], minlength=vocab)[:vocab]
        return out

    def complete(batch: dict[str, Tensor]) -> dict[str, Tensor]:
        ids = batch["input_ids"]
        out = target.forward_right_padded(ids, aux_ids)
        b, t, h = out.last_hidden.shape
        greedy = teacher_signal(out.last_hidden.reshape(b * t, h), lm_head, "hidden", 0)["target_argmax"]
        return {"input_ids": ids, "loss_mask": batch["loss_mask"], "aux": out.aux, "last_hidden": out.last_hidden,
                "target_argmax": greedy.reshape(b, t)}

    info = {"name": target.name, "fingerprint": target.fingerprint(), "num_layers": target.num_layers,
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size}
    unlocated = sum(s.unlocated_ends for s in samples)
    note = f" ({unlocated} cut answers keep the loss on their end-of-turn marker: text end not found)"
    return TrainingData(
        source=f"online from {cfg.conversations_path}" + (note if unlocated else ""),
        train=SampleDataset([s for s, h in zip(samples, split, strict=True) if not h]),
        holdout=SampleDataset([s for s, h in zip(samples, split, strict=True) if h]),
        target=info, aux_layer_ids=aux_ids, teacher="hidden", head=head, token_counts=counts, complete=complete,
        left_out=left_out)


def training_data(cfg: RunConfig, device: torch.device) -> TrainingData:
    data = online_data(cfg, device) if cfg.train.source == "online" else store_data(cfg)
    n = cfg.train.max_train_samples
    if n is not None and n < len(data.train):
        data.train = data.train.head(n)
        data.source += f" (first {n} training samples)"
    return data

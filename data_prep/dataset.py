"""Reading the store back for training: a lazy per-sample Dataset, a token-budget batch sampler, collate.

Shards are opened with ``safe_open`` (memory-mapped) and each sample is a slice between two offsets,
so a store far larger than RAM trains fine. Batches group samples of similar length (sorted within a
shuffled window) under a padded-token budget, which keeps padding small without packing across
sample boundaries (packing would need a block-diagonal mask in the drafter's TTT attention).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch.utils.data import Dataset, Sampler

from common.batching import length_batches
from data_prep.id_hash import ID_HASH_RANGE, id_hash
from data_prep.store import StoreError, read_manifest, verify_store

PER_TOKEN = ("input_ids", "loss_mask", "aux", "target_argmax", "last_hidden", "topk_ids", "topk_logprobs")
SPLITS = (None, "train", "holdout")


def in_holdout(sample_id: str, fraction: float) -> bool:
    """Stable split by id hash: a sample stays on its side when the store grows."""
    return id_hash(sample_id) / ID_HASH_RANGE < fraction


class ShardDataset(Dataset):
    """Samples of a complete store; ``split`` None = all, 'train' / 'holdout' by ``holdout_fraction``.
    Every shard is checked against the manifest's sha256 first (``verify_store``, cached)."""

    def __init__(self, store_dir: str | Path, split: str | None = None, holdout_fraction: float = 0.05):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.store = Path(store_dir)
        self.manifest = read_manifest(self.store)
        verify_store(self.store, self.manifest)
        self._files: list[Any] = [None] * len(self.manifest["shards"])
        self.index: list[tuple[int, int, int]] = []  # (shard, token start, token end)
        self.ids: list[str] = []
        for k in range(len(self.manifest["shards"])):
            f = self._file(k)
            try:
                offsets = f.get_tensor("offsets").tolist()
                ids = json.loads(f.metadata()["ids"])
            except (SafetensorError, ValueError, KeyError, TypeError) as e:
                raise StoreError(f"{self.store / self.manifest['shards'][k]['file']}: not a shard of this store "
                                 f"({type(e).__name__}: {e}); rerun `python -m data_prep capture`") from None
            for j, sid in enumerate(ids):
                if split is None or in_holdout(sid, holdout_fraction) == (split == "holdout"):
                    self.index.append((k, offsets[j], offsets[j + 1]))
                    self.ids.append(sid)
        self.lengths = [e - b for _, b, e in self.index]
        self.keys = [k for k in PER_TOKEN if k in self._file(0).keys()] if self._files else []

    def head(self, n: int) -> ShardDataset:
        """The first ``n`` samples (same files, same order)."""
        out = copy.copy(self)
        out.index, out.ids, out.lengths = self.index[:n], self.ids[:n], self.lengths[:n]
        return out

    def _file(self, k: int) -> Any:
        if self._files[k] is None:  # opened lazily: DataLoader workers each open their own handles
            path = self.store / self.manifest["shards"][k]["file"]
            try:
                self._files[k] = safe_open(str(path), framework="pt")
            except SafetensorError as e:
                raise StoreError(f"{path}: unreadable safetensors file ({e}); rerun `python -m data_prep capture`") \
                    from None
        return self._files[k]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": [None] * len(self._files)}

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, Any]:
        k, b, e = self.index[i]
        f = self._file(k)
        out: dict[str, Any] = {key: f.get_slice(key)[b:e] for key in self.keys}
        out["id"] = self.ids[i]
        return out


@dataclass(frozen=True)
class LeftOutBatches:
    """The batches of an epoch that no process reads, of the ``formed`` ones, and their samples and (unpadded)
    tokens, so a summary can say what they hold."""

    batches: int
    samples: int
    tokens: int
    formed: int

    @classmethod
    def of(cls, batches: Sequence[Sequence[int]], lengths: Sequence[int], formed: int) -> LeftOutBatches:
        return cls(len(batches), sum(map(len, batches)), sum(lengths[i] for b in batches for i in b), formed)

    def __str__(self) -> str:
        return f"{self.batches} of {self.formed} batches: {self.samples} samples, {self.tokens} tokens"


class TokenBudgetSampler(Sampler[list[int]]):
    """Batches of indices whose padded size (n * longest) stays within ``batch_tokens``.

    Shuffled each epoch (``set_epoch``), sorted by length within windows of ``window`` samples so that
    neighbours have similar lengths; a sample longer than the budget is a batch of its own. With
    ``num_replicas`` > 1 each rank takes every n-th batch (all ranks get the same count: the last
    ``len % num_replicas`` batches of the epoch go to none; ``left_out`` says which).
    """

    def __init__(self, lengths: list[int], batch_tokens: int, shuffle: bool = True, seed: int = 0,
                 window: int = 1024, num_replicas: int = 1, rank: int = 0):
        self.lengths, self.batch_tokens, self.shuffle, self.seed = lengths, batch_tokens, shuffle, seed
        self.window, self.num_replicas, self.rank, self.epoch = window, num_replicas, rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _epoch_batches(self) -> list[list[int]]:
        """Every batch of the epoch, in order, before the ranks share them out."""
        order = list(range(len(self.lengths)))
        rng = random.Random(self.seed + self.epoch)
        if self.shuffle:
            rng.shuffle(order)
        out: list[list[int]] = []
        for w in range(0, len(order), self.window):
            out += length_batches(self.lengths, self.batch_tokens, order[w:w + self.window])
        if self.shuffle:
            rng.shuffle(out)
        return out

    def batches(self) -> list[list[int]]:
        out = self._epoch_batches()
        return out[self.rank:len(out) - len(out) % self.num_replicas:self.num_replicas]

    def left_out(self, per_process: int | None = None) -> LeftOutBatches:
        """The epoch's batches no process reads: those past an even share among the processes and, when each
        process reads only its first ``per_process`` batches (training: whole accumulation windows), those after
        them. Rank r reads batches r, r + n, ..., so together the processes read a prefix of the epoch's."""
        out = self._epoch_batches()
        read = len(out) - len(out) % self.num_replicas
        if per_process is not None:
            read = min(read, per_process * self.num_replicas)
        return LeftOutBatches.of(out[read:], self.lengths, len(out))

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.batches())


def collate(samples: list[dict[str, Any]], pad_id: int = 0, pad_to_multiple: int = 1) -> dict[str, Any]:
    """Right-pad to the longest sample, rounded up to ``pad_to_multiple`` (compiled GPU kernels such as
    flex_attention recompile for every new length; rounding makes lengths repeat). ``attention_mask``
    marks real tokens, ``loss_mask`` is 0 on padding."""
    longest = max(len(s["input_ids"]) for s in samples)
    longest = -(-longest // pad_to_multiple) * pad_to_multiple
    out: dict[str, Any] = {"ids": [s["id"] for s in samples]}
    for key in [k for k in PER_TOKEN if k in samples[0]]:
        first = samples[0][key]
        dtype = torch.long if key in ("input_ids", "target_argmax", "topk_ids") else first.dtype
        dtype = torch.bool if key == "loss_mask" else dtype
        batch = torch.full((len(samples), longest, *first.shape[1:]), pad_id if key == "input_ids" else 0,
                           dtype=dtype)
        for i, s in enumerate(samples):
            batch[i, : len(s[key])] = s[key].to(dtype)
        out[key] = batch
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    out["attention_mask"] = torch.arange(longest)[None, :] < lengths[:, None]
    return out

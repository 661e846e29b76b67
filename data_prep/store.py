"""The capture store on disk: shard files, the manifest and the target head (format in ARCHITECTURE.md).

Shards are plain safetensors files so that readers can memory-map them with ``safe_open``. They are
written by ``ShardWriter`` straight into a preallocated temp file, one batch at a time, so capture
needs RAM for one batch rather than one shard (a shard of a 7168-wide target is tens of GB).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from common.files import sha256_file, temp_path

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TARGET_HEAD = "target_head.safetensors"
ST_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float32: "F32",
             torch.bfloat16: "BF16", torch.float16: "F16"}
# The keys a manifest must carry, and those that must equal the current run's to reuse its shards.
REQUIRED = ("schema_version", "target", "aux_layer_ids", "teacher", "topk", "dtypes", "max_length", "shards",
            "totals", "complete")
IDENTITY = ("schema_version", "target", "aux_layer_ids", "teacher", "topk", "dtypes")


class StoreError(ValueError):
    """A store that cannot be used as is; the message says what to do."""


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


class ShardWriter:
    """Preallocates a safetensors file for known shapes, takes row ranges, renames into place on finish."""

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        self.path, self.tmp = path, temp_path(path)
        # Wider dtypes first keeps every tensor aligned to its itemsize.
        order = sorted(specs, key=lambda n: (-specs[n][0].itemsize, n))
        header: dict[str, Any] = {"__metadata__": metadata}
        self.layout: dict[str, tuple[int, int]] = {}  # name -> (byte start in data, bytes per row)
        pos = 0
        for name in order:
            dtype, shape = specs[name]
            nbytes = dtype.itemsize
            for d in shape:
                nbytes *= d
            header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
            self.layout[name] = (pos, nbytes // shape[0] if shape[0] else 0)
            pos += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.data_start = 8 + len(raw)
        self.file = open(self.tmp, "wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)
        self.file.truncate(self.data_start + pos)

    def write(self, name: str, row: int, tensor: torch.Tensor) -> None:
        start, row_bytes = self.layout[name]
        self.file.seek(self.data_start + start + row * row_bytes)
        self.file.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())

    def finish(self) -> str:
        """fsync, rename into place; returns the file's sha256."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        digest = sha256_file(self.tmp)
        os.replace(self.tmp, self.path)
        return digest

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def read_manifest(store_dir: str | Path, require_complete: bool = True) -> dict[str, Any]:
    """The manifest, checked for its keys, schema version and shard files (not their checksums)."""
    store = Path(store_dir)
    path = store / MANIFEST
    if not path.is_file():
        raise StoreError(f"{path}: no manifest; run `python -m data_prep capture` first")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); delete {store} and capture again") from None
    missing = [k for k in REQUIRED if k not in m]
    if missing:
        raise StoreError(f"{path}: missing keys {missing}; delete {store} and capture again")
    if m["schema_version"] != SCHEMA_VERSION:
        raise StoreError(f"{path}: schema_version {m['schema_version']}, this code reads {SCHEMA_VERSION}; "
                         f"delete {store} and capture again")
    if require_complete and not m["complete"]:
        raise StoreError(f"{path}: capture did not finish; rerun `python -m data_prep capture` (it resumes)")
    absent = [s["file"] for s in m["shards"] if not (store / s["file"]).is_file()]
    if absent:
        raise StoreError(f"{path}: shard files missing: {absent[:3]}; rerun capture to rewrite them")
    return m


def load_target_head(store_dir: str | Path) -> dict[str, torch.Tensor]:
    """``{"embed_tokens.weight", "lm_head.weight"}`` of the target: training needs no target model."""
    path = Path(store_dir) / TARGET_HEAD
    if not path.is_file():
        raise StoreError(f"{path}: missing; rerun `python -m data_prep capture`")
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def token_counts(store_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """How often each target id is an input token at a loss-masked position (int64, ``vocab_size``)."""
    store = Path(store_dir)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in read_manifest(store)["shards"]:
        with safe_open(str(store / s["file"]), framework="pt") as f:
            ids = f.get_tensor("input_ids").long()
            keep = f.get_tensor("loss_mask").bool()
        counts += torch.bincount(ids[keep], minlength=vocab_size)[:vocab_size]
    return counts

"""The capture store on disk: shard files, the manifest and the target head (format in ARCHITECTURE.md).

Shards are plain safetensors files so that readers can memory-map them with ``safe_open``. They are
written by ``ShardWriter`` straight into a preallocated temp file, one batch at a time, so capture
needs RAM for one batch rather than one shard (a shard of a 7168-wide target is tens of GB).

Readers trust no file blindly: ``verify_store`` checks every shard's (and the target head's) sha256
against the manifest before first use, and remembers what it verified in ``.verified.json`` (by size
and mtime) so that later epochs, ranks and restarts do not hash terabytes again.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from common.files import named_errors, read_json_object, sha256_file, temp_path, write_json_atomic

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TARGET_HEAD = "target_head.safetensors"
ST_DTYPES = {torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float32: "F32",
             torch.bfloat16: "BF16", torch.float16: "F16"}
# The keys a manifest must carry, and those that must equal the current run's to reuse its shards.
REQUIRED = ("schema_version", "target", "aux_layer_ids", "teacher", "topk", "dtypes", "max_length", "shards",
            "totals", "complete")
IDENTITY = ("schema_version", "target", "aux_layer_ids", "teacher", "topk", "dtypes")
VERIFIED = ".verified.json"  # {file: {sha256, size, mtime_ns, checked_ns}} of files that matched the manifest
# A file changed within this long of its check may change again within the same mtime tick (file system
# timestamps are coarse): its entry is not trusted, as git treats "racily clean" index entries.
RACY_NS = 2_000_000_000
_verified_here: set[tuple[str, str, int, int]] = set()  # (path, sha256, size, mtime_ns) checked by this process


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
        try:
            with named_errors(self.path):
                self.file.write(len(raw).to_bytes(8, "little") + raw)
                self.file.truncate(self.data_start + pos)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, row: int, tensor: torch.Tensor) -> None:
        start, row_bytes = self.layout[name]
        with named_errors(self.path):  # a full disk's write names no file
            self.file.seek(self.data_start + start + row * row_bytes)
            self.file.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy())

    def finish(self) -> str:
        """fsync, rename into place; returns the file's sha256."""
        with named_errors(self.path):
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        digest = sha256_file(self.tmp)
        os.replace(self.tmp, self.path)
        return digest

    def abort(self) -> None:
        """Close and delete the temp file; its close may fail too (a full disk refuses the buffered rest)."""
        try:
            self.file.close()
        except OSError:
            pass
        finally:
            self.tmp.unlink(missing_ok=True)


def read_manifest(store_dir: str | Path, require_complete: bool = True) -> dict[str, Any]:
    """The manifest, checked for its keys, schema version and shard files (not their checksums)."""
    store = Path(store_dir)
    path = store / MANIFEST
    if not path.is_file():
        raise StoreError(f"{path}: no manifest; run `python -m data_prep capture` first")
    m = read_json_object(path, f"delete {store} and capture again", StoreError)
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


@contextmanager
def open_store_file(path: Path) -> Iterator[Any]:
    """``safe_open`` whose failures (a truncated shard, a damaged header) are one-line StoreErrors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            yield f
    except SafetensorError as e:
        raise StoreError(f"{path}: unreadable safetensors file ({e}); rerun `python -m data_prep capture` (it "
                         "rewrites shards that do not match the manifest)") from None


def verify_store(store_dir: str | Path, manifest: dict[str, Any]) -> None:
    """Every shard, and the target head, must have the size and sha256 the manifest recorded at capture:
    a flipped byte would otherwise train quietly on wrong data. Hashes once per file version: matches are
    kept in ``.verified.json`` by (size, mtime_ns) (skipped where the store is read-only)."""
    store = Path(store_dir)
    files = [(s["file"], s["sha256"], s.get("bytes")) for s in manifest["shards"]]
    if manifest.get("target_head_sha256"):
        files.append((TARGET_HEAD, manifest["target_head_sha256"], None))
    try:
        cache = json.loads((store / VERIFIED).read_text())
    except (OSError, ValueError):
        cache = {}
    known, todo = {}, []
    for name, want, size in files:
        path = store / name
        st = path.stat()
        if size is not None and st.st_size != size:
            raise StoreError(f"{path}: {st.st_size} bytes, {store / MANIFEST} says {size} (truncated or replaced); "
                             "rerun `python -m data_prep capture` (it rewrites shards that do not match)")
        entry = {"sha256": want, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
        c = cache.get(name) or {}
        if (str(path), want, st.st_size, st.st_mtime_ns) in _verified_here or (
                {k: c.get(k) for k in entry} == entry and c.get("checked_ns", 0) - st.st_mtime_ns > RACY_NS):
            known[name] = c or entry | {"checked_ns": 0}
        else:
            todo.append((path, entry))
    with tqdm(total=sum(e["size"] for _, e in todo), unit="B", unit_scale=True, desc="verify store",
              disable=not todo, delay=2) as bar:  # shown only when it takes a while
        for path, entry in todo:
            checked_ns = time.time_ns()
            if sha256_file(path) != entry["sha256"]:
                raise StoreError(f"{path}: sha256 differs from {store / MANIFEST} (the file changed after capture); "
                                 "rerun `python -m data_prep capture` (it rewrites shards that do not match)")
            known[path.name] = entry | {"checked_ns": checked_ns}
            _verified_here.add((str(path), entry["sha256"], entry["size"], entry["mtime_ns"]))
            bar.update(entry["size"])
    if todo:
        try:
            write_json_atomic(store / VERIFIED, known)
        except OSError:  # a read-only store: verified again next time
            pass


def load_target_head(store_dir: str | Path) -> dict[str, torch.Tensor]:
    """``{"embed_tokens.weight", "lm_head.weight"}`` of the target: training needs no target model."""
    path = Path(store_dir) / TARGET_HEAD
    if not path.is_file():
        raise StoreError(f"{path}: missing; rerun `python -m data_prep capture`")
    with open_store_file(path) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def token_counts(store_dir: str | Path, vocab_size: int) -> torch.Tensor:
    """How often each target id is an input token at a loss-masked position (int64, ``vocab_size``)."""
    store = Path(store_dir)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in read_manifest(store)["shards"]:
        with open_store_file(store / s["file"]) as f:
            ids = f.get_tensor("input_ids").long()
            keep = f.get_tensor("loss_mask").bool()
        counts += torch.bincount(ids[keep], minlength=vocab_size)[:vocab_size]
    return counts

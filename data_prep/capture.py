"""Capture: run the target over every conversation and store what the drafter trains on.

    conversations.jsonl ─ chat template + loss mask ─ target forward ─ store/shard-*.safetensors + manifest.json

The target forward is one of three backends (``capture.backend``): ``hf`` (the HF model in-process),
``specforge`` (import SpecForge's SGLang capture: ``data_prep/specforge_import.py``; its samples are the ones
SpecForge tokenized) or ``sglang`` (``data_prep/capture_sglang.py``). Only ``hf`` builds the HF model; the
others read the tokenizer, config and head tensors from the checkpoint's files (``target_model.hf_index``).

Shard k holds kept samples [k*S, (k+1)*S) in conversation order, so its content is a function of the
input alone; a rerun keeps every shard whose checksum and sample plan verify and recomputes the rest
(kill -9 at any point loses at most one shard of work). Within a shard samples are sorted by length
and batched under ``capture.batch_tokens`` padded tokens, which keeps padding small and fixes the batch
composition, so a recomputed shard is byte-identical to the first attempt.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save
from torch import Tensor
from tqdm import tqdm

from common.batching import length_batches
from common.config import RunConfig
from common.dtypes import torch_dtype
from common.files import iter_jsonl, sha256_file, write_bytes_atomic, write_json_atomic
from common.parent_death import die_with_parent
from data_prep.capture_sample import CaptureError, Sample
from data_prep.capture_sglang import SGLangCaptureBackend
from data_prep.loss_mask import Cuts, LossMaskError, render_many
from data_prep.specforge_import import (
    ServerRendering,
    SpecForgeImport,
    export_for_specforge,
    specforge_command,
    write_draft_config,
)
from data_prep.store import (
    IDENTITY,
    MANIFEST,
    SCHEMA_VERSION,
    TARGET_HEAD,
    ShardWriter,
    StoreError,
    shard_name,
)
from drafter.factory import drafter_aux_ids
from target_model.aux_layers import resolve_aux_layer_ids
from target_model.hf_index import load_indexed_target_from_config
from target_model.hf_model import TargetModel, load_target_from_config

RENDER_POOL_MIN = 2000  # chats; fewer render faster in-process than a pool starts


def end_of_turn_rule(backend: str) -> str:
    """What a store's loss mask does with end-of-turn markers (manifest ``end_of_turn_loss``, checked by training):
    "ended_answers": loss on the marker only of answers the target ended (``loss_mask``); "specforge": SpecForge's
    own mask."""
    return "specforge" if backend == "specforge" else "ended_answers"


def counts_text(counts: Mapping[str, int]) -> str:
    """Counts by reason as a summary prints them."""
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


@dataclass
class LeftOut:
    """What ``render_all`` left out: conversations skipped, by reason, and what the caps took from the samples it
    kept (None where the samples were rendered elsewhere: SpecForge's)."""

    skipped: Counter = field(default_factory=Counter)
    cuts: Cuts | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"skipped": dict(sorted(self.skipped.items())), "cuts": None if self.cuts is None else asdict(self.cuts)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LeftOut:
        """From ``to_dict``'s keys (a store manifest holds them); ``cuts`` absent or None: not counted there."""
        cuts = d.get("cuts")
        return cls(Counter(d.get("skipped") or {}), None if cuts is None else Cuts(**cuts))

    def __str__(self) -> str:
        return f"skipped: {counts_text(self.skipped)}" + ("" if self.cuts is None else f"; {self.cuts}")


@dataclass
class CaptureSummary:
    store_dir: str
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    shards: int = 0
    shards_reused: int = 0
    shards_written: int = 0
    bytes: int = 0
    bytes_per_token: float = 0.0
    captured_tokens_per_s: float = 0.0
    skipped: dict[str, int] = field(default_factory=dict)
    tail_tokens_dropped: int = 0  # specforge: positions after a sample's last loss token (its batch padding)
    specforge_cut: dict[str, int] | None = None  # specforge: ``SpecForgeCut``, what its --max-length cut
    unlocated_ends: int = 0  # cut answers whose text end was not found: their end-of-turn kept in the loss
    cuts: dict[str, int] | None = None  # ``Cuts`` of the kept samples; None for SpecForge's samples

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        skipped = counts_text(self.skipped)
        return (f"capture -> {self.store_dir}\n"
                f"  samples {self.samples}, tokens {self.tokens}, loss tokens {self.loss_tokens}\n"
                f"  shards {self.shards} ({self.shards_reused} kept, {self.shards_written} written), "
                f"{self.bytes / 1e6:.1f} MB, {self.bytes_per_token:.0f} bytes/token, "
                f"{self.captured_tokens_per_s:.0f} tokens/s\n"
                f"  skipped: {skipped}"
                + (f"\n  {Cuts(**self.cuts)}" if self.cuts is not None else "")
                + (f"\n  SpecForge's --max-length cut {self.specforge_cut['samples']} samples: "
                   f"{self.specforge_cut['tokens']} tokens of the server's renderings are not in the store"
                   if self.specforge_cut and self.specforge_cut["samples"] else "")
                + (f"\n  dropped {self.tail_tokens_dropped} positions after the last loss tokens (SpecForge's "
                   "padding among them; no loss reads them)" if self.tail_tokens_dropped else "")
                + (f"\n  {self.unlocated_ends} cut answers (finish reason not stop/tool_calls) keep the loss on their "
                   "end-of-turn marker: the template does not render their text verbatim" if self.unlocated_ends
                   else ""))


# ---------------------------------------------------------------- input: conversations -> samples
def numbered_conversations(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, conversation) for each conversation regenerate wrote, each checked for the fields capture reads:
    a bad one is an error naming its line, not a failure far from it. The numbers let a caller's own checks name
    the line too."""
    if not path.is_file():
        raise CaptureError(f"{path}: not found; run `python -m data_prep regenerate` first")
    out = []
    for n, rec in iter_jsonl(path, CaptureError, fix="move the file away and rerun regenerate"):
        msgs = rec.get("messages")
        if not isinstance(rec.get("id"), str) or not isinstance(msgs, list):
            raise CaptureError(f"{path}:{n}: expected an object with 'id' (str) and 'messages' (list)")
        for m in msgs:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise CaptureError(f"{path}:{n}: messages must be {{'role': str, 'content': str}} objects "
                                   "(an assistant turn may add reasoning_content and tool_calls)")
            if not isinstance(m.get("reasoning_content", ""), str) or not isinstance(m.get("tool_calls", []), list):
                raise CaptureError(f"{path}:{n}: reasoning_content must be a string and tool_calls a list")
        reasons = rec.get("finish_reasons", [])
        if not (isinstance(reasons, list) and all(isinstance(r, str) for r in reasons)):
            raise CaptureError(f"{path}:{n}: finish_reasons must be a list of strings (one per answer)")
        out.append((n, rec))
    if not out:
        raise CaptureError(f"{path}: no conversations in it; rerun regenerate")
    return out


def read_conversations(path: Path) -> list[dict[str, Any]]:
    """The conversations of ``numbered_conversations``, checked as it checks them."""
    return [rec for _, rec in numbered_conversations(path)]


def _render_chunk(job: tuple[Any, list[list[dict]], list[Any], list[Any], int, dict[str, Any], int | None]
                  ) -> list[tuple[list[int], list[int], int, Cuts] | str]:
    """A worker's share: (ids, mask, unlocated ends, cuts) per chat, or the LossMaskError reason (exceptions with
    extra arguments do not survive pickling)."""
    tokenizer, chats, tools, reasons, max_length, template_kwargs, max_answer_tokens = job
    return [r.reason if isinstance(r, LossMaskError) else (r.input_ids, r.loss_mask, r.unlocated_ends, r.cuts)
            for r in render_many(tokenizer, chats, max_length, template_kwargs, tools,
                                 max_answer_tokens=max_answer_tokens, finish_reasons=reasons)]


def render_pool_context() -> Any:
    """How render_all starts its workers: forked (instant) unless this process already holds a CUDA context,
    then from a fork server (a clean process; the workers only render). A forked child inherits the driver's
    threads' locks in whatever state they were. It does not cure the stall of trainers started side by side on
    one GPU (they have stopped after loading their target with either start method): that cause is open, and a
    stalled trainer leaves its stacks (bench.runs.record_stall)."""
    import multiprocessing as mp

    return mp.get_context("forkserver" if torch.cuda.is_initialized() else "fork")


def render_all(convs: list[dict[str, Any]], tokenizer: Any, max_length: int,
               template_kwargs: dict[str, Any] | None = None, workers: int | None = None,
               max_answer_tokens: int | None = None) -> tuple[list[Sample], LeftOut]:
    """Samples in conversation order (first of each id), each conversation rendered as the server renders it:
    its tools and the target's chat_template_kwargs (thinking on/off) reach the template; reasoning and tool
    calls are part of the assistant turns. Its ``finish_reasons`` (regenerate's) decide which answers keep their
    end-of-turn marker in the loss (``loss_mask``: not a cut one's). ``max_answer_tokens`` (train.max_answer_tokens):
    only each assistant turn's first N tokens carry loss. The one rendering of training samples, for the store
    (capture) and online training (train.data), so both report the same ``LeftOut``: skipped conversations by
    reason (``loss_past_max_length``: every loss token lay past ``max_length``) and the kept samples' ``Cuts``.
    Many chats are rendered by a pool of workers (``workers``, default: the cores, at most 16; started as
    ``render_pool_context`` says): the chat template is Python, one core a chat."""
    skipped: Counter = Counter()
    seen: set[str] = set()
    unique = []
    for rec in convs:
        if rec["id"] in seen:
            skipped["duplicate_id"] += 1
            continue
        seen.add(rec["id"])
        unique.append(rec)
    chats = [rec["messages"] for rec in unique]
    tools = [rec.get("tools") for rec in unique]
    reasons = [rec.get("finish_reasons") for rec in unique]
    kwargs = dict(template_kwargs or {})
    workers = workers or min(16, os.cpu_count() or 1)
    if workers > 1 and len(chats) >= RENDER_POOL_MIN:
        size = -(-len(chats) // (workers * 4))
        jobs = [(tokenizer, chats[a:a + size], tools[a:a + size], reasons[a:a + size], max_length, kwargs,
                 max_answer_tokens) for a in range(0, len(chats), size)]
        with render_pool_context().Pool(workers, initializer=die_with_parent) as pool:  # none outlives us
            rendered = [r for part in pool.map(_render_chunk, jobs) for r in part]
    else:
        rendered = _render_chunk((tokenizer, chats, tools, reasons, max_length, kwargs, max_answer_tokens))
    samples, cuts = [], Cuts()
    for rec, r in zip(unique, rendered, strict=True):
        if isinstance(r, str):
            skipped[r] += 1
        elif sum(r[1]) == 0:
            skipped["loss_past_max_length" if r[3].truncated_loss_tokens else "no_loss_tokens"] += 1
        else:
            samples.append(Sample(rec["id"], r[0], r[1], r[2]))
            cuts += r[3]
    return samples, LeftOut(skipped, cuts)


def plan_sha256(samples: Sequence[Sample]) -> str:
    """Identity of a shard's inputs: a kept shard must hold exactly these samples."""
    h = hashlib.sha256()
    for s in samples:
        h.update(json.dumps([s.id, s.input_ids, s.loss_mask]).encode())
    return h.hexdigest()


# ---------------------------------------------------------------- the target forward
class CaptureBackend(Protocol):
    def run(self, batch: list[list[int]]) -> list[dict[str, Tensor]]:
        """Per sample: ``aux`` (L, 3H) and either ``last_hidden`` (L, H) or the teacher signal itself
        (``target_argmax``, ``topk_ids``, ``topk_logprobs``), float, on any device."""
        ...


class CaptureTarget(Protocol):
    """What capture needs of the target: ``hf_model.TargetModel`` (hf) or ``hf_index.IndexedTarget`` (target_model)."""

    name: str
    tokenizer: Any
    num_layers: int
    hidden_size: int
    vocab_size: int

    def fingerprint(self) -> str: ...

    def embed_weight(self) -> Tensor: ...

    def lm_head_weight(self) -> Tensor: ...


class HFCaptureBackend:
    """Right-padded batches through ``TargetModel.forward`` (hooks on the aux layers only)."""

    def __init__(self, target: TargetModel, aux_ids: Sequence[int]):
        self.target, self.aux_ids = target, list(aux_ids)

    def run(self, batch: list[list[int]]) -> list[dict[str, Tensor]]:
        longest = max(map(len, batch))
        ids = torch.full((len(batch), longest), self.target.tokenizer.pad_token_id, dtype=torch.long)
        for i, seq in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
        out = self.target.forward_right_padded(ids, self.aux_ids)
        return [{"aux": out.aux[i, : len(s)], "last_hidden": out.last_hidden[i, : len(s)]}
                for i, s in enumerate(batch)]


@torch.no_grad()
def teacher_signal(last_hidden: Tensor, lm_head: Tensor, teacher: str, topk: int) -> dict[str, Tensor]:
    """Greedy next token, plus top-k log-probs for teacher 'topk'; logits in row chunks to bound memory."""
    rows = max(1, (1 << 26) // lm_head.shape[0])
    argmax, ids, lps = [], [], []
    for chunk in last_hidden.split(rows):
        logits = chunk.to(lm_head.dtype) @ lm_head.T
        argmax.append(logits.argmax(-1).to(torch.int32))
        if teacher == "topk":
            top = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
            ids.append(top.indices.to(torch.int32))
            lps.append(top.values)
    out = {"target_argmax": torch.cat(argmax)}
    if teacher == "topk":
        out |= {"topk_ids": torch.cat(ids), "topk_logprobs": torch.cat(lps)}
    return out


# ---------------------------------------------------------------- the store
def store_header(target: CaptureTarget, aux_ids: Sequence[int], cap: Any) -> dict[str, Any]:
    """Everything a shard's meaning depends on besides its samples (compared on resume)."""
    dt = cap.dtype
    teacher = {"last_hidden": dt} if cap.teacher == "hidden" else {"topk_ids": "int32", "topk_logprobs": dt}
    return {
        "schema_version": SCHEMA_VERSION,
        "target": {"name": target.name, "fingerprint": target.fingerprint(), "num_layers": target.num_layers,
                   "hidden_size": target.hidden_size, "vocab_size": target.vocab_size},
        "aux_layer_ids": list(aux_ids),
        "teacher": cap.teacher,
        "topk": cap.topk if cap.teacher == "topk" else None,
        "dtypes": {"input_ids": "int32", "loss_mask": "uint8", "aux": dt, "target_argmax": "int32", **teacher},
        "max_length": cap.max_length,
    }


def previous_shards(store: Path, header: dict[str, Any]) -> list[dict[str, Any]]:
    """Shard entries of an earlier run of this same capture; a different capture is an error."""
    path = store / MANIFEST
    if not path.is_file():
        return []
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise StoreError(f"{path}: unreadable manifest; delete {store} and capture again") from None
    diff = [k for k in IDENTITY if old.get(k) != header[k]]
    if diff:
        raise StoreError(f"{store} holds a capture with different {', '.join(diff)} (e.g. another target, layer "
                         f"ids or teacher); delete {store} (rm -r) to capture again, or point run_dir elsewhere")
    return old.get("shards", [])


def shard_specs(samples: Sequence[Sample], header: dict[str, Any], cap: Any) -> dict[str, tuple[torch.dtype, tuple]]:
    n, t = len(samples), sum(len(s.input_ids) for s in samples)
    h, dt = header["target"]["hidden_size"], torch_dtype(cap.dtype)
    specs = {"offsets": (torch.int64, (n + 1,)), "input_ids": (torch.int32, (t,)), "loss_mask": (torch.uint8, (t,)),
             "aux": (dt, (t, 3 * h)), "target_argmax": (torch.int32, (t,))}
    if cap.teacher == "hidden":
        specs["last_hidden"] = (dt, (t, h))
    else:
        specs |= {"topk_ids": (torch.int32, (t, cap.topk)), "topk_logprobs": (dt, (t, cap.topk))}
    return specs


def capture_shard(backend: CaptureBackend, lm_head: Tensor, samples: list[Sample], path: Path,
                  header: dict[str, Any], cap: Any, bar: tqdm) -> str:
    """Compute and write one shard (temp file, then rename); returns its sha256."""
    lengths = [len(s.input_ids) for s in samples]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    meta = {"ids": json.dumps([s.id for s in samples]), "schema_version": str(SCHEMA_VERSION)}
    writer = ShardWriter(path, shard_specs(samples, header, cap), meta)
    try:
        writer.write("offsets", 0, torch.tensor(starts, dtype=torch.int64))
        writer.write("input_ids", 0, torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32))
        writer.write("loss_mask", 0, torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.uint8))
        store_dt = torch_dtype(cap.dtype)
        for batch in length_batches(lengths, cap.batch_tokens):
            outs = backend.run([samples[i].input_ids for i in batch])
            for i, o in zip(batch, outs, strict=True):
                writer.write("aux", starts[i], o["aux"].to(store_dt))
                if "last_hidden" in o:
                    sig = teacher_signal(o["last_hidden"], lm_head, cap.teacher, cap.topk)
                    if cap.teacher == "hidden":
                        sig["last_hidden"] = o["last_hidden"]
                else:
                    sig = {k: v for k, v in o.items() if k != "aux"}
                for key, val in sig.items():
                    writer.write(key, starts[i], val if val.dtype == torch.int32 else val.to(store_dt))
            bar.update(sum(lengths[i] for i in batch))
    except BaseException:
        writer.abort()
        raise
    return writer.finish()


def write_target_head(store: Path, target: CaptureTarget, old_sha: str | None) -> str:
    path = store / TARGET_HEAD
    if old_sha and path.is_file() and sha256_file(path) == old_sha:
        return old_sha
    # clone: a tied head shares storage with the embedding, which safetensors refuses to save twice
    data = save({"embed_tokens.weight": target.embed_weight().detach().cpu().clone().contiguous(),
                 "lm_head.weight": target.lm_head_weight().detach().cpu().clone().contiguous()})
    write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def load_capture_target(cfg: RunConfig) -> CaptureTarget:
    """The HF model for backend 'hf' only; for the others the checkpoint's tokenizer, config and head tensors
    (a 1T-parameter target is never built here)."""
    if cfg.capture.backend == "hf":
        return load_target_from_config(cfg.target)
    return load_indexed_target_from_config(cfg.target)


def capture_inputs(cfg: RunConfig, target: CaptureTarget, aux_ids: Sequence[int],
                   convs: list[dict[str, Any]] | None) -> tuple[list[Sample], LeftOut, CaptureBackend]:
    """The samples to store, what was left out, and the backend that gives their states."""
    cap = cfg.capture
    if cap.backend == "specforge":
        root = Path(cap.specforge_dir)
        data_path = cfg.root / "specforge_input.jsonl"
        if not root.is_dir() or not any(root.rglob("data_*.ckpt*")):
            wrote = cfg.conversations_path.is_file()
            if wrote:  # our regenerated conversations, in SpecForge's --data-path format
                export_for_specforge(read_conversations(cfg.conversations_path), data_path)
            draft_config = write_draft_config(cfg, aux_ids, cfg.root / "specforge_draft_config.json")
            raise CaptureError(f"capture.specforge_dir: {root} holds no SpecForge hidden states yet; wrote "
                               f"{str(data_path) + ' and ' if wrote else ''}{draft_config}; run SpecForge there, "
                               f"then capture again:\n    {specforge_command(cfg, data_path, draft_config)}")
        rendering = ServerRendering(data_path, target.tokenizer, cfg.target.chat_template_kwargs, cap.max_length)
        source = SpecForgeImport(root, target.hidden_size, rendering)
        samples, skipped = source.samples()
        return samples, LeftOut(skipped), source
    samples, left_out = render_all(convs or [], target.tokenizer, cap.max_length, cfg.target.chat_template_kwargs,
                                   max_answer_tokens=cfg.train.max_answer_tokens)
    return samples, left_out, make_capture_backend(cfg, target, aux_ids)


def make_capture_backend(cfg: RunConfig, target: CaptureTarget, aux_ids: Sequence[int]) -> CaptureBackend:
    """The forward for rendered samples: the HF model, or a stock SGLang engine."""
    if cfg.capture.backend == "sglang":
        return SGLangCaptureBackend(cfg, aux_ids)
    return HFCaptureBackend(target, aux_ids)  # type: ignore[arg-type]


def run_capture(cfg: RunConfig, target: CaptureTarget | None = None) -> CaptureSummary:
    """``target`` lets callers (tests, the pipeline) reuse a loaded one."""
    cap, store = cfg.capture, cfg.store_dir
    # Read first: bad input fails before the target loads. SpecForge's samples come with its files.
    convs = read_conversations(cfg.conversations_path) if cap.backend != "specforge" else None
    target = target or load_capture_target(cfg)
    aux_ids = resolve_aux_layer_ids(cfg.target.aux_layer_ids, drafter_aux_ids(cfg.drafter.init_from,
                                                                              target.num_layers), target.num_layers)
    header = store_header(target, aux_ids, cap)
    store.mkdir(parents=True, exist_ok=True)
    old = previous_shards(store, header)
    old_head = json.loads((store / MANIFEST).read_text()).get("target_head_sha256") if old else None
    for tmp in [*store.glob("*.tmp"), *store.glob(".*.tmp-*")]:  # leftovers of a killed write
        tmp.unlink()

    samples, left_out, backend = capture_inputs(cfg, target, aux_ids, convs)
    if not samples:
        source = (f"capture.specforge_dir: none of the samples in {cap.specforge_dir}" if cap.backend == "specforge"
                  else f"{cfg.conversations_path}: none of its {len(convs or [])} conversations")
        raise CaptureError(f"{source} gives a training sample (skipped: {counts_text(left_out.skipped)}); check "
                           "capture.max_length and the chat template")
    plan = [samples[i:i + cap.shard_samples] for i in range(0, len(samples), cap.shard_samples)]
    # The loss mask's cap on each answer (train.max_answer_tokens; SpecForge's samples keep SpecForge's mask):
    # training from the store checks it against its config
    answer_cap = cfg.train.max_answer_tokens if cap.backend != "specforge" else None
    unlocated = sum(s.unlocated_ends for s in samples)
    left = left_out.to_dict()  # skipped {reason: n}, cuts (Cuts of the kept samples)
    manifest = {**header, "target_head_sha256": write_target_head(store, target, old_head),
                "max_answer_tokens": answer_cap, "end_of_turn_loss": end_of_turn_rule(cap.backend), **left,
                "unlocated_ends": unlocated, "shards": [], "complete": False}
    summary = CaptureSummary(str(store), skipped=left["skipped"], cuts=left["cuts"],
                             tail_tokens_dropped=getattr(backend, "dropped_tail_tokens", 0), unlocated_ends=unlocated,
                             specforge_cut=asdict(backend.cut) if isinstance(backend, SpecForgeImport) else None)
    lm_head = target.lm_head_weight().detach()
    total = sum(len(s.input_ids) for s in samples)
    started, computed = time.perf_counter(), 0
    with tqdm(total=total, unit="tok", desc="capture") as bar:
        for k, part in enumerate(plan):
            entry = {"file": shard_name(k), "plan_sha256": plan_sha256(part), "num_samples": len(part),
                     "num_tokens": sum(len(s.input_ids) for s in part),
                     "num_loss_tokens": sum(sum(s.loss_mask) for s in part)}
            prev = old[k] if k < len(old) else None
            path = store / entry["file"]
            if (prev and prev.get("plan_sha256") == entry["plan_sha256"] and path.is_file()
                    and sha256_file(path) == prev["sha256"]):
                entry["sha256"] = prev["sha256"]
                summary.shards_reused += 1
                bar.update(entry["num_tokens"])
            else:
                entry["sha256"] = capture_shard(backend, lm_head, part, path, header, cap, bar)
                summary.shards_written += 1
                computed += entry["num_tokens"]
            entry["bytes"] = path.stat().st_size
            manifest["shards"].append(entry)
            manifest["totals"] = _totals(manifest["shards"])
            write_json_atomic(store / MANIFEST, manifest)
    for stale in store.glob("shard-*.safetensors"):  # the input shrank since an earlier run
        if stale.name not in {s["file"] for s in manifest["shards"]}:
            stale.unlink()
    manifest |= {"totals": _totals(manifest["shards"]), "complete": True}
    write_json_atomic(store / MANIFEST, manifest)

    t = manifest["totals"]
    summary.samples, summary.tokens, summary.loss_tokens = t["samples"], t["tokens"], t["loss_tokens"]
    summary.shards, summary.bytes = len(plan), t["bytes"]
    summary.bytes_per_token = t["bytes"] / max(1, t["tokens"])
    summary.captured_tokens_per_s = computed / max(1e-9, time.perf_counter() - started)
    return summary


def _totals(shards: list[dict[str, Any]]) -> dict[str, int]:
    return {"samples": sum(s["num_samples"] for s in shards), "tokens": sum(s["num_tokens"] for s in shards),
            "loss_tokens": sum(s["num_loss_tokens"] for s in shards), "bytes": sum(s["bytes"] for s in shards)}

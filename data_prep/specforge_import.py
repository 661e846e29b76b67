"""Import SpecForge's offline hidden-state files into our store (``capture.backend: specforge``).

Why: a 1T-parameter target runs only inside a tensor/expert-parallel SGLang, and SpecForge's
``scripts/prepare_hidden_states.py`` is the capture that is known to work there (it trained the AQ-MedAI
Kimi drafters; it drives SGLang's model runner directly and patches its logits processor to hand out the
aux and final states). We run it as it is and convert its files exactly; nothing here loads the target.

What SpecForge writes (read from SpecForge 0.2.0, the PyPI wheel = github.com/sgl-project/SpecForge
``scripts/prepare_hidden_states.py``; the names it writes come from
``specforge/algorithms/eagle3/providers.py`` ``OfflineCaptureLayout``):
- ``<output-path>/rows_<g>-<g+G>/data_<i>.ckpt`` (``HiddenStatesGenerator._get_file_path``; G =
  ``--file-group-size``, 2000), or ``data_<i>.ckpt.gz`` with ``--compress`` (gzip around the same bytes); ``i``
  is the sample's row in the *shuffled* ``--data-path``: ``specforge/data/preprocessing.py``
  ``build_eagle3_dataset`` shuffles the rows (``dataset.shuffle(seed=shuffle_seed)``, 42 by default, which the
  script keeps; so since v0.1.0) and the dataloader numbers them in that order (shuffle=False); a record holding
  a NaN is not written (a gap in ``i``).
- each file: ``torch.save`` of a dict of tensors (loaded here with ``weights_only=True``: tensors only):
  ``input_ids`` (L,) int64 and ``loss_mask`` (L,) int64 as SpecForge tokenized them (its dataloader pads a
  batch with zeros on the right, and the padding is saved too); ``aux_hidden_state`` (1, L, 3H) and
  ``hidden_state`` (1, L, H) in the target's dtype.
- ``aux_hidden_state``: SGLang's aux states for the capture layers, concatenated in layer order
  (``LogitsProcessor._get_hidden_states_to_store``, FULL capture mode), i.e. for the drafter's
  ``eagle_aux_hidden_state_layer_ids`` exactly what SGLang serves it
  (``target_model.aux_layers.sglang_captured_outputs``).
  SpecForge's layers (``specforge/algorithms/model_providers.py`` ``resolve_eagle_capture_layers``): the run's
  override, else the draft config's ids, else [1, N//2-1, N-4]. The files do not record them, so the config
  names them (target.aux_layer_ids or drafter.init_from).
- ``hidden_state``: the final-normed state at each position (the lm_head input), *not* shifted: position t
  holds the target's distribution for token t+1. SpecForge shifts it at train time
  (``specforge/modeling/target/target_head.py`` ``TargetHead.preprocess``: ``padding(target, left=False)``,
  with the input ids), so the drafter at t, reading token t+1, learns the distribution at t+1. Our
  ``last_hidden`` is the same unshifted state with the same meaning (ARCHITECTURE.md, "Positions"): copied
  as is.
- ``loss_mask``: 1 from after each assistant header through its end-of-turn token (``specforge/data/parse.py``
  ``GeneralParser``), the span ours marks for ChatML-style templates. Kept as the file has it. SpecForge
  weights its position t by ``loss_mask[t]`` (its normalizer also zeroes the last one), while our training
  weights position t by ``loss_mask[t+2+i]``: same per-token mask, each loss applied by its own trainer.

Rendering (``scripts/`` is not in the wheel: read at github.com/sgl-project/SpecForge commit a6b6b023,
version.txt 0.2.0, whose ``specforge/`` matches the wheel's but for 8 files none of which is read here):
SpecForge renders each conversation itself, ``tokenizer.apply_chat_template`` under its own
``--chat-template`` registry entry (``specforge/data/parse.py``: the entry's ``system_prompt`` put in front of a
conversation without one; ``enable_thinking=True`` for ``parser_type="thinking"`` entries that set it; the
GLM parser ``enable_thinking=False``). No option of ``prepare_hidden_states.py`` passes other template kwargs
(its options: --target-model-path, --strategy, --draft-model-config, --trust-remote-code, --data-path,
--max-length, --chat-template, --is-preformatted, --num-samples, --build-dataset-num-proc, --tp-size,
--batch-size, --cache-dir, --output-path, --dist-timeout, --num-io-threads, --num-workers, --io-queue-size,
--file-group-size, --compress, --compression-level and --sglang-*), and its loader
(``specforge/utils.py`` ``safe_conversations_generator``) keeps only ``conversations`` and ``tools`` of each
row, so neither ``target.chat_template_kwargs`` nor a preformatted ``text`` column can reach it. Hence the
import checks every sample against the server's rendering of the conversation it came from
(``loss_mask.conversation_text`` with the target's chat_template_kwargs and the chat's tools, the rendering
regenerate and the hf capture use): the first differing token is a one-line error naming the sample.

Conversion: ``last_hidden`` = ``hidden_state[0]``, ``aux`` = ``aux_hidden_state[0]``, ``input_ids`` and
``loss_mask`` as they are, ``target_argmax`` (and top-k for teacher 'topk') from the target's lm_head over
``last_hidden``, as for every backend. Positions after a sample's last loss token are dropped (SpecForge's
batch padding among them): no loss term of ours reads them, so the cut changes no training signal; the
count is reported, and so are the samples SpecForge's --max-length cut and the rendering's tokens it cut.
Samples are named ``specforge-<i>`` and kept in ``i`` order.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common.config import RunConfig
from common.files import iter_jsonl, write_json_atomic, write_jsonl_atomic
from data_prep.capture_sample import CaptureError, Sample
from data_prep.loss_mask import conversation_text
from drafter.factory import shape_for_target
from drafter.sglang_checkpoint import hf_config, read_config
from target_model.hf_model import target_text_config

FILE_RE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


def list_files(root: Path) -> dict[int, Path]:
    """Sample row -> its file, over every ``rows_*`` group (``specforge/runtime/data_plane/offline_reader.py``
    lists ``.ckpt``/``.ckpt.gz`` the same way); a row written twice is an error."""
    out: dict[int, Path] = {}
    for path in sorted(root.rglob("data_*.ckpt*")):
        m = FILE_RE.match(path.name)
        if not m:
            continue
        i = int(m[1])
        if i in out:
            raise CaptureError(f"{root}: sample {i} is written twice ({out[i].name} and {path.name}); keep one")
        out[i] = path
    return dict(sorted(out.items()))


def read_file(path: Path) -> dict[str, Tensor]:
    """One SpecForge record; plain files are memory-mapped, so reading the ids does not read the states."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                rec = torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
        else:
            rec = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises several types for a torn or foreign file
        raise CaptureError(f"{path}: not a SpecForge hidden-state file ({type(e).__name__}: {e})") from None
    missing = [k for k in KEYS if not isinstance(rec, dict) or not isinstance(rec.get(k), Tensor)]
    if missing:
        raise CaptureError(f"{path}: missing tensors {missing} (SpecForge's EAGLE-3 files hold {list(KEYS)})")
    return rec


def checked(rec: dict[str, Tensor], path: Path, hidden_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(input_ids (L,), loss_mask (L,), aux (L, 3H), last_hidden (L, H)) after checking every shape."""
    ids, mask = rec["input_ids"].reshape(-1), rec["loss_mask"].reshape(-1)
    aux, last = rec["aux_hidden_state"], rec["hidden_state"]
    aux = aux[0] if aux.dim() == 3 else aux
    last = last[0] if last.dim() == 3 else last
    n = ids.numel()
    problems = []
    if mask.numel() != n:
        problems.append(f"loss_mask has {mask.numel()} entries for {n} input_ids")
    if tuple(aux.shape) != (n, 3 * hidden_size):
        problems.append(f"aux_hidden_state is {tuple(rec['aux_hidden_state'].shape)}, expected (1, {n}, "
                        f"{3 * hidden_size}) (3 aux layers of the target's hidden size {hidden_size})")
    if tuple(last.shape) != (n, hidden_size):
        problems.append(f"hidden_state is {tuple(rec['hidden_state'].shape)}, expected (1, {n}, {hidden_size})")
    if ids.is_floating_point() or not (aux.is_floating_point() and last.is_floating_point()):
        problems.append("input_ids must be integers and the states floats")
    if problems:
        raise CaptureError(f"{path}: " + "; ".join(problems))
    return ids.long(), mask, aux, last


SHUFFLE_SEED = 42  # build_eagle3_dataset's shuffle_seed; prepare_hidden_states.py leaves the default


def capture_order(n: int) -> list[int]:
    """Row of an ``n``-row --data-path that SpecForge writes as ``data_<i>``, for each i: the permutation of
    ``datasets.Dataset.shuffle(seed=42)``, computed by the same library call."""
    from datasets import Dataset

    return list(Dataset.from_dict({"row": list(range(n))}).shuffle(seed=SHUFFLE_SEED, keep_in_memory=True)["row"])


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """First position where SpecForge's ids ``got`` (right-padded with zeros) leave ``want``; None if they agree."""
    for p, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return p
    if len(got) < len(want):
        return len(got)
    return next((p for p in range(len(want), len(got)) if got[p] != 0), None)


@dataclass
class SpecForgeCut:
    """What SpecForge's --max-length (= capture.max_length) cut from the server's renderings: the samples it cut
    and their tokens past the cut. SpecForge's files hold no loss mask for those tokens, so unlike the hf
    capture's ``Cuts`` the loss tokens among them are not known."""

    samples: int = 0
    tokens: int = 0

    def add(self, tokens: int) -> None:
        self.samples += int(tokens > 0)
        self.tokens += tokens


# How a missing or damaged --data-path is had again (the errors about it end with this).
EXPORTED_AGAIN = "capture writes it again from conversations.jsonl when capture.specforge_dir is empty"


class ServerRendering:
    """The server's rendering of the conversation behind each SpecForge sample, to check SpecForge's tokens:
    ``data_path`` is the --data-path SpecForge read (capture's export), in its row order."""

    def __init__(self, data_path: Path, tokenizer: Any, template_kwargs: dict[str, Any], max_length: int):
        if not data_path.is_file():
            raise CaptureError(f"{data_path}: missing; it is the --data-path SpecForge read, needed to check its "
                               f"tokens against the server's rendering ({EXPORTED_AGAIN})")
        fix = f"it is the --data-path SpecForge read: {EXPORTED_AGAIN}, then rerun SpecForge on it"
        self.rows: list[dict[str, Any]] = []
        for n, row in iter_jsonl(data_path, CaptureError, fix):
            if not isinstance(row.get("conversations"), list):
                raise CaptureError(f"{data_path}:{n}: no 'conversations' list; {fix}")
            self.rows.append(row)
        self.path, self.order = data_path, capture_order(len(self.rows))
        self.tokenizer, self.kwargs, self.max_length = tokenizer, dict(template_kwargs), max_length

    def check(self, i: int, ids: Sequence[int], path: Path) -> int:
        """Raise when sample ``i``'s tokens are not the server's rendering of its conversation cut at
        capture.max_length (SpecForge's --max-length); returns how many of the rendering's tokens the cut took."""
        if i >= len(self.rows):
            raise CaptureError(f"{path}: SpecForge sample {i}, but {self.path} has {len(self.rows)} conversations: "
                               "these files come from another --data-path")
        row = self.rows[self.order[i]]
        text = conversation_text(self.tokenizer, row["conversations"], self.kwargs, row.get("tools"))
        whole = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        want = whole[: self.max_length]
        p = first_difference(ids, want)
        if p is None:
            return len(whole) - len(want)
        sample = f"{path}: SpecForge sample {i} (conversation {row.get('id')})"
        if p == self.max_length and p < len(whole) and ids[p] == whole[p]:
            raise CaptureError(f"{sample} runs past capture.max_length {self.max_length}: SpecForge ran with a larger "
                               f"--max-length; rerun it with --max-length {self.max_length} or set capture.max_length "
                               "to its value")
        if p == len(ids) < len(want):
            raise CaptureError(f"{sample} ends after {p} tokens, where the server's rendering cut at "
                               f"capture.max_length {self.max_length} goes on: SpecForge ran with --max-length {p}; "
                               f"set capture.max_length {p} or rerun it with --max-length {self.max_length}")
        a, b = (seq[p] if p < len(seq) else None for seq in (ids, want))
        raise CaptureError(
            f"{sample} differs from the server's rendering at token "
            f"{p}: SpecForge has {self._show(a)}, the server's rendering {self._show(b)}; SpecForge renders with its "
            f"--chat-template entry and never sees target.chat_template_kwargs {self.kwargs}: rerun it with the "
            "template that renders as the server does, or capture with capture.backend hf")

    def _show(self, token: int | None) -> str:
        return "(the end)" if token is None else f"{token} ({self.tokenizer.convert_ids_to_tokens(token)!r})"


class SpecForgeImport:
    """The samples SpecForge captured, and their states as a capture backend hands them to the shard writer.
    ``rendering``: the check of every sample's tokens against the server's rendering."""

    def __init__(self, root: Path, hidden_size: int, rendering: ServerRendering):
        if not root.is_dir():
            raise CaptureError(f"capture.specforge_dir: {root} is not a directory")
        self.root, self.hidden_size, self.rendering = root, hidden_size, rendering
        self.files = list_files(root)
        if not self.files:
            raise CaptureError(f"capture.specforge_dir: {root} holds no rows_*/data_<i>.ckpt[.gz] files; run "
                               "SpecForge's scripts/prepare_hidden_states.py with --output-path there first")
        self.dropped_tail_tokens = 0
        self.cut = SpecForgeCut()
        self._paths: dict[bytes, Path] = {}  # digest of a sample's tokens -> its file

    @staticmethod
    def sample_id(index: int) -> str:
        return f"specforge-{index:08d}"

    def samples(self) -> tuple[list[Sample], Counter[str]]:
        """Every file's tokens and loss mask, cut after the last loss token; a sample with no loss token and rows
        SpecForge did not write (a NaN record; a gap in the indices) are counted, and so is what its
        --max-length cut from the server's rendering (``cut``)."""
        out: list[Sample] = []
        skipped: Counter[str] = Counter()
        skipped["specforge_not_written"] = max(max(self.files) + 1, len(self.rendering.rows)) - len(self.files)
        for i, path in self.files.items():
            ids, mask, _, _ = checked(read_file(path), path, self.hidden_size)
            self.cut.add(self.rendering.check(i, ids.tolist(), path))
            nonzero = mask.nonzero()
            if not len(nonzero):
                skipped["no_loss_tokens"] += 1
                continue
            keep = int(nonzero[-1]) + 1
            self.dropped_tail_tokens += ids.numel() - keep
            tokens = ids[:keep].tolist()
            self._paths.setdefault(_digest(tokens), path)  # equal tokens have equal states: either file will do
            out.append(Sample(self.sample_id(i), tokens, [int(m != 0) for m in mask[:keep].tolist()]))
        return out, Counter({k: v for k, v in skipped.items() if v})

    def run(self, batch: list[list[int]]) -> list[dict[str, Tensor]]:
        """The stored states of each sample (``capture.CaptureBackend``: samples come as their tokens)."""
        outs = []
        for tokens in batch:
            path = self._paths[_digest(tokens)]
            ids, _, aux, last = checked(read_file(path), path, self.hidden_size)
            n = len(tokens)
            if ids[:n].tolist() != list(tokens):
                raise CaptureError(f"{path}: changed since its tokens were read; rerun capture")
            outs.append({"aux": aux[:n], "last_hidden": last[:n]})
        return outs


def _digest(tokens: Sequence[int]) -> bytes:
    return hashlib.sha1(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes()).digest()


def export_for_specforge(conversations: Sequence[dict[str, Any]], path: Path) -> int:
    """Our regenerated conversations in SpecForge's --data-path format (one ``{"id", "conversations": messages,
    "tools"}`` per line; ``specforge/utils.py`` ``safe_conversations_generator`` reads "conversations" and
    "tools"). Returns the number written."""
    rows = [{"id": c["id"], "conversations": c["messages"]} | ({"tools": c["tools"]} if c.get("tools") else {})
            for c in conversations]
    write_jsonl_atomic(path, rows)
    return len(rows)


def write_draft_config(cfg: RunConfig, aux_ids: Sequence[int], path: Path) -> Path:
    """The drafter's config.json for SpecForge's --draft-model-config, where it reads the capture layers
    (``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``draft_vocab_size``; without the option
    prepare_hidden_states.py fails (it opens the option as a path). A warm start's own config with its ids spelled
    out; else the fresh drafter train will build, shaped like the target (``drafter.factory.shape_for_target``)."""
    d = cfg.drafter
    if d.init_from:
        config = read_config(d.init_from)
        config["eagle_config"] = {**(config.get("eagle_config") or {}),
                                  "eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    else:
        text = target_text_config(cfg.target)
        if d.draft_vocab_size > text.vocab_size:
            raise CaptureError(f"drafter.draft_vocab_size {d.draft_vocab_size} is larger than the target's vocab_size "
                               f"{text.vocab_size}; set it to at most {text.vocab_size}")
        shape = shape_for_target(text, d.draft_vocab_size, tuple(aux_ids), d.intermediate_size,
                                 d.num_attention_heads, d.num_key_value_heads, d.head_dim)
        config = hf_config(shape)
    write_json_atomic(path, config)
    return path


def specforge_command(cfg: RunConfig, data_path: Path, draft_config: Path) -> str:
    """The SpecForge run that fills capture.specforge_dir for this config (tp/ep from the capture section)."""
    cap = cfg.capture
    parts = [f"torchrun --nproc_per_node={cap.tensor_parallel_size} scripts/prepare_hidden_states.py",
             f"--target-model-path {cfg.target.name}", f"--draft-model-config {draft_config}",
             f"--data-path {data_path}", f"--output-path {cap.specforge_dir}",
             "--chat-template <SpecForge's template for the target, e.g. kimi-k2-instruct>",
             f"--max-length {cap.max_length}", f"--tp-size {cap.tensor_parallel_size}",
             f"--sglang-ep-size {cap.expert_parallel_size}"]
    if cfg.target.trust_remote_code:
        parts.append("--trust-remote-code")
    note = (f"\n    (no option of SpecForge's takes target.chat_template_kwargs {cfg.target.chat_template_kwargs}: "
            "pick the --chat-template entry that renders as the server does; the import checks every sample's "
            "tokens against the server's rendering)" if cfg.target.chat_template_kwargs else "")
    return " \\\n    ".join(parts) + note

"""A target read from its checkpoint files, without building the model.

Capture through SpecForge or SGLang needs, on this machine, only what the store records about the target:
its tokenizer (to render and check samples), its config (layer count, widths, architecture) and two tensors,
the input embedding and the lm_head (``target_head.safetensors``: training needs no target model). For
Kimi-K2.5 the whole checkpoint is about 1 T parameters; this reads ``model.safetensors.index.json`` (or a
single file's header) and loads just those two tensors from the shards that hold them. ``target_tensors``
reads other named tensors the same way (the last layer's, for ``drafter.init: target``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from common.config import TargetConfig
from common.dtypes import torch_dtype
from target_model.aux_layers import TargetError
from target_model.hf_model import hash_weight_files, load_tokenizer, resolve_source

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_map(source_dir: Path) -> dict[str, str]:
    """Tensor name -> shard file name, from the index (or the one file's header)."""
    if (source_dir / INDEX).is_file():
        try:
            return dict(json.loads((source_dir / INDEX).read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise TargetError(f"{source_dir / INDEX}: not a safetensors index ({type(e).__name__}: {e})") from None
    if (source_dir / SINGLE).is_file():
        with safe_open(str(source_dir / SINGLE), framework="pt") as f:
            return {name: SINGLE for name in f.keys()}
    raise TargetError(f"{source_dir}: no {INDEX} or {SINGLE} (expected a HF checkpoint directory)")


def head_tensor_names(names: list[str], tied: bool, where: str) -> tuple[str, str]:
    """The embedding and lm_head names. Prefixes vary (``model.``, ``language_model.model.`` for K2.5);
    DeepSeek-V3's MTP layer carries its own ``model.layers.61.embed_tokens.weight``, so layer tensors are
    passed over and the shortest remaining name wins."""
    def pick(suffix: str) -> str | None:
        found = sorted((n for n in names if n.endswith(suffix) and ".layers." not in n), key=len)
        return found[0] if found else None

    embed = pick("embed_tokens.weight")
    head = pick("lm_head.weight") or (embed if tied else None)
    if embed is None or head is None:
        missing = "embed_tokens.weight" if embed is None else "lm_head.weight"
        raise TargetError(f"{where}: no tensor named *{missing} outside the layers (and tie_word_embeddings is "
                          f"{tied}); cannot read the target's head")
    return embed, head


class IndexedTarget:
    """The capture-facing part of ``target_model.hf_model.TargetModel`` (name, tokenizer, sizes, fingerprint, head
    tensors) for a checkpoint that is never instantiated here."""

    def __init__(self, name: str, source_dir: Path, tokenizer: Any, config: dict[str, Any], dtype: torch.dtype):
        self.name, self.source_dir, self.tokenizer, self.dtype = name, source_dir, tokenizer, dtype
        self.config = config
        text = config.get("text_config") or config  # multimodal targets (K2.5) nest the LM's config
        where = f"{source_dir}/config.json"
        try:
            self.num_layers: int = int(text["num_hidden_layers"])
            self.hidden_size: int = int(text["hidden_size"])
            self.vocab_size: int = int(text["vocab_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise TargetError(f"{where}: missing or bad field {e}") from None
        self.architectures: list[str] = list(config.get("architectures") or ())
        tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
        self.files = weight_map(source_dir)
        self.embed_name, self.head_name = head_tensor_names(list(self.files), tied, str(source_dir))
        self._cache: dict[str, Tensor] = {}

    def _tensor(self, name: str) -> Tensor:
        if name not in self._cache:
            path = self.source_dir / self.files[name]
            with safe_open(str(path), framework="pt") as f:
                t = f.get_tensor(name)
            if not t.is_floating_point() or t.element_size() < 2:
                raise TargetError(f"{path}: {name} is {t.dtype}; expected a bf16/fp16/fp32 tensor")
            self._cache[name] = t.to(self.dtype)
        return self._cache[name]

    def embed_weight(self) -> Tensor:
        return self._tensor(self.embed_name)

    def lm_head_weight(self) -> Tensor:
        return self._tensor(self.head_name)

    def fingerprint(self) -> str:
        """Config plus each weight file's name, size, head and tail (as ``TargetModel.fingerprint`` hashes
        them, over config.json's own content: a store written by another backend is another capture)."""
        h = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        hash_weight_files(h, self.source_dir)
        return h.hexdigest()


def load_indexed_target(name: str, gguf_file: str | None = None, dtype: str = "bfloat16",
                        trust_remote_code: bool = False) -> IndexedTarget:
    source = resolve_source(name, gguf_file)
    if not isinstance(source, Path):
        raise TargetError(f"target.name: {name!r} is not a local directory; capture without the HF model reads the "
                          f"checkpoint's files: download them first (huggingface-cli download {name} --local-dir "
                          "DIR) and give DIR")
    try:
        config = json.loads((source / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise TargetError(f"{source}/config.json: unreadable ({e})") from None
    try:
        tok = load_tokenizer(source, trust_remote_code)
    except (OSError, ValueError) as e:
        raise TargetError(f"target.name: cannot load the tokenizer of {source} ({str(e).splitlines()[0]})") from None
    return IndexedTarget(name, source, tok, config, torch_dtype(dtype))


def load_indexed_target_from_config(cfg: TargetConfig) -> IndexedTarget:
    """``load_indexed_target`` on the config's values."""
    return load_indexed_target(cfg.name, cfg.gguf_file, cfg.dtype, cfg.trust_remote_code)


class TargetInitError(ValueError):
    pass


def target_tensors(source_dir: str | Path, names: Iterable[str]) -> dict[str, Tensor]:
    """Named tensors of a HF checkpoint directory (single ``model.safetensors`` or a sharded index);
    names that it does not hold are left out."""
    src = Path(source_dir)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        where = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise TargetInitError(f"{src}: no safetensors weights to initialise the drafter from")
        where = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                where |= {k: f.name for k in h.keys()}
    out: dict[str, Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for n in names:
        if n in where:
            by_file.setdefault(where[n], []).append(n)
    for file, keys in by_file.items():
        with safe_open(str(src / file), framework="pt") as h:
            out |= {k: h.get_tensor(k) for k in keys}
    return out


def last_layer_names(num_layers: int) -> list[str]:
    p = f"model.layers.{num_layers - 1}."
    return [p + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                            "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")] \
        + ["model.norm.weight"]

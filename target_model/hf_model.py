"""The target LLM built with transformers, behind one small interface: tokenizer, embedding/lm_head, and a
forward that returns the drafter's aux states in SGLang's convention (``target_model.aux_layers``: which layers'
outputs SGLang feeds the drafter for its ids on this architecture). ``resolve_source`` finds the target's
files: the embedded default, a GGUF file, a HF directory or a hub id.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from common.config import TargetConfig
from common.dtypes import torch_dtype
from common.step_clock import StepClock
from common.wheels import BUILTIN_TARGET, builtin_gguf, converted_gguf_dir
from target_model.aux_layers import TargetError, sglang_captured_outputs
from target_model.compiled_layers import CompiledLayers

# The right-padded forwards' attention backends: cuDNN's SDPA builds a plan per new shape (a pause each time), and
# every padded batch length is a new one to it; flash attention runs as fast with no per-shape cost.
RIGHT_PADDED_SDPA = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


@dataclass
class TargetOutput:
    aux: Tensor  # (B, T, 3H): outputs of the aux layers, concatenated in id order
    last_hidden: Tensor  # (B, T, H): final-normed hidden state (lm_head input)
    logits: Tensor | None  # (B, T, V) when asked for
    past_key_values: Any = None


class TargetModel:
    """A loaded HF causal LM. ``device``/``dtype`` are where its forward runs."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, name: str, source_dir: Path | None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.source_dir = source_dir
        cfg = model.config
        self.num_layers: int = cfg.num_hidden_layers
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.architectures: list[str] = list(getattr(cfg, "architectures", None) or ())
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.layers = self.base.layers
        self.compiled_layers = CompiledLayers(self.layers)  # the right-padded forwards' on CUDA
        # transformers 5.2x renamed `past_key_values` to `cache`; accept either.
        params = inspect.signature(self.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def hf_config(self) -> Any:
        return self.model.config

    def embed_weight(self) -> Tensor:
        return self.model.get_input_embeddings().weight

    def lm_head_weight(self) -> Tensor:
        return self.model.get_output_embeddings().weight

    def logits_from_hidden(self, last_hidden: Tensor) -> Tensor:
        return self.model.get_output_embeddings()(last_hidden.to(self.dtype))

    @torch.no_grad()
    def forward(self, input_ids: Tensor, aux_layer_ids: Sequence[int], attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Any = None, use_cache: bool = False,
                logits: bool = True) -> TargetOutput:
        """One target pass; hooks grab just the aux layers' outputs (no all-layer hidden tuple).
        ``aux_layer_ids`` are the drafter's config ids; the layers hooked are the ones SGLang captures for them
        on this architecture (``sglang_captured_outputs``)."""
        captured: dict[int, Tensor] = {}
        hooks = []
        outputs = sglang_captured_outputs(aux_layer_ids, self.architectures)
        for i in outputs:
            def grab(_m, _inp, out, i=i):
                captured[i] = out[0] if isinstance(out, tuple) else out
            hooks.append(self.layers[i].register_forward_hook(grab))
        try:
            out = self.base(input_ids=input_ids.to(self.device),
                            attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                            position_ids=None if position_ids is None else position_ids.to(self.device),
                            use_cache=use_cache, **{self._cache_kw: past_key_values})
        finally:
            for h in hooks:
                h.remove()
        last = out.last_hidden_state
        aux = torch.cat([captured[i] for i in outputs], dim=-1)
        return TargetOutput(aux=aux, last_hidden=last,
                            logits=self.logits_from_hidden(last) if logits else None,
                            past_key_values=_out_cache(out) if use_cache else None)

    def forward_right_padded(self, input_ids: Tensor, aux_layer_ids: Sequence[int]) -> TargetOutput:
        """Aux and last hidden states of right-padded rows (capture's batches, online training's). No padding
        mask: under the causal mask a real token never sees the padding after it, while a padding mask makes HF
        build a 4-D mask every batch and keeps SDPA off its fused causal kernels (the online target runs this every
        training step). Padding positions come out finite and are never scored."""
        # SDPA without cuDNN (``RIGHT_PADDED_SDPA``: cuDNN builds a plan for every new batch shape, and a token budget
        # meets new shapes step after step), and on CUDA the layers compiled (``target_model.compiled_layers``: the
        # eager layer is many small kernels whose launches, not their work, bound the forward).
        with sdpa_kernel(list(RIGHT_PADDED_SDPA)):
            if self.device.type != "cuda":
                return self.forward(input_ids, aux_layer_ids, logits=False)
            return self.compiled_layers.run(lambda: self.forward(input_ids, aux_layer_ids, logits=False))

    def fingerprint(self) -> str:
        """Cheap identity of the weights: config plus each weight file's name, size, head and tail
        (hashing a 1T-parameter target in full would take hours)."""
        h = hashlib.sha256(json.dumps(self.model.config.to_dict(), sort_keys=True, default=str).encode())
        if self.source_dir is not None:
            hash_weight_files(h, self.source_dir)
        else:
            for p in self.model.parameters():  # slice first: never copy a whole (huge) weight
                h.update(p.detach().reshape(-1)[: 1 << 14].float().cpu().numpy().tobytes())
        return h.hexdigest()


def hash_weight_files(h: Any, source_dir: Path) -> None:
    """Feed each weight file's name, size, first and last MiB into ``h``."""
    for f in sorted(source_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read())


# What a saved HF tokenizer writes; a directory with neither holds no tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(source: Path | str, trust_remote_code: bool) -> Any:
    """The target's tokenizer, with a pad token (its EOS when it has none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _out_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def stop_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's EOS plus ChatML's end-of-turn, when the vocabulary has it."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(ids)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def is_local_path(name: str) -> bool:
    """Whether ``name`` can only mean a path on this machine: a hub id never starts with '/', './', '../' or '~'.
    A missing one is then a missing directory, not a hub id the hub rejects ("Repo id must be in the form ...")."""
    return name.startswith(("/", "./", "../", "~"))


def resolve_source(name: str, gguf_file: str | None) -> Path | str:
    """A local directory for builtin names and GGUF files; hub ids pass through unchanged."""
    if name == BUILTIN_TARGET:
        return converted_gguf_dir(builtin_gguf())
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise TargetError(f"target.name: GGUF file {name} not found")
        return converted_gguf_dir(path)
    if is_local_path(name) and not path.exists():
        raise TargetError(f"target.name: no such directory {name}; point it at the local checkpoint")
    if gguf_file:
        return converted_gguf_dir(path / gguf_file)
    if path.exists() and not (path / "config.json").is_file():
        raise TargetError(f"target.name: {name} has no config.json (expected a HF model directory)")
    return path if path.exists() else name


def _load_error(name: str, e: Exception) -> TargetError:
    """transformers' error on loading ``name`` as one line naming the key and what to give instead: its own
    message names neither and may run to several lines."""
    return TargetError(f"target.name: cannot load {name!r} ({str(e).splitlines()[0]}); give a local directory, a "
                       f".gguf file or the builtin {BUILTIN_TARGET!r}")


def _tokenizer_error(name: str, source: Path | str, e: Exception) -> TargetError:
    """``_load_error`` for the tokenizer of a local directory, naming it: transformers' several lines there say
    which tokenizer kinds it tried, not that the directory lacks the files."""
    if not isinstance(source, Path):
        return _load_error(name, e)
    where = repr(name) if name == str(source) else f"{name!r} ({source})"
    found = any((source / f).is_file() for f in TOKENIZER_FILES)
    why = " ".join(str(e).split()) if found else f"no {' or '.join(TOKENIZER_FILES)} in it"
    return TargetError(f"target.name: cannot load the tokenizer of {where} ({why}); copy the model's tokenizer "
                       "files beside its config.json")


def _named_tokenizer(name: str, source: Path | str, trust_remote_code: bool) -> Any:
    """``load_tokenizer``, its failure a one-line error naming target.name (``_tokenizer_error``)."""
    try:
        return load_tokenizer(source, trust_remote_code)
    except (OSError, ValueError) as e:  # transformers raises ValueError for a directory without tokenizer files
        raise _tokenizer_error(name, source, e) from None


def load_target(name: str, gguf_file: str | None = None, dtype: str = "float32", device: str = "auto",
                trust_remote_code: bool = False, seconds: dict[str, float] | None = None) -> TargetModel:
    """``seconds``: filled with where the load's seconds went (imports, source, tokenizer, weights, device): a
    regenerate process pays them before its first forward, on every device of a run alike."""
    clock = StepClock(cuda=False)  # the host's clock: each part has finished when its call returns
    clock.mark()
    from transformers import AutoModelForCausalLM

    clock.mark()
    source = resolve_source(name, gguf_file)
    clock.mark()
    dev = pick_device(device)
    tok = _named_tokenizer(name, source, trust_remote_code)
    clock.mark()
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype),
                                                     trust_remote_code=trust_remote_code)
        clock.mark()
        model = model.to(dev)
        clock.mark()
    except OSError as e:
        raise _load_error(name, e) from None
    if seconds is not None:
        parts = ("imports_s", "source_s", "tokenizer_s", "weights_s", "to_device_s")
        seconds.update({n: round(ms / 1e3, 2) for n, ms in zip(parts, clock.spans_ms(), strict=True)})
    return TargetModel(model, tok, name, Path(source) if isinstance(source, Path) else None)


def target_text_config(cfg: TargetConfig) -> Any:
    """The target's HF config for its language model (heads, intermediate size, RoPE), without loading weights:
    a multimodal target (Kimi-K2.5) nests it as ``text_config``."""
    from transformers import AutoConfig

    source = resolve_source(cfg.name, cfg.gguf_file)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise _load_error(cfg.name, e) from None
    return config.get_text_config()


def load_target_from_config(cfg: TargetConfig, seconds: dict[str, float] | None = None) -> TargetModel:
    """``load_target`` on the config's values (the builders themselves take plain values)."""
    return load_target(cfg.name, cfg.gguf_file, cfg.dtype, cfg.device, cfg.trust_remote_code, seconds)


def tokenizer_from_config(cfg: TargetConfig) -> Any:
    """The target's tokenizer alone (``load_tokenizer``: a pad token too), for what renders or counts text without
    the weights; a tokenizer that cannot load is ``load_target``'s one-line error naming target.name."""
    return _named_tokenizer(cfg.name, resolve_source(cfg.name, cfg.gguf_file), cfg.trust_remote_code)


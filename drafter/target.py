"""The target LLM behind one small interface: tokenizer, embedding/lm_head, and a forward that
returns the drafter's aux states in SGLang's convention.

SGLang captures the *output* of each listed layer id, which is HF ``hidden_states[id + 1]``; a
drafter trained on other layers than the server captures loses its acceptance without any error, so
the ids are resolved once (``resolve_aux_layer_ids``) and every mismatch is an error. One exception
is SGLang's own: its DeepSeek-family models (Kimi-K2 and K2.5 among them) read the ids differently
(``sglang_captured_outputs``), and the forward captures what SGLang captures for the target's
architecture.
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

from common.dtypes import torch_dtype
from common.wheels import BUILTIN_TARGET, builtin_gguf, converted_gguf_dir


class TargetError(ValueError):
    pass


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Our default ids for a new drafter: the outputs of layers [2, N//2, N-3], written into its config.

    Not SGLang's default: for a drafter config without ids SGLang captures at the *inputs* of layers
    [2, N//2, N-3], i.e. the outputs of [1, N//2-1, N-4] (``drafter.checkpoint.legacy_aux_layer_ids``;
    sglang srt/models/llama.py ``set_eagle3_layers_to_capture(None)``). Ours are always written out, so
    the server captures exactly these.
    """
    return (2, num_layers // 2, num_layers - 3)


# SGLang's DeepSeek-family models set ``layers_to_capture = ids`` (the *inputs* of those layers, i.e. the
# outputs of id - 1) unless the first id is 1, and only then add 1 as every other model does. So ids [2, 30, 58]
# on Kimi-K2/K2.5 feed the drafter the outputs of layers [1, 29, 57], exactly as [1, 29, 57] would.
# The list is every target architecture whose model class applies that rule, read from sglang 0.5.23 (the PyPI
# wheel; its _version.py records no commit id), python/sglang/srt/models/: every ``set_eagle3_layers_to_capture``
# and the class that inherits or delegates to it, registered by name through ``EntryClass``:
#   deepseek_v2.py     DeepseekV2ForCausalLM (the rule), DeepseekV3ForCausalLM, DeepseekV32ForCausalLM (subclasses)
#   glm4_moe.py        GlmMoeDsaForCausalLM (a DeepseekV2ForCausalLM)
#   glm4_moe_lite.py   Glm4MoeLiteForCausalLM (its own copy of the rule)
#   mistral_large_3.py MistralLarge3ForCausalLM (a DeepseekV3ForCausalLM; SGLang's name for a Mistral-format
#                      Large 3 checkpoint, utils/hf_transformers/mistral_utils.py)
#   kimi_k25.py        KimiK25ForConditionalGeneration (hands the call to its DeepseekV3ForCausalLM language model)
# Left out: the draft-model classes that inherit it (DeepseekV3ForCausalLMNextN, GlmMoeDsaForCausalLMNextN,
# Glm4MoeLiteForCausalLMNextN, Glm5NextForConditionalGenerationNextN, MistralLarge3ForCausalLMEagle), never an
# EAGLE-3 target. Every other model with EAGLE-3 support adds 1 (gpt_oss.py keeps ids whose largest equals the
# layer count as they are: out of our range, 0..N-2).
INPUT_CAPTURE_ARCHITECTURES = frozenset({
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
    "Glm4MoeLiteForCausalLM", "MistralLarge3ForCausalLM", "KimiK25ForConditionalGeneration"})


def sglang_captured_outputs(ids: Sequence[int], architectures: Sequence[str] | None) -> tuple[int, ...]:
    """Which layers' *outputs* SGLang feeds the drafter for config ids ``ids`` on a target of ``architectures``."""
    if set(architectures or ()) & INPUT_CAPTURE_ARCHITECTURES and ids and ids[0] != 1:
        if min(ids) < 1:
            raise TargetError(f"aux layer ids {list(ids)}: on {list(architectures or ())} SGLang captures the input "
                              "of each listed layer, so 0 would be the embeddings; use ids >= 1")
        return tuple(i - 1 for i in ids)
    return tuple(ids)


def ascending_problem(ids: Sequence[int], field: str) -> str | None:
    """Why ``ids`` cannot be a drafter's aux ids as ordered (None when ascending). SGLang appends each captured
    state as its forward passes the layer, i.e. in layer order whatever the config's order, so a drafter trained
    on another order reads its fc input permuted. Refused rather than sorted: a warm start's ids are compared
    with the config's as given."""
    if list(ids) != sorted(ids):
        return (f"{field}: {list(ids)} must be ascending: write {sorted(ids)} (SGLang concatenates the captured "
                "states in layer order, so the drafter's fc would read them permuted)")
    return None


def resolve_aux_layer_ids(config_ids: Sequence[int] | None, drafter_ids: Sequence[int] | None,
                          num_layers: int) -> tuple[int, int, int]:
    """The one set of ids for capture, training and serving; disagreement or range is an error.

    Valid ids are 0..N-2: SGLang captures layer ``id``'s output at the input of layer ``id + 1``, so
    the last layer's output is never captured (and HF's ``hidden_states[N]`` is already normed).
    """
    if config_ids is not None and drafter_ids is not None and tuple(config_ids) != tuple(drafter_ids):
        raise TargetError(f"target.aux_layer_ids {list(config_ids)} differ from the drafter's "
                          f"eagle_aux_hidden_state_layer_ids {list(drafter_ids)}; drop one or make them equal")
    if config_ids is not None:
        ids, field = tuple(config_ids), "target.aux_layer_ids"
    elif drafter_ids:
        ids, field = tuple(drafter_ids), "eagle_aux_hidden_state_layer_ids"
    else:
        ids, field = default_aux_layer_ids(num_layers), "default aux layer ids"
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise TargetError(f"{field}: {bad} out of range: the target has {num_layers} layers "
                          f"(valid ids 0..{num_layers - 2}; SGLang never captures the last layer)")
    if len(ids) != 3 or len(set(ids)) != 3:
        raise TargetError(f"{field}: {list(ids)} must be 3 distinct layer ids")
    problem = ascending_problem(ids, field)
    if problem:
        raise TargetError(problem)
    return ids  # type: ignore[return-value]


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


def resolve_source(name: str, gguf_file: str | None) -> Path | str:
    """A local directory for builtin names and GGUF files; hub ids pass through unchanged."""
    if name == BUILTIN_TARGET:
        return converted_gguf_dir(builtin_gguf())
    path = Path(name)
    if name.endswith(".gguf"):
        if not path.is_file():
            raise TargetError(f"target.name: GGUF file {name} not found")
        return converted_gguf_dir(path)
    if gguf_file:
        return converted_gguf_dir(path / gguf_file)
    if path.exists() and not (path / "config.json").is_file():
        raise TargetError(f"target.name: {name} has no config.json (expected a HF model directory)")
    return path if path.exists() else name


def load_target(name: str, gguf_file: str | None = None, dtype: str = "float32", device: str = "auto",
                trust_remote_code: bool = False) -> TargetModel:
    from transformers import AutoModelForCausalLM

    source = resolve_source(name, gguf_file)
    dev = pick_device(device)
    try:
        tok = load_tokenizer(source, trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype(dtype),
                                                     trust_remote_code=trust_remote_code).to(dev)
    except OSError as e:
        raise TargetError(f"target.name: cannot load {name!r} ({str(e).splitlines()[0]}); give a local "
                          f"directory, a .gguf file or the builtin {BUILTIN_TARGET!r}") from None
    return TargetModel(model, tok, name, Path(source) if isinstance(source, Path) else None)


def target_text_config(cfg: Any) -> Any:
    """The target's HF config for its language model (heads, intermediate size, RoPE), without loading weights:
    a multimodal target (Kimi-K2.5) nests it as ``text_config``. ``cfg`` is a TargetConfig section."""
    from transformers import AutoConfig

    source = resolve_source(cfg.name, cfg.gguf_file)
    return AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code).get_text_config()


def load_target_from_config(cfg: Any) -> TargetModel:
    """``cfg`` is a TargetConfig section (kept out of the signature above: builders take plain values)."""
    return load_target(cfg.name, cfg.gguf_file, cfg.dtype, cfg.device, cfg.trust_remote_code)

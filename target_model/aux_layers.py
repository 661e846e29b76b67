"""The drafter's aux layer ids against the target: which layers' outputs they name, which SGLang captures
for them on each architecture, and the one resolver of the ids for capture, training and serving.

SGLang captures the *output* of each listed layer id, which is HF ``hidden_states[id + 1]``; a
drafter trained on other layers than the server captures loses its acceptance without any error, so
the ids are resolved once (``resolve_aux_layer_ids``) and every mismatch is an error. One exception
is SGLang's own: its DeepSeek-family models (Kimi-K2 and K2.5 among them) read the ids differently
(``sglang_captured_outputs``), and the target's forward (``target_model.hf_model.TargetModel.forward``) captures
what SGLang captures for the target's architecture. Pure: no torch, no model.
"""

from __future__ import annotations

from collections.abc import Sequence


class TargetError(ValueError):
    """A target setting that cannot work (aux layer ids, the target's name); raised here and in
    ``target_model.hf_model``, whose message names the key."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """Our default ids for a new drafter: the outputs of layers [2, N//2, N-3], written into its config.

    Not SGLang's default: for a drafter config without ids SGLang captures at the *inputs* of layers
    [2, N//2, N-3], i.e. the outputs of [1, N//2-1, N-4] (``drafter.sglang_checkpoint.legacy_aux_layer_ids``;
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

"""The target adapter and the drafter factory: aux states are SGLang's (HF hidden_states[id + 1]), the
KV cache works under transformers 5, and every target/drafter mismatch is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_target import tiny_target_model
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from drafter.factory import DrafterMismatchError, drafter_aux_ids, fresh_drafter, load_for_target, shape_for_target
from drafter.model import Eagle3Drafter
from drafter.sglang_checkpoint import legacy_aux_layer_ids, save_checkpoint
from drafter.vocab_map import build_vocab_map
from target_model.aux_layers import TargetError, default_aux_layer_ids, resolve_aux_layer_ids, sglang_captured_outputs
from target_model.hf_model import TargetModel, load_target, resolve_source

TINY_IDS = (0, 2, 4)


@pytest.fixture(scope="module")
def tiny_target() -> TargetModel:
    return tiny_target_model()


def one_line(e: pytest.ExceptionInfo, *fields: str) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    for f in fields:
        assert f in msg, (f, msg)
    return msg


# -- aux capture and the cache ---------------------------------------------------------------------
def test_aux_are_layer_outputs(tiny_target: TargetModel) -> None:
    ids = torch.randint(0, 100, (2, 7))
    out = tiny_target.forward(ids, TINY_IDS)
    ref = tiny_target.model(ids, output_hidden_states=True)
    h = tiny_target.hidden_size
    assert out.aux.shape == (2, 7, 3 * h)
    # exact: the same kernels on the same data (the hooks take the tensors HF's own forward returns)
    for j, i in enumerate(TINY_IDS):
        assert torch.equal(out.aux[..., j * h:(j + 1) * h], ref.hidden_states[i + 1]), i
    assert torch.equal(out.last_hidden, ref.hidden_states[-1])
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=1e-6)
    assert tiny_target.forward(ids, TINY_IDS, logits=False).logits is None


@pytest.mark.parametrize(("architecture", "ids", "outputs"), [
    ("LlamaForCausalLM", (2, 3, 4), (2, 3, 4)),  # llama.py: layers_to_capture = ids + 1 -> outputs of ids
    ("DeepseekV3ForCausalLM", (2, 3, 4), (1, 2, 3)),  # deepseek_v2.py: first id != 1 -> inputs of ids
    ("DeepseekV3ForCausalLM", (1, 2, 3), (1, 2, 3)),  # first id == 1 -> + 1, like llama
    ("KimiK25ForConditionalGeneration", (2, 30, 58), (1, 29, 57)),  # K2.5's language model is DeepseekV3
])
def test_aux_capture_follows_sglang_per_architecture(architecture: str, ids: tuple, outputs: tuple) -> None:
    """The K2 drafter's ids [2, 30, 58] feed it the outputs of [1, 29, 57] on Kimi-K2/K2.5 in SGLang; the
    HF forward must hand it the same states."""
    assert sglang_captured_outputs(ids, [architecture]) == outputs
    if max(ids) >= 6:
        return
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, architectures=[architecture])
    target = TargetModel(LlamaForCausalLM(cfg), tokenizer=None, name="tiny", source_dir=None)
    x = torch.randint(0, 100, (1, 5))
    ref = target.model(x, output_hidden_states=True).hidden_states
    assert torch.equal(target.forward(x, ids).aux, torch.cat([ref[i + 1] for i in outputs], -1))


# Every target architecture whose SGLang model class captures the *inputs* of the listed layers unless the first id
# is 1 (read from sglang 0.5.23, python/sglang/srt/models/: deepseek_v2.py DeepseekV2/V3/V32ForCausalLM;
# glm4_moe.py GlmMoeDsaForCausalLM(DeepseekV2ForCausalLM); glm4_moe_lite.py Glm4MoeLiteForCausalLM, its own copy
# of the rule; mistral_large_3.py MistralLarge3ForCausalLM(DeepseekV3ForCausalLM); kimi_k25.py, whose language
# model is a DeepseekV3ForCausalLM).
DEEPSEEK_RULE = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                 "Glm4MoeLiteForCausalLM", "MistralLarge3ForCausalLM", "KimiK25ForConditionalGeneration"]


@pytest.mark.parametrize("architecture", DEEPSEEK_RULE)
def test_every_architecture_with_the_deepseek_rule_is_listed(architecture: str) -> None:
    assert sglang_captured_outputs((2, 30, 58), [architecture]) == (1, 29, 57)
    assert sglang_captured_outputs((1, 30, 58), [architecture]) == (1, 30, 58)


def test_llama_style_architectures_capture_the_outputs_of_the_ids() -> None:
    for architecture in ("LlamaForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM", "GptOssForCausalLM"):
        assert sglang_captured_outputs((2, 30, 58), [architecture]) == (2, 30, 58)


def test_input_capture_refuses_id_zero() -> None:
    with pytest.raises(TargetError, match="embeddings"):
        sglang_captured_outputs((0, 3, 5), ["DeepseekV3ForCausalLM"])


@pytest.mark.parametrize("explicit_cache", [False, True])
def test_cache_path_equals_full_forward(tiny_target: TargetModel, explicit_cache: bool) -> None:
    ids = torch.randint(0, 100, (1, 9))
    full = tiny_target.forward(ids, TINY_IDS)
    cache = DynamicCache(config=tiny_target.hf_config) if explicit_cache else None
    first = tiny_target.forward(ids[:, :5], TINY_IDS, past_key_values=cache, use_cache=True)
    assert isinstance(first.past_key_values, DynamicCache)
    assert first.past_key_values.get_seq_length() == 5
    if explicit_cache:
        assert first.past_key_values is cache
    parts = [first]
    past = first.past_key_values
    for t in range(5, 9):  # one token at a time, as decoding does
        o = tiny_target.forward(ids[:, t:t + 1], TINY_IDS, past_key_values=past, use_cache=True)
        past = o.past_key_values
        parts.append(o)
    assert past.get_seq_length() == 9
    for field in ("aux", "last_hidden", "logits"):
        got = torch.cat([getattr(p, field) for p in parts], 1)
        torch.testing.assert_close(got, getattr(full, field), rtol=0, atol=1e-5)


def test_left_padded_batch_matches_unpadded(tiny_target: TargetModel) -> None:
    ids = torch.randint(3, 100, (1, 6))
    alone = tiny_target.forward(ids, TINY_IDS)
    batch = torch.stack([torch.randint(3, 100, (8,)), torch.cat([torch.zeros(2, dtype=torch.long), ids[0]])])
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out = tiny_target.forward(batch, TINY_IDS, attention_mask=mask, position_ids=pos)
    torch.testing.assert_close(out.aux[1, 2:], alone.aux[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logits[1, 2:], alone.logits[0], rtol=0, atol=1e-5)


def test_right_padded_batches_keep_sdpa_off_cudnn(tiny_target: TargetModel) -> None:
    """cuDNN's attention builds a plan per new shape (~100 ms on an H200), and online training's padded batches
    are new shapes step after step: the right-padded forward (capture's, online training's) runs without it."""
    seen = []
    hook = tiny_target.layers[0].register_forward_hook(
        lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        ids = torch.randint(0, 100, (2, 7))
        out = tiny_target.forward_right_padded(ids, TINY_IDS)
        tiny_target.forward(ids, TINY_IDS)
    finally:
        hook.remove()
    assert seen == [False, torch.backends.cuda.cudnn_sdp_enabled()]
    # exact: on a CPU the right-padded forward runs the same kernels on the same data
    torch.testing.assert_close(out.aux, tiny_target.forward(ids, TINY_IDS).aux, rtol=0, atol=0)


def test_hooks_are_removed(tiny_target: TargetModel) -> None:
    before = [len(layer._forward_hooks) for layer in tiny_target.layers]  # transformers keeps its own
    tiny_target.forward(torch.randint(0, 100, (1, 3)), TINY_IDS)
    assert [len(layer._forward_hooks) for layer in tiny_target.layers] == before


def test_fingerprint_tracks_weights(tiny_target: TargetModel) -> None:
    fp = tiny_target.fingerprint()
    assert fp == tiny_target.fingerprint()
    w = tiny_target.layers[1].mlp.up_proj.weight
    with torch.no_grad():
        w[0, 0] += 1
        assert tiny_target.fingerprint() != fp
        w[0, 0] -= 1


# -- aux layer ids ----------------------------------------------------------------------------------
def test_default_and_legacy_ids() -> None:
    assert default_aux_layer_ids(30) == (2, 15, 27)
    assert default_aux_layer_ids(61) == (2, 30, 58)  # what the AQ K2 drafter uses
    assert legacy_aux_layer_ids(30) == (1, 14, 26)  # outputs of layers whose inputs SGLang takes
    assert resolve_aux_layer_ids(None, None, 30) == (2, 15, 27)
    assert resolve_aux_layer_ids(None, (3, 4, 5), 30) == (3, 4, 5)
    assert resolve_aux_layer_ids([3, 4, 5], (3, 4, 5), 30) == (3, 4, 5)
    assert resolve_aux_layer_ids([0, 1, 28], None, 30) == (0, 1, 28)


@pytest.mark.parametrize(("config_ids", "drafter_ids", "fields"), [
    ([2, 15, 27], (2, 15, 26), ("target.aux_layer_ids", "eagle_aux_hidden_state_layer_ids", "differ")),
    ([2, 15, 30], None, ("target.aux_layer_ids", "out of range", "30 layers")),
    ([2, 15, 29], None, ("target.aux_layer_ids", "out of range")),  # the last layer: SGLang never captures it
    ([-1, 15, 27], None, ("target.aux_layer_ids", "out of range")),
    (None, (2, 30, 58), ("eagle_aux_hidden_state_layer_ids", "out of range")),
    ([2, 2, 27], None, ("target.aux_layer_ids", "distinct")),
    # a drafter config's ids in another order: SGLang feeds fc its captures in layer order
    (None, (15, 2, 27), ("eagle_aux_hidden_state_layer_ids", "[15, 2, 27]", "ascending", "[2, 15, 27]")),
    ([15, 2, 27], (15, 2, 27), ("target.aux_layer_ids", "ascending", "[2, 15, 27]")),
])
def test_bad_ids_are_one_line_errors(config_ids, drafter_ids, fields) -> None:
    with pytest.raises(TargetError) as e:
        resolve_aux_layer_ids(config_ids, drafter_ids, 30)
    one_line(e, *fields)


# -- warm start and fresh drafters -------------------------------------------------------------------
def target_cfg(**kw) -> LlamaConfig:
    base = {"hidden_size": 32, "vocab_size": 97, "num_hidden_layers": 6, "num_attention_heads": 4,
            "intermediate_size": 64}
    return LlamaConfig(**{**base, **kw})


@pytest.fixture
def drafter_dir(tmp_path: Path, tiny_drafter: Eagle3Drafter) -> Path:
    tiny_drafter.set_vocab_map(*build_vocab_map(torch.arange(97).flip(0), 40))
    return save_checkpoint(tiny_drafter, tmp_path / "d", dtype="float32")


def test_warm_start_fits_and_keeps_map(drafter_dir: Path, tiny_drafter: Eagle3Drafter) -> None:
    embed = torch.randn(97, 32)
    m, aux_ids = load_for_target(str(drafter_dir), embed, target_cfg().num_hidden_layers, config_aux_ids=None)
    assert aux_ids == (0, 1, 2)
    assert torch.equal(m.d2t, tiny_drafter.d2t) and torch.equal(m.t2d, tiny_drafter.t2d)
    assert torch.equal(m.embed_tokens.weight, embed)
    assert drafter_aux_ids(str(drafter_dir), 6) == (0, 1, 2) and drafter_aux_ids(None, 6) is None


@pytest.mark.parametrize(("kw", "config_ids", "fields"), [
    ({"hidden_size": 64}, None, ("hidden_size", "64", "32")),
    ({"vocab_size": 100}, None, ("vocab_size", "from scratch")),
    ({"num_hidden_layers": 3}, None, ("eagle_aux_hidden_state_layer_ids", "out of range")),
    ({}, (0, 1, 3), ("target.aux_layer_ids", "eagle_aux_hidden_state_layer_ids")),
])
def test_warm_start_mismatches_are_one_line(drafter_dir: Path, kw: dict, config_ids, fields) -> None:
    with pytest.raises((DrafterMismatchError, TargetError)) as e:
        cfg = target_cfg(**kw)
        load_for_target(str(drafter_dir), torch.zeros(cfg.vocab_size, cfg.hidden_size), cfg.num_hidden_layers,
                        config_aux_ids=config_ids)
    one_line(e, *fields)


def test_fresh_drafter_shaped_like_target() -> None:
    cfg = target_cfg(num_key_value_heads=2, rms_norm_eps=1e-5,
                     rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    shape = shape_for_target(cfg, draft_vocab_size=40, aux_layer_ids=(0, 2, 4))
    assert (shape.hidden_size, shape.intermediate_size, shape.num_attention_heads, shape.num_key_value_heads,
            shape.head_dim, shape.vocab_size) == (32, 64, 4, 2, 8, 97)
    assert shape.rope_theta == 5e5 and shape.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert shape.rms_norm_eps == 1e-5
    d2t, t2d = build_vocab_map(torch.arange(97), 40)
    embed = torch.randn(97, 32)
    m = fresh_drafter(shape, embed, d2t, t2d, seed=3)
    assert torch.equal(m.d2t, d2t) and torch.equal(m.embed_tokens.weight, embed)
    again = fresh_drafter(shape, embed, d2t, t2d, seed=3)
    assert torch.equal(again.fc.weight, m.fc.weight)  # seeded: a rerun starts from the same weights


# -- the real SmolLM2 target --------------------------------------------------------------------------
@pytest.mark.real
def test_smollm2_aux_logits_and_tokenizer(smollm2: TargetModel) -> None:
    tok = smollm2.tokenizer
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert tok.eos_token_id == tok.pad_token_id == 2 == tok.convert_tokens_to_ids("<|im_end|>")
    assert smollm2.num_layers == 30 and smollm2.hidden_size == 576 and smollm2.vocab_size == 49152
    assert default_aux_layer_ids(smollm2.num_layers) == (2, 15, 27)

    text = tok.apply_chat_template([{"role": "user", "content": "Name three primes."},
                                    {"role": "assistant", "content": "2, 3 and 5."}], tokenize=False)
    assert "2, 3 and 5.<|im_end|>" in text  # the end-of-turn token the drafter learns to predict
    ids = tok(text, return_tensors="pt").input_ids
    out = smollm2.forward(ids, (2, 15, 27))
    ref = smollm2.model(ids, output_hidden_states=True)
    for j, i in enumerate((2, 15, 27)):  # exact: the same kernels on the same data, as above
        assert torch.equal(out.aux[..., j * 576:(j + 1) * 576], ref.hidden_states[i + 1]), i
    teacher = F.linear(out.last_hidden, smollm2.lm_head_weight())
    assert (teacher - ref.logits).abs().max().item() <= 1e-4
    assert torch.equal(out.logits, ref.logits)

    # Incremental decoding through a DynamicCache agrees with the full pass.
    first = smollm2.forward(ids[:, :-3], (2, 15, 27), use_cache=True, logits=False)
    rest = smollm2.forward(ids[:, -3:], (2, 15, 27), past_key_values=first.past_key_values, use_cache=True)
    assert (rest.logits - ref.logits[:, -3:]).abs().max().item() <= 1e-3
    assert rest.past_key_values.get_seq_length() == ids.shape[1]

    shape = shape_for_target(smollm2.hf_config, draft_vocab_size=8192, aux_layer_ids=(2, 15, 27))
    assert (shape.hidden_size, shape.intermediate_size, shape.num_attention_heads, shape.num_key_value_heads,
            shape.head_dim, shape.vocab_size, shape.rope_theta) == (576, 1536, 9, 3, 64, 49152, 100000.0)
    assert smollm2.hf_config.tie_word_embeddings  # why our config.json must say false explicitly


# -- where the target comes from -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["/models/moonshotai/Kimi-K2.5", "./models/Kimi-K2.5", "../models/Kimi-K2.5",
                                  "~/no-such-dir/Kimi-K2.5"])
def test_a_missing_local_path_is_a_missing_directory_not_a_hub_id(name: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A name only a path can have, that does not exist yet: the hub's "Repo id must be in the form ..." would send
    the user the wrong way."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    if name.startswith("/"):
        name = f"{tmp_path}{name}"
    with pytest.raises(TargetError) as e:
        resolve_source(name, None)
    assert str(e.value) == f"target.name: no such directory {name}; point it at the local checkpoint"
    assert resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct", None) == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_directory_without_tokenizer_files_is_one_line_naming_the_key_and_the_directory(tmp_path: Path) -> None:
    """transformers raises a ValueError of several lines there that names neither."""
    LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=32).save_pretrained(tmp_path)
    with pytest.raises(TargetError) as e:
        load_target(str(tmp_path), device="cpu")
    assert one_line(e) == (f"target.name: cannot load the tokenizer of '{tmp_path}' (no tokenizer.json or "
                           "tokenizer_config.json in it); copy the model's tokenizer files beside its config.json")

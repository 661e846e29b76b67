"""Checkpoints in exactly SGLang's layout: bit-exact round trips, the key table, AQ-MedAI-style dirs,
warm starts, and the strict checker (in process and as `python -m drafter check`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from drafter.factory import load_for_target
from drafter.model import DrafterShape, Eagle3Drafter
from drafter.sglang_checkpoint import (
    CheckpointError,
    check_checkpoint,
    expected_tensors,
    fingerprint,
    hf_config,
    load_checkpoint,
    save_checkpoint,
    served_bytes,
    shape_from_config,
)
from drafter.vocab_map import build_vocab_map

REPO = Path(__file__).resolve().parents[1]
K2_CONFIG = REPO / "configs" / "drafters" / "kimi-k2-instruct-eagle3.json"

# Written out by hand from SGLang's LlamaForCausalLMEagle3 (q/k/v read [embed, hidden], 2H wide).
K2_TENSORS = {
    "fc.weight": (7168, 21504),
    "midlayer.self_attn.q_proj.weight": (8192, 14336),
    "midlayer.self_attn.k_proj.weight": (8192, 14336),
    "midlayer.self_attn.v_proj.weight": (8192, 14336),
    "midlayer.self_attn.o_proj.weight": (7168, 8192),
    "midlayer.mlp.gate_proj.weight": (18432, 7168),
    "midlayer.mlp.up_proj.weight": (18432, 7168),
    "midlayer.mlp.down_proj.weight": (7168, 18432),
    "midlayer.hidden_norm.weight": (7168,),
    "midlayer.input_layernorm.weight": (7168,),
    "midlayer.post_attention_layernorm.weight": (7168,),
    "norm.weight": (7168,),
    "lm_head.weight": (32000, 7168),
    "d2t": (32000,),
    "t2d": (163840,),
}
SMOLLM2_TENSORS = {  # H 576, I 1536, 9 heads, 3 kv heads, head_dim 64, V 49152, draft vocab 8192
    "fc.weight": (576, 1728),
    "midlayer.self_attn.q_proj.weight": (576, 1152),
    "midlayer.self_attn.k_proj.weight": (192, 1152),
    "midlayer.self_attn.v_proj.weight": (192, 1152),
    "midlayer.self_attn.o_proj.weight": (576, 576),
    "midlayer.mlp.gate_proj.weight": (1536, 576),
    "midlayer.mlp.up_proj.weight": (1536, 576),
    "midlayer.mlp.down_proj.weight": (576, 1536),
    "midlayer.hidden_norm.weight": (576,),
    "midlayer.input_layernorm.weight": (576,),
    "midlayer.post_attention_layernorm.weight": (576,),
    "norm.weight": (576,),
    "lm_head.weight": (8192, 576),
    "d2t": (8192,),
    "t2d": (49152,),
}
OWNED_KEYS = {"dtype", "torch_dtype"}  # config keys save_checkpoint rewrites on purpose


def randomize(m: Eagle3Drafter, seed: int = 0) -> Eagle3Drafter:
    """Non-trivial weights and vocab map, so a dropped or swapped tensor cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    counts = torch.randint(0, 50, (m.shape.vocab_size,), generator=g)
    m.set_vocab_map(*build_vocab_map(counts, m.shape.draft_vocab_size))
    return m


def header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(path, "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.fixture
def saved(tmp_path: Path, tiny_drafter: Eagle3Drafter) -> Path:
    return save_checkpoint(randomize(tiny_drafter), tmp_path / "good", dtype="float32")


# -- round trip ----------------------------------------------------------------------------------
def test_fp32_round_trip_is_bit_exact(tmp_path: Path, tiny_drafter: Eagle3Drafter) -> None:
    m = randomize(tiny_drafter)
    loaded = load_checkpoint(save_checkpoint(m, tmp_path / "ck", dtype="float32"))
    ours, theirs = m.state_dict(), loaded.state_dict()
    assert set(theirs) == set(ours)
    for name in expected_tensors(m.shape):
        assert theirs[name].dtype == ours[name].dtype and torch.equal(theirs[name], ours[name]), name
    assert loaded.shape == m.shape


def test_bf16_round_trip_is_bit_exact(tmp_path: Path, tiny_drafter: Eagle3Drafter) -> None:
    m = randomize(tiny_drafter)
    first = save_checkpoint(m, tmp_path / "a", dtype="bfloat16")
    on_disk = load_file(first / "model.safetensors")
    loaded = load_checkpoint(first)
    for name, t in on_disk.items():
        mine = m.state_dict()[name]
        want = mine.to(torch.bfloat16) if mine.is_floating_point() else mine
        assert t.dtype == want.dtype and torch.equal(t, want), name
        assert torch.equal(loaded.state_dict()[name].to(t.dtype), t), name
    second = save_checkpoint(loaded, tmp_path / "b", dtype="bfloat16")
    again = load_file(second / "model.safetensors")
    assert all(torch.equal(again[k], on_disk[k]) for k in on_disk) and set(again) == set(on_disk)
    assert fingerprint(first) == fingerprint(second)
    assert json.loads((second / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_fingerprint_tracks_weights(tmp_path: Path, tiny_drafter: Eagle3Drafter) -> None:
    m = randomize(tiny_drafter)
    a = fingerprint(save_checkpoint(m, tmp_path / "a", dtype="float32"))
    with torch.no_grad():
        m.norm.weight[0] += 1
    assert fingerprint(save_checkpoint(m, tmp_path / "b", dtype="float32")) != a


def test_save_replaces_an_existing_checkpoint_whole(tmp_path: Path, tiny_drafter: Eagle3Drafter) -> None:
    out = save_checkpoint(randomize(tiny_drafter), tmp_path / "ck", dtype="float32")
    (out / "stale.txt").write_text("old")
    save_checkpoint(tiny_drafter, out, dtype="bfloat16", extra_files={"run_config.json": "{}"})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "run_config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp or old dirs left behind


# -- the key table SGLang reads --------------------------------------------------------------------
def test_a_full_disk_names_the_checkpoint_file_and_leaves_no_temp_dir(tmp_path: Path, tiny_drafter: Eagle3Drafter,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors reports a full disk as its own error type, errno only in its text: an OSError naming the file
    comes out (one line, exit 2, not a crash), and the half-written temp dir is gone (it would hold the space the
    rerun needs); an old checkpoint there stays whole."""
    import drafter.sglang_checkpoint as ckpt_module

    old = save_checkpoint(tiny_drafter, tmp_path / "ckpts" / "best", dtype="float32")
    before = (old / "model.safetensors").read_bytes()

    def full(_state, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(ckpt_module, "save_file", full)
    with pytest.raises(OSError) as e:
        save_checkpoint(tiny_drafter, old, dtype="float32")
    assert e.value.errno == 28 and e.value.filename == str(old / "model.safetensors")
    assert sorted(p.name for p in old.parent.iterdir()) == ["best"]
    assert (old / "model.safetensors").read_bytes() == before


def test_smollm2_shaped_checkpoint_has_exactly_sglangs_tensors(tmp_path: Path) -> None:
    shape = DrafterShape(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, vocab_size=49152, draft_vocab_size=8192, aux_layer_ids=(2, 15, 27),
                         rms_norm_eps=1e-5, rope_theta=100000.0)
    out = save_checkpoint(Eagle3Drafter(shape), tmp_path / "smol")
    got = header(out / "model.safetensors")
    assert {k: s for k, (s, _) in got.items()} == SMOLLM2_TENSORS
    assert {k: d for k, (_, d) in got.items()} == {
        **{k: "BF16" for k in SMOLLM2_TENSORS}, "d2t": "I64", "t2d": "BOOL"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert (cfg["vocab_size"], cfg["draft_vocab_size"]) == (49152, 8192)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 100000.0
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert check_checkpoint(out) == []


def test_k2_expected_tensors_match_the_literal_table() -> None:
    """The 7168-wide shape, from the AQ-MedAI config, without materialising any weight."""
    cfg = json.loads(K2_CONFIG.read_text())
    shape = shape_from_config(cfg, str(K2_CONFIG))
    assert {k: s for k, (s, _) in expected_tensors(shape).items()} == K2_TENSORS
    assert shape.aux_layer_ids == (2, 30, 58) and shape.rope_theta == 1e6 and shape.rope_scaling is None
    # Our config.json for that shape keeps every AQ key we do not own, value for value.
    ours = hf_config(shape, cfg, dtype="bfloat16")
    assert {k: v for k, v in ours.items() if k not in OWNED_KEYS and k in cfg} == \
           {k: v for k, v in cfg.items() if k not in OWNED_KEYS}
    assert ours["max_window_layers"] == 48 and ours["use_sliding_window"] is False


def test_rope_scaling_survives_config_round_trip(tiny_shape: DrafterShape) -> None:
    scaled = DrafterShape(**{**tiny_shape.as_dict(), "rope_scaling": {"type": "linear", "factor": 2.0}})
    cfg = hf_config(scaled)
    assert cfg["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert shape_from_config(cfg, "x").rope_scaling == {"type": "linear", "factor": 2.0}
    # A transformers-5 style config (rope_parameters only) reads the same.
    v5 = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta")}
    assert shape_from_config(v5, "x").rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert shape_from_config(v5, "x").rope_theta == 10000.0
    assert shape_from_config(hf_config(tiny_shape), "x").rope_scaling is None


# -- an AQ-MedAI-style directory ------------------------------------------------------------------
TINY = {"hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": 8, "vocab_size": 97, "draft_vocab_size": 40}


def write_aq_dir(root: Path, sharded: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """The AQ config (its extra keys included) at tiny dims, tensors written straight with save_file."""
    root.mkdir()
    cfg = {**json.loads(K2_CONFIG.read_text()), **TINY}
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator().manual_seed(7)
    h, i, q = TINY["hidden_size"], TINY["intermediate_size"], TINY["num_attention_heads"] * TINY["head_dim"]
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (q, 2 * h),
              "midlayer.self_attn.k_proj.weight": (q, 2 * h), "midlayer.self_attn.v_proj.weight": (q, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, q), "midlayer.mlp.gate_proj.weight": (i, h),
              "midlayer.mlp.up_proj.weight": (i, h), "midlayer.mlp.down_proj.weight": (h, i),
              "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
              "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
              "lm_head.weight": (TINY["draft_vocab_size"], h)}
    tensors = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}
    chosen = torch.sort(torch.randperm(TINY["vocab_size"], generator=g)[: TINY["draft_vocab_size"]]).values
    tensors["d2t"] = chosen - torch.arange(TINY["draft_vocab_size"])
    tensors["t2d"] = torch.zeros(TINY["vocab_size"], dtype=torch.bool)
    tensors["t2d"][chosen] = True
    if not sharded:
        save_file(tensors, root / "model.safetensors")
        return root, tensors
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[:7], "model-00002-of-00002.safetensors": names[7:]}
    for fname, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, root / fname)
    index = {"metadata": {"total_size": 0}, "weight_map": {k: f for f, ks in parts.items() for k in ks}}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    return root, tensors


def k2_like_target() -> LlamaConfig:
    return LlamaConfig(hidden_size=TINY["hidden_size"], vocab_size=TINY["vocab_size"], num_hidden_layers=61,
                       num_attention_heads=4, intermediate_size=64)


@pytest.mark.parametrize("sharded", [False, True])
def test_aq_layout_loads_warm_starts_and_round_trips(tmp_path: Path, sharded: bool) -> None:
    src, tensors = write_aq_dir(tmp_path / "aq", sharded)
    assert check_checkpoint(src) == []
    embed = torch.randn(TINY["vocab_size"], TINY["hidden_size"])
    m, aux_ids = load_for_target(str(src), embed, k2_like_target().num_hidden_layers, config_aux_ids=(2, 30, 58))
    state = m.state_dict()
    for name, t in tensors.items():
        assert torch.equal(state[name].to(t.dtype), t), name
    assert torch.equal(m.d2t, tensors["d2t"]) and torch.equal(m.t2d, tensors["t2d"])  # its own map kept
    assert torch.equal(m.embed_tokens.weight, embed)
    assert m.shape.aux_layer_ids == aux_ids == (2, 30, 58)

    out = save_checkpoint(m, tmp_path / "ours", dtype="bfloat16")
    src_cfg, our_cfg = (json.loads((d / "config.json").read_text()) for d in (src, out))
    for key, value in src_cfg.items():
        if key not in OWNED_KEYS:
            assert our_cfg[key] == value, key  # max_window_layers, use_sliding_window, bos_token_id, ...
    assert check_checkpoint(out) == []
    again = load_file(out / "model.safetensors")
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)


def test_legacy_config_without_aux_ids_reads_as_sglang_does(tmp_path: Path) -> None:
    src, _ = write_aq_dir(tmp_path / "aq", sharded=False)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (src / "config.json").write_text(json.dumps(cfg))
    # SGLang then captures the inputs of layers [2, N//2, N-3] = outputs of [1, N//2-1, N-4].
    assert load_checkpoint(src, num_target_layers=61).shape.aux_layer_ids == (1, 29, 57)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        load_checkpoint(src)


# -- the strict checker ---------------------------------------------------------------------------
def _edit_tensors(d: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    t = load_file(d / "model.safetensors")
    fn(t)
    save_file(t, d / "model.safetensors")


def _edit_config(d: Path, fn: Callable[[dict], None]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _set(t: dict, k: str, v: torch.Tensor) -> None:
    t[k] = v


# Readable, finite drafters that SGLang would serve wrongly: the checker's problems (a rejection, exit 1).
BREAKAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "d2t_outside_vocab": (lambda d: _edit_tensors(d, lambda t: t["d2t"].__setitem__(-1, 97)),
                          "outside the target vocab"),
    "tied": (lambda d: _edit_config(d, lambda c: c.__setitem__("tie_word_embeddings", True)),
             "tie_word_embeddings must be false"),
    "no_aux_ids": (lambda d: _edit_config(d, lambda c: c["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")),
                   "eagle_aux_hidden_state_layer_ids"),
    "unsorted_aux_ids": (lambda d: _edit_config(d, lambda c: c["eagle_config"].__setitem__(
        "eagle_aux_hidden_state_layer_ids", [2, 0, 1])), "must be ascending"),
    "wrong_arch": (lambda d: _edit_config(d, lambda c: c.__setitem__("architectures", ["LlamaForCausalLM"])),
                   "architectures"),
    "int32_d2t": (lambda d: _edit_tensors(d, lambda t: _set(t, "d2t", t["d2t"].int())), "d2t has dtype I32"),
    # config fields with which SGLang serves another function than the one these weights compute here
    "norm_before_fc": (lambda d: _edit_config(d, lambda c: c["eagle_config"].__setitem__("norm_before_fc", True)),
                       "eagle_config.norm_before_fc is set: SGLang would add an RMSNorm over fc's input"),
    "fc_norm": (lambda d: _edit_config(d, lambda c: c.__setitem__("fc_norm", True)), "fc_norm is set"),
    "use_aux_norm": (lambda d: _edit_config(d, lambda c: c.__setitem__("use_aux_norm", True)), "use_aux_norm is set"),
    "norm_output": (lambda d: _edit_config(d, lambda c: c.__setitem__("norm_output", True)), "norm_output is set"),
    "bias": (lambda d: _edit_config(d, lambda c: c.__setitem__("bias", True)), "bias is set"),
    "num_aux_hidden_states": (lambda d: _edit_config(d, lambda c: c.__setitem__("num_aux_hidden_states", 2)),
                              "num_aux_hidden_states is 2 but eagle_config names 3"),
    "target_hidden_size": (lambda d: _edit_config(d, lambda c: c.__setitem__("target_hidden_size", 64)),
                           "target_hidden_size is 64, not hidden_size 32"),
    "no_aux_states": (lambda d: _edit_config(d, lambda c: c["eagle_config"].__setitem__("use_aux_hidden_state",
                                                                                          False)),
                      "use_aux_hidden_state is not true"),
    "rope_theta_disagrees": (lambda d: _edit_config(d, lambda c: c.__setitem__("rope_theta", 500000.0)),
                             "rope_theta 500000.0 differs from rope_parameters.rope_theta 10000.0"),
    "rope_scaling_disagrees": (lambda d: _edit_config(d, lambda c: c.__setitem__("rope_scaling", {
        "type": "linear", "factor": 2.0})), "differs from rope_parameters"),
}
SERVED_ELSE = ("norm_before_fc", "fc_norm", "use_aux_norm", "norm_output", "bias", "num_aux_hidden_states",
               "target_hidden_size", "no_aux_states", "rope_theta_disagrees", "rope_scaling_disagrees")
# Not a readable, finite drafter at all: CheckpointError (an error, exit 2; tests/test_drafter_checkpoint_exit_codes.py
# has the rest, at every entry point).
DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing_key": (lambda d: _edit_tensors(d, lambda t: t.pop("norm.weight")), "missing tensor norm.weight"),
    "extra_key": (lambda d: _edit_tensors(d, lambda t: _set(t, "midlayer.self_attn.qkv_proj.weight",
                                                            torch.zeros(2, 2))),
                  "unexpected tensor midlayer.self_attn.qkv_proj.weight"),
    "embed_tokens": (lambda d: _edit_tensors(d, lambda t: _set(t, "embed_tokens.weight", torch.zeros(97, 32))),
                     "unexpected tensor embed_tokens.weight"),
    "wrong_shape": (lambda d: _edit_tensors(d, lambda t: _set(t, "norm.weight", torch.ones(33))),
                    "norm.weight has shape [33], expected [32]"),
    "nan_weight": (lambda d: _edit_tensors(d, lambda t: t["fc.weight"].__setitem__((0, 0), float("nan"))),
                   "non-finite weights (NaN/inf) in fc.weight"),
    "no_draft_vocab_size": (lambda d: _edit_config(d, lambda c: c.__setitem__("draft_vocab_size", None)),
                            "draft_vocab_size is missing or null"),
    "eagle_config_a_list": (lambda d: _edit_config(d, lambda c: c.__setitem__("eagle_config", [2, 15, 27])),
                            "eagle_config is a JSON list, not an object"),
    "rope_scaling_a_string": (lambda d: _edit_config(d, lambda c: c.__setitem__("rope_scaling", "linear")),
                              "rope_scaling is a JSON str, not an object"),
    "no_heads": (lambda d: _edit_config(d, lambda c: c.update(num_attention_heads=0, head_dim=None)),
                 "num_attention_heads is 0"),
}
CONFIG_DAMAGES = ("no_draft_vocab_size", "eagle_config_a_list", "rope_scaling_a_string", "no_heads")


def make_broken(saved: Path, root: Path, kind: str) -> Path:
    import shutil

    d = root / kind
    shutil.copytree(saved, d)
    {**BREAKAGES, **DAMAGES}[kind][0](d)
    return d


@pytest.mark.parametrize("kind", sorted(BREAKAGES))
def test_checker_names_each_breakage(saved: Path, tmp_path: Path, kind: str) -> None:
    assert check_checkpoint(saved) == []
    problems = check_checkpoint(make_broken(saved, tmp_path, kind))
    assert problems, kind
    assert any(BREAKAGES[kind][1] in p for p in problems), problems
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize("kind", SERVED_ELSE)
def test_a_drafter_sglang_would_serve_as_another_function_does_not_load(saved: Path, tmp_path: Path,
                                                                        kind: str) -> None:
    """Training or measuring it here would be training or measuring a drafter other than the one served."""
    broken = make_broken(saved, tmp_path, kind)
    with pytest.raises(CheckpointError, match=re.escape(BREAKAGES[kind][1])) as e:
        load_checkpoint(broken)
    assert str(e.value).startswith(f"{broken / 'config.json'}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", sorted(DAMAGES))
def test_checker_raises_on_each_damage(saved: Path, tmp_path: Path, kind: str) -> None:
    broken = make_broken(saved, tmp_path, kind)
    with pytest.raises(CheckpointError, match=re.escape(DAMAGES[kind][1])) as e:
        check_checkpoint(broken)
    named = "config.json" if kind in CONFIG_DAMAGES else "model.safetensors"
    assert str(e.value).startswith(f"{broken / named}: ") and "\n" not in str(e.value)
    if kind == "nan_weight":
        assert check_checkpoint(broken, check_finite=False) == []  # what --no-finite skips


def test_checker_survives_unreadable_weights(saved: Path, tmp_path: Path) -> None:
    sharded, _ = write_aq_dir(tmp_path / "aq", sharded=True)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors: unreadable safetensors file"):
        check_checkpoint(sharded)  # a shard named in the index is gone: one error naming it, no crash
    truncated = make_broken(saved, tmp_path, "nan_weight")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        check_checkpoint(truncated)
    with pytest.raises(ValueError, match="save dtype 'fp8'"):
        save_checkpoint(load_checkpoint(saved), tmp_path / "x", dtype="fp8")


def test_cli_check_exit_codes(saved: Path, tmp_path: Path) -> None:
    """`python -m drafter check` as users run it: exit 0 on good dirs, 1 with every reason printed."""
    sharded, _ = write_aq_dir(tmp_path / "aq", sharded=True)
    ok = subprocess.run([sys.executable, "-m", "drafter", "check", str(saved), str(sharded)],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.count("OK ") == 2
    broken = [make_broken(saved, tmp_path, k) for k in sorted(BREAKAGES)]
    bad = subprocess.run([sys.executable, "-m", "drafter", "check", str(saved), *map(str, broken)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"OK   {saved}" in bad.stdout
    for d in broken:
        section = bad.stdout.split(f"FAIL {d}\n", 1)[1].split("FAIL ", 1)[0]
        assert BREAKAGES[d.name][1] in section, (d.name, bad.stdout)


def test_cli_check_on_a_dir_without_config_json_is_one_line_and_exit_2(saved: Path, tmp_path: Path) -> None:
    """What a user types: `python -m drafter check DIR` on a directory that is no drafter checkpoint is an error,
    not a rejection (exit 1 reads as "checked: FAIL"): one line on stderr naming the file, exit 2, as every
    command. tests/test_drafter_checkpoint_exit_codes.py has every other damage, in process."""
    import shutil

    bad = tmp_path / "no-config"
    shutil.copytree(saved, bad)
    (bad / "config.json").unlink()
    r = subprocess.run([sys.executable, "-m", "drafter", "check", str(bad)], capture_output=True, text=True,
                       cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad / 'config.json'}: missing"), r.stderr
    assert "FAIL" not in r.stdout


def test_served_size_counts_floats_in_bf16_whatever_dtype_was_saved(tmp_path: Path, tiny_drafter: Eagle3Drafter
                                                                     ) -> None:
    m = randomize(tiny_drafter)
    fp32 = save_checkpoint(m, tmp_path / "fp32", dtype="float32")
    bf16 = save_checkpoint(m, tmp_path / "bf16", dtype="bfloat16")
    state = load_file(str(bf16 / "model.safetensors"))
    want = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in state.values())

    assert served_bytes(fp32) == served_bytes(bf16) == want
    assert (fp32 / "model.safetensors").stat().st_size > (bf16 / "model.safetensors").stat().st_size

"""Checkpoint I/O in exactly the layout SGLang loads (``config.json`` + ``model.safetensors``).

SGLang's loader renames ``midlayer`` to ``layers.0`` and silently skips names it does not know, so a
typo here would serve a drafter with random weights. ``check_checkpoint`` is therefore strict: the
key set must equal ``expected_tensors`` exactly, with the right shapes, dtypes and a consistent map.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from common.dtypes import FLOAT_DTYPE_NAMES, torch_dtype
from common.files import fresh_tmp_dir, json_text, named_errors, read_json_object, sha256_file, swap_dir
from drafter.model import DrafterShape, Eagle3Drafter, rope_inv_freq, rope_parameters
from drafter.vocab_map import vocab_map_problems
from target_model.aux_layers import ascending_problem

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A directory that is not a readable, finite drafter checkpoint: an error (exit 2) at every entry point, never
    a rejection (exit 1, which the gate records in the promotion history). The message names the file, what is
    wrong and what to do."""


# What to do about a damaged checkpoint, the end of each CheckpointError about one.
_REDO = "copy or save it again, or point at another checkpoint"


def expected_tensors(s: DrafterShape) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor SGLang reads, with its shape and dtype class ('float', 'int64' or 'bool')."""
    h, hd = s.hidden_size, s.head_dim
    q_out, kv_out = s.num_attention_heads * hd, s.num_key_value_heads * hd
    t = {
        "fc.weight": ((h, 3 * h), "float"),
        "midlayer.self_attn.q_proj.weight": ((q_out, 2 * h), "float"),
        "midlayer.self_attn.k_proj.weight": ((kv_out, 2 * h), "float"),
        "midlayer.self_attn.v_proj.weight": ((kv_out, 2 * h), "float"),
        "midlayer.self_attn.o_proj.weight": ((h, q_out), "float"),
        "midlayer.mlp.gate_proj.weight": ((s.intermediate_size, h), "float"),
        "midlayer.mlp.up_proj.weight": ((s.intermediate_size, h), "float"),
        "midlayer.mlp.down_proj.weight": ((h, s.intermediate_size), "float"),
        "midlayer.hidden_norm.weight": ((h,), "float"),
        "midlayer.input_layernorm.weight": ((h,), "float"),
        "midlayer.post_attention_layernorm.weight": ((h,), "float"),
        "norm.weight": ((h,), "float"),
        "lm_head.weight": ((s.draft_vocab_size, h), "float"),
        "d2t": ((s.draft_vocab_size,), "int64"),
        "t2d": ((s.vocab_size,), "bool"),
    }
    return t


def legacy_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """What SGLang captures for a drafter whose config names no ids: the *inputs* of layers
    [2, N//2, N-3], i.e. the outputs of [1, N//2-1, N-4] in our (output) convention."""
    n = num_target_layers
    return (1, n // 2 - 1, n - 4)


def hf_config(s: DrafterShape, extra: dict[str, Any] | None = None, dtype: str = "bfloat16") -> dict:
    """config.json for SGLang; keys of ``extra`` we do not own survive the round trip."""
    cfg = dict(extra or {})
    eagle = dict(cfg.get("eagle_config") or {})
    eagle.update(eagle_aux_hidden_state_layer_ids=list(s.aux_layer_ids), use_aux_hidden_state=True)
    cfg.update(
        architectures=[ARCHITECTURE], model_type="llama", num_hidden_layers=1, hidden_act="silu",
        hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_attention_heads=s.num_attention_heads, num_key_value_heads=s.num_key_value_heads,
        head_dim=s.head_dim, vocab_size=s.vocab_size, draft_vocab_size=s.draft_vocab_size,
        rms_norm_eps=s.rms_norm_eps, max_position_embeddings=s.max_position_embeddings,
        # Plain rope_theta/rope_scaling for loaders that predate rope_parameters.
        rope_theta=s.rope_theta, rope_scaling=s.rope_scaling, rope_parameters=rope_parameters(s),
        # The target (e.g. SmolLM2) may tie; SGLang would then tie our lm_head to the embedding.
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        # transformers 5 reads `dtype`, older loaders `torch_dtype`: both name the saved dtype.
        eagle_config=eagle, torch_dtype=dtype, dtype=dtype,
    )
    return cfg


def rope_scaling_from(cfg: dict) -> dict | None:
    """The scaled-RoPE parameters of a config.json (legacy ``rope_scaling`` or ``rope_parameters``, which
    ``served_function_problems`` holds equal); None for plain RoPE, so a default type never reaches transformers'
    table of scaled types."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return scaling if scaling.get("rope_type", scaling.get("type", "default")) != "default" else None


def rope_theta_from(cfg: dict) -> float:
    """RoPE's base as SGLang reads it: ``rope_parameters.rope_theta`` first, then the plain ``rope_theta``
    (transformers 5 folds a plain one into rope_parameters), else 10000."""
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta") or cfg.get("rope_theta") or 10000.0)


# Fields with which SGLang's LlamaForCausalLMEagle3 computes something Eagle3Drafter does not (a norm or a bias
# with no weights in the file, left at their initial values), or nothing it should: a drafter carrying one would be
# measured here as one function and served as another.
UNSERVED_FLAGS = {"norm_before_fc": "an RMSNorm over fc's input", "fc_norm": "an RMSNorm on each aux state",
                  "use_aux_norm": "an RMSNorm on each aux state", "norm_output": "the normed state carried on",
                  "bias": "biases on fc and the attention projections"}


def served_function_problems(cfg: dict) -> list[str]:
    """Every config field with which SGLang would serve a drafter other than the one ``Eagle3Drafter`` computes
    from these weights (SGLang 0.5's llama_eagle3.py and its EAGLE-3 set-up); empty when there is none."""
    eagle = cfg.get("eagle_config") or {}
    p = [f"{where}{key} is set: SGLang would add {what}, which this drafter does not have; remove the field"
         for key, what in UNSERVED_FLAGS.items()
         for where, source in (("", cfg), ("eagle_config.", eagle)) if source.get(key)]
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    aux = cfg.get("num_aux_hidden_states")
    if aux is not None and isinstance(ids, list) and aux != len(ids):
        p.append(f"num_aux_hidden_states is {aux} but eagle_config names {len(ids)} aux layers: SGLang would size fc "
                 "for the former; remove the field")
    if "target_hidden_size" in cfg and cfg["target_hidden_size"] != cfg.get("hidden_size"):
        p.append(f"target_hidden_size is {cfg['target_hidden_size']}, not hidden_size {cfg.get('hidden_size')}: "
                 "this drafter reads aux states of its own width")
    if eagle.get("use_aux_hidden_state", True) is not True:
        p.append("eagle_config.use_aux_hidden_state is not true: SGLang would capture no aux states and skip fc")
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" in params and "rope_theta" in cfg and float(params["rope_theta"]) != float(cfg["rope_theta"]):
        p.append(f"rope_theta {cfg['rope_theta']} differs from rope_parameters.rope_theta {params['rope_theta']}: "
                 "which one SGLang serves depends on its transformers; make them equal")
    if params and cfg.get("rope_scaling") and scaling_terms(cfg["rope_scaling"]) != scaling_terms(params):
        p.append(f"rope_scaling {cfg['rope_scaling']} differs from rope_parameters {params}: which one SGLang serves "
                 "depends on its transformers; make them equal")
    return p


def scaling_terms(rope: dict) -> dict:
    """A RoPE dict's scaling as one form: the legacy ``type`` named ``rope_type``, the base left out."""
    terms = {("rope_type" if k == "type" else k): v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_type": "default", **terms}


def shape_from_config(cfg: dict, where: str, num_target_layers: int | None = None) -> DrafterShape:
    """Read a DrafterShape from a config.json dict; ``where`` names the file in errors."""
    try:
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids is None:
            if num_target_layers is None:
                raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids is "
                                      "missing and the target's layer count is unknown")
            ids = legacy_aux_layer_ids(num_target_layers)
        if cfg.get("draft_vocab_size") is None:
            raise CheckpointError(f"{where}: draft_vocab_size is missing or null, with which SGLang serves the "
                                  "target's lm_head instead of the drafter's (or fails to load): set it to lm_head's "
                                  "row count")
        theta = rope_theta_from(cfg)
        heads = int(cfg["num_attention_heads"])
        if heads < 1:
            raise CheckpointError(f"{where}: num_attention_heads is {heads}; a drafter has at least one head")
        return DrafterShape(
            hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
            num_attention_heads=heads, num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            vocab_size=int(cfg["vocab_size"]),
            draft_vocab_size=int(cfg["draft_vocab_size"]),
            aux_layer_ids=tuple(int(i) for i in ids), rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta), rope_scaling=rope_scaling_from(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
        )
    except KeyError as e:
        raise CheckpointError(f"{where}: missing config field {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{where}: {e}") from None


def read_config(ckpt_dir: str | Path) -> dict:
    """The checkpoint's config.json as a dict; CheckpointError when the directory or the file is missing or the
    file is not a UTF-8 JSON object."""
    d = Path(ckpt_dir)
    if not d.is_dir():
        what = "not a directory" if d.exists() else "no such directory"
        raise CheckpointError(f"{d}: {what}; a drafter checkpoint is a directory holding config.json and "
                              f"{WEIGHTS_NAME}: check the path")
    path = d / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, so {d} is not a drafter checkpoint; point at one (a directory "
                              f"holding config.json and {WEIGHTS_NAME}, such as checkpoints/best)")
    cfg = read_json_object(path, _REDO, CheckpointError)
    for key in ("eagle_config", "rope_parameters", "rope_scaling"):
        if cfg.get(key) is not None and not isinstance(cfg[key], dict):
            raise CheckpointError(f"{path}: {key} is a JSON {type(cfg[key]).__name__}, not an object; {_REDO}")
    return cfg


@contextmanager
def open_weights(path: Path) -> Iterator[Any]:
    """``safe_open`` whose failures (a truncated file, a damaged header) are one-line CheckpointErrors."""
    try:
        with safe_open(path, "pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors file ({e}); the checkpoint is damaged (a truncated "
                              f"copy?): {_REDO}") from None


def weight_files(ckpt_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> file, for a single model.safetensors or a sharded index."""
    d = Path(ckpt_dir)
    if (d / INDEX_NAME).is_file():
        try:
            index = json.loads((d / INDEX_NAME).read_text())
            return {name: d / f for name, f in index["weight_map"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{d / INDEX_NAME}: not a safetensors index ({type(e).__name__}: {e}); "
                                  f"{_REDO}") from None
    if not (d / WEIGHTS_NAME).is_file():
        raise CheckpointError(f"{d / WEIGHTS_NAME}: missing (and no {INDEX_NAME} either); {_REDO}")
    with open_weights(d / WEIGHTS_NAME) as f:
        return {name: d / WEIGHTS_NAME for name in f.keys()}


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str


def tensor_infos(ckpt_dir: str | Path) -> dict[str, TensorInfo]:
    """Shapes and dtypes from safetensors headers, without reading any weights."""
    infos: dict[str, TensorInfo] = {}
    by_file: dict[Path, list[str]] = {}
    for name, f in weight_files(ckpt_dir).items():
        by_file.setdefault(f, []).append(name)
    for f, names in by_file.items():
        with open_weights(f) as sf:
            for name in names:
                sl = sf.get_slice(name)
                infos[name] = TensorInfo(tuple(sl.get_shape()), sl.get_dtype())
    return infos


FLOAT_HEADERS = ("BF16", "F16", "F32", "F64")  # safetensors' dtype names of float tensors
INT_BYTES = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def served_bytes(ckpt_dir: str | Path) -> int:
    """The weights' size as SGLang is handed them: float tensors in bf16 (a CPU run saves fp32, a GPU run bf16),
    the vocab map as stored. What a size limit on a drafter to ship is about."""
    return sum(math.prod(info.shape) * (2 if info.dtype in FLOAT_HEADERS else INT_BYTES[info.dtype])
               for info in tensor_infos(ckpt_dir).values())


def load_tensors(ckpt_dir: str | Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    files = weight_files(ckpt_dir)
    for name in names if names is not None else list(files):
        with open_weights(files[name]) as sf:
            out[name] = sf.get_tensor(name)
    return out


def load_draft_vocab(ckpt_dir: str | Path) -> torch.Tensor:
    """The checkpoint's ``t2d`` as bool (the target ids its lm_head can propose), read without building the
    drafter; a checkpoint without one is an error naming it."""
    if "t2d" not in weight_files(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no t2d tensor; not an EAGLE-3 drafter with a draft vocab")
    return load_tensors(ckpt_dir, ["t2d"])["t2d"].bool()


def load_checkpoint(ckpt_dir: str | Path, num_target_layers: int | None = None,
                    device: str | torch.device = "cpu") -> Eagle3Drafter:
    """Load an SGLang-layout drafter (ours or AQ-MedAI's). Embeddings stay to be set from the target
    (``set_embeddings``); an ``embed_tokens.weight`` shipped in the file is ignored, as SGLang's is."""
    cfg = read_config(ckpt_dir)
    if unserved := served_function_problems(cfg):
        raise CheckpointError(f"{ckpt_dir}/config.json: {'; '.join(unserved)}")
    shape = shape_from_config(cfg, f"{ckpt_dir}/config.json", num_target_layers)
    wanted = expected_tensors(shape)
    require_layout(ckpt_dir, shape, tensor_infos(ckpt_dir), strict=False)
    # Built on the meta device and then allocated without random init: at the K2 shape the drafter holds
    # 2.4 B parameters (the frozen 163840 x 7168 embedding included) that the file overwrites anyway.
    with torch.device("meta"):
        model = Eagle3Drafter(shape)
    model = model.to_empty(device="cpu")
    model.inv_freq.copy_(rope_inv_freq(shape)[0])  # non-persistent buffers: not in the file
    model.aux_scale.fill_(1.0)  # the file's fc has any training-time scale folded in
    torch.nn.init.zeros_(model.embed_tokens.weight)  # placeholder until set_embeddings(target's)
    model.hf_config_extra = cfg
    state = load_tensors(ckpt_dir, list(wanted))
    state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
    state["embed_tokens.weight"] = model.embed_tokens.weight.detach()
    model.load_state_dict({k: v.to(model.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    return model.to(device)


def save_checkpoint(model: Eagle3Drafter, out_dir: str | Path, dtype: str = "bfloat16",
                    extra_files: dict[str, str] | None = None) -> Path:
    """Write config.json + model.safetensors (no embed_tokens), atomically."""
    if dtype not in FLOAT_DTYPE_NAMES:
        raise ValueError(f"save dtype {dtype!r}: expected one of {sorted(FLOAT_DTYPE_NAMES)}")
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    float_dtype = torch_dtype(dtype)
    state, own = {}, {**model.state_dict(), "fc.weight": model.servable_fc_weight()}
    for name, (_, kind) in expected_tensors(model.shape).items():
        t = own[name].detach().cpu()
        state[name] = t.to(float_dtype) if kind == "float" else t.to(torch.int64 if kind == "int64" else torch.bool)
    cfg = hf_config(model.shape, getattr(model, "hf_config_extra", None), dtype)
    files = {"config.json": json_text(cfg, indent=2, sort_keys=True) + "\n", **(extra_files or {})}
    tmp = fresh_tmp_dir(out_dir)
    try:
        _save_weights({k: v.contiguous() for k, v in state.items()}, tmp / WEIGHTS_NAME, out_dir / WEIGHTS_NAME)
        for name, text in files.items():
            with named_errors(out_dir / name):
                (tmp / name).write_text(text)
        swap_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk's partial copy would hold the space a rerun needs
        raise
    return out_dir


def _save_weights(state: dict[str, torch.Tensor], path: Path, name: Path) -> None:
    """safetensors' save_file, whose failed write (a full disk) is an OSError naming ``name``: safetensors raises
    its own error type for it, with the errno only in its text."""
    try:
        save_file(state, path, metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"os error (\d+)", str(e))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(name)) from None


def fingerprint(ckpt_dir: str | Path) -> str:
    """sha256 over the weight files (config excluded: it may gain harmless keys)."""
    return sha256_file(*sorted(set(weight_files(ckpt_dir).values())))


def _config_problems(cfg: dict, where: str) -> list[str]:
    p = []
    if cfg.get("architectures") != [ARCHITECTURE]:
        p.append(f"{where}: architectures is {cfg.get('architectures')}, SGLang needs [{ARCHITECTURE!r}]")
    if cfg.get("num_hidden_layers") != 1:
        p.append(f"{where}: num_hidden_layers is {cfg.get('num_hidden_layers')}, must be 1")
    if cfg.get("tie_word_embeddings") is not False:
        p.append(f"{where}: tie_word_embeddings must be false (else SGLang ties lm_head to the embedding)")
    if "rope_theta" not in cfg:
        p.append(f"{where}: rope_theta missing (older loaders ignore rope_parameters)")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not (isinstance(ids, list) and len(ids) == 3 and all(isinstance(i, int) and i >= 0 for i in ids)):
        p.append(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must list 3 layer ids, got "
                 f"{ids} (without them SGLang silently captures different layers)")
    elif unsorted := ascending_problem(ids, "eagle_config.eagle_aux_hidden_state_layer_ids"):
        p.append(f"{where}: {unsorted}")
    return p + [f"{where}: {problem}" for problem in served_function_problems(cfg)]


def weights_path(ckpt_dir: str | Path) -> Path:
    """The file an error about the weights names: the shard index of a sharded checkpoint, else model.safetensors."""
    d = Path(ckpt_dir)
    return d / INDEX_NAME if (d / INDEX_NAME).is_file() else d / WEIGHTS_NAME


def require_layout(ckpt_dir: str | Path, shape: DrafterShape, infos: dict[str, TensorInfo],
                   strict: bool = True) -> None:
    """CheckpointError unless the weights hold every tensor the config's shape needs, at its shape (and, when
    ``strict``, nothing else: SGLang silently skips a name it does not know, so a renamed weight would serve
    randomly initialised). ``load_checkpoint`` is not strict: it ignores a shipped embed_tokens, as SGLang does."""
    wanted = expected_tensors(shape)
    wrong = [f"missing tensor {name}" for name in sorted(set(wanted) - set(infos))]
    if strict:
        wrong += [f"unexpected tensor {name}" for name in sorted(set(infos) - set(wanted))]
    wrong += [f"{name} has shape {list(infos[name].shape)}, expected {list(shp)}"
              for name, (shp, _) in wanted.items() if name in infos and infos[name].shape != shp]
    if wrong:
        raise CheckpointError(f"{weights_path(ckpt_dir)}: {', '.join(wrong)} (for the shape in config.json); "
                              f"{_REDO}")


def require_finite(ckpt_dir: str | Path) -> None:
    """CheckpointError when a float tensor holds NaN or inf: nothing meaningful to measure or serve."""
    bad = nonfinite_tensors(ckpt_dir)
    if bad:
        raise CheckpointError(f"{weights_path(ckpt_dir)}: non-finite weights (NaN/inf) in {', '.join(bad)}; pick an "
                              "earlier checkpoint (training skips non-finite steps, so this one was damaged after "
                              "it was saved)")


def check_checkpoint(ckpt_dir: str | Path, check_finite: bool = True) -> list[str]:
    """Every reason SGLang would serve the drafter at ``ckpt_dir`` wrongly (its config, dtypes, vocab map): a
    drafter the gate rejects; empty when it is fine. CheckpointError (an error, not a rejection) when
    ``ckpt_dir`` is not a readable drafter checkpoint at all: no config, unreadable weights, tensors missing,
    unknown or of the wrong shape, and (``check_finite``) NaN or inf weights."""
    cfg = read_config(ckpt_dir)
    where = f"{ckpt_dir}/config.json"
    problems = _config_problems(cfg, where)
    # The aux layer ids shape no tensor: a legacy config without them (reported above) is checked all the same.
    shape = shape_from_config(cfg, where, num_target_layers=0)
    infos = tensor_infos(ckpt_dir)
    require_layout(ckpt_dir, shape, infos)
    if check_finite:
        require_finite(ckpt_dir)
    float_dtypes = set()
    for name, (_, kind) in expected_tensors(shape).items():
        info = infos[name]
        want = {"int64": {"I64"}, "bool": {"BOOL"}, "float": {"BF16", "F16", "F32"}}[kind]
        if info.dtype not in want:
            problems.append(f"{ckpt_dir}: {name} has dtype {info.dtype}, expected one of {sorted(want)}")
        if kind == "float":
            float_dtypes.add(info.dtype)
    if len(float_dtypes) > 1:
        problems.append(f"{ckpt_dir}: weights mix dtypes {sorted(float_dtypes)}")
    if problems:
        return problems
    vocab = load_tensors(ckpt_dir, ["d2t", "t2d"])
    return [f"{ckpt_dir}: {m}" for m in vocab_map_problems(vocab["d2t"], vocab["t2d"])]


def nonfinite_tensors(ckpt_dir: str | Path) -> list[str]:
    """Names of float tensors holding NaN or inf (one tensor in memory at a time)."""
    floats = [name for name, info in tensor_infos(ckpt_dir).items() if info.dtype in FLOAT_HEADERS]
    return [name for name in sorted(floats) if not torch.isfinite(load_tensors(ckpt_dir, [name])[name]).all()]

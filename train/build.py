"""The drafter to train, from what the training data says of the target: a warm start
(``drafter.init_from``) keeps its own vocab map and aux ids, which must match the data's; otherwise a
fresh drafter shaped like the target with a vocab map from the data's token counts. Mismatches are
one-line errors, before any compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from common.config import RunConfig
from drafter.factory import DrafterMismatchError, fresh_drafter, load_for_target, shape_for_target
from drafter.model import DrafterShape, Eagle3Drafter
from drafter.target_init import init_from_target
from drafter.vocab_map import build_vocab_map
from target_model.hf_index import last_layer_names, target_tensors
from target_model.hf_model import resolve_source, target_text_config
from train.data import TrainingData, to_device


def fresh_shape(cfg: RunConfig, hf: Any, aux_ids: Sequence[int]) -> DrafterShape:
    """The shape of a drafter trained from scratch: the target's (``hf``, its text config) with the config's
    drafter settings; what bench/train_loop.py times as the loop's step too."""
    d = cfg.drafter
    return shape_for_target(hf, d.draft_vocab_size, tuple(aux_ids), d.intermediate_size, d.num_attention_heads,
                            d.num_key_value_heads, d.head_dim)


def build_drafter(cfg: RunConfig, data: TrainingData) -> tuple[Eagle3Drafter, str]:
    """(drafter, how it was made)."""
    tgt, aux_ids = data.target, data.aux_layer_ids
    embed = data.head["embed_tokens.weight"]
    if cfg.drafter.init_from:  # its aux ids must be the data's: resolving them is an error otherwise
        model, _ = load_for_target(cfg.drafter.init_from, embed, tgt["num_layers"], aux_ids)
        return model, f"warm start from {cfg.drafter.init_from}"
    hf = target_text_config(cfg.target)
    if (hf.hidden_size, hf.vocab_size) != (tgt["hidden_size"], tgt["vocab_size"]):
        raise DrafterMismatchError(f"{data.source}: target hidden/vocab {tgt['hidden_size']}/"
                                   f"{tgt['vocab_size']} differ from {cfg.target.name}'s config "
                                   f"{hf.hidden_size}/{hf.vocab_size}; capture again for this target")
    d = cfg.drafter
    if d.draft_vocab_size > tgt["vocab_size"]:
        raise DrafterMismatchError(f"drafter.draft_vocab_size {d.draft_vocab_size} is larger than the target's "
                                   f"vocab_size {tgt['vocab_size']} ({data.source}); set it to at most "
                                   f"{tgt['vocab_size']}, e.g. --set drafter.draft_vocab_size={tgt['vocab_size']}")
    shape = fresh_shape(cfg, hf, aux_ids)
    d2t, t2d = build_vocab_map(data.token_counts(tgt["vocab_size"]), d.draft_vocab_size)
    model = fresh_drafter(shape, embed, d2t, t2d, seed=cfg.train.seed)
    if d.init == "random":
        return model, "from scratch, shaped like the target"
    n = tgt["num_layers"]
    set_ = init_from_target(model, target_tensors(resolve_source(cfg.target.name, cfg.target.gguf_file),
                                                  last_layer_names(n)), data.head["lm_head.weight"], n)
    return model, f"from scratch, initialised from the target ({len(set_)} tensors: {', '.join(set_)})"


AUX_SCALE_SAMPLES = 64


@torch.no_grad()
def aux_state_scales(data: TrainingData, device: torch.device, samples: int = AUX_SCALE_SAMPLES) -> Tensor:
    """(3H,) fp32 for ``drafter.aux_scale: per_state``: per aux state, sqrt(H) / its median row norm over every
    token of the first ``samples`` training samples, repeated over the state's H columns. The median, not the
    mean: a few rows carry massive activations. The same samples on every process and at
    every resume, so all of them scale alike."""
    ds = data.train.head(samples)
    norms: list[list[Tensor]] = [[], [], []]
    for raw in data.loader(ds, [[i] for i in range(len(ds))], device, 1):
        aux = data.complete(to_device(raw, device))["aux"].float()[0]  # (T, 3H): one sample, no padding
        for j, state in enumerate(aux.chunk(3, dim=-1)):
            norms[j].append(state.norm(dim=-1))
    hidden = data.target["hidden_size"]
    medians = torch.stack([torch.cat(n).median() for n in norms]).clamp_min(1e-6)
    return (hidden ** 0.5 / medians).repeat_interleave(hidden).cpu()


def scale_aux_inputs(model: Eagle3Drafter, data: TrainingData, device: torch.device) -> str:
    """``drafter.aux_scale: per_state``: the drafter's fc reads standardized aux states from here on (its function
    unchanged, ``Eagle3Drafter.set_aux_scale``); returns what was done, for the run's first line."""
    scale = aux_state_scales(data, device)
    model.set_aux_scale(scale)
    hidden = data.target["hidden_size"]
    return "fc reads the aux states scaled by " + " / ".join(f"{float(x):.3g}" for x in scale[::hidden])


def teacher_rows(data: TrainingData, model: Eagle3Drafter) -> Tensor:
    """The target lm_head rows of the draft vocab (Vd, H): the teacher never needs the other rows."""
    lm_head = data.head["lm_head.weight"]
    ids = model.to_target_ids(torch.arange(model.shape.draft_vocab_size))
    return lm_head[ids].clone()

"""Start a fresh drafter from the target's own weights instead of noise (``drafter.init: target``).

The drafter is one decoder layer shaped like the target's, reading ``[embedding, hidden]`` (2H wide)
where a target layer reads H. What carries over where the shapes allow:
- lm_head: the target head's rows of the draft vocab, and norm: the target's final norm, so the
  drafter starts out decoding hidden states the way the target does;
- the layer: the target's last layer. Its attention projections fill the hidden half of the 2H input
  (the embedding half starts at zero), o_proj, the MLP and both norms are copied as they are;
- fc: passes the top aux layer through (``[0, 0, I]``), so step 0 starts from the target's own
  residual stream near its output.
Only the safetensors tensors named here are read (``target_model.hf_index.target_tensors`` of
``last_layer_names``), never the whole target.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafter.model import Eagle3Drafter


@torch.no_grad()
def init_from_target(model: Eagle3Drafter, weights: dict[str, Tensor], lm_head: Tensor,
                     num_layers: int) -> list[str]:
    """Copy what fits (see the module docstring); returns the drafter tensors that were set."""
    h = model.shape.hidden_size
    p = f"model.layers.{num_layers - 1}."
    layer = model.midlayer
    done: list[str] = []

    def put(dst: Tensor, src: Tensor | None, name: str) -> None:
        if src is not None and tuple(src.shape) == tuple(dst.shape):
            dst.copy_(src.to(dst.dtype))
            done.append(name)

    model.lm_head.weight.copy_(lm_head[model.to_target_ids(torch.arange(model.shape.draft_vocab_size))]
                               .to(model.lm_head.weight.dtype))
    done.append("lm_head.weight")
    put(model.norm.weight, weights.get("model.norm.weight"), "norm.weight")
    for proj in ("q_proj", "k_proj", "v_proj"):
        src = weights.get(p + f"self_attn.{proj}.weight")
        dst = getattr(layer.self_attn, proj).weight  # (out, 2H): [embedding half | hidden half]
        if src is not None and tuple(src.shape) == (dst.shape[0], h):
            dst.zero_()
            dst[:, h:].copy_(src.to(dst.dtype))
            done.append(f"midlayer.self_attn.{proj}.weight")
    put(layer.self_attn.o_proj.weight, weights.get(p + "self_attn.o_proj.weight"), "midlayer.self_attn.o_proj.weight")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        put(getattr(layer.mlp, proj).weight, weights.get(p + f"mlp.{proj}.weight"), f"midlayer.mlp.{proj}.weight")
    put(layer.hidden_norm.weight, weights.get(p + "input_layernorm.weight"), "midlayer.hidden_norm.weight")
    put(layer.input_layernorm.weight, weights.get(p + "input_layernorm.weight"), "midlayer.input_layernorm.weight")
    put(layer.post_attention_layernorm.weight, weights.get(p + "post_attention_layernorm.weight"),
        "midlayer.post_attention_layernorm.weight")
    model.fc.weight.zero_()
    model.fc.weight[:, 2 * h:].copy_(torch.eye(h, dtype=model.fc.weight.dtype))
    done.append("fc.weight")
    return done

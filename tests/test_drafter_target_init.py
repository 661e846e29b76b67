"""drafter.init: target copies the target's last layer, final norm and head rows where shapes allow, and
sets fc to pass the top aux layer through; only the named tensors are read from the checkpoint."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter.factory import fresh_drafter, shape_for_target
from drafter.target_init import init_from_target
from target_model.hf_index import last_layer_names, target_tensors


def test_init_copies_what_fits_from_a_saved_target(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=50, num_hidden_layers=3, tie_word_embeddings=False)
    target = LlamaForCausalLM(cfg)
    target.save_pretrained(tmp_path, safe_serialization=True)
    weights = target_tensors(tmp_path, last_layer_names(3) + ["model.layers.0.mlp.up_proj.weight", "no.such.tensor"])
    assert "no.such.tensor" not in weights and "model.layers.0.mlp.up_proj.weight" in weights
    d2t = torch.zeros(20, dtype=torch.long)
    d2t[10:] = 25  # draft ids 10..19 are target ids 35..44
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[:10], t2d[35:45] = True, True
    drafter = fresh_drafter(shape_for_target(cfg, 20, (0, 1, 2)),
                            target.model.embed_tokens.weight.detach(), d2t, t2d)
    done = init_from_target(drafter, weights, target.lm_head.weight.detach(), 3)
    sd, last = target.state_dict(), target.model.layers[2]
    assert torch.equal(drafter.lm_head.weight[:10], sd["lm_head.weight"][:10])
    assert torch.equal(drafter.lm_head.weight[10:], sd["lm_head.weight"][35:45])
    assert torch.equal(drafter.norm.weight, sd["model.norm.weight"])
    q = drafter.midlayer.self_attn.q_proj.weight
    assert torch.equal(q[:, 32:], last.self_attn.q_proj.weight) and not q[:, :32].any()
    assert torch.equal(drafter.midlayer.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert torch.equal(drafter.midlayer.hidden_norm.weight, last.input_layernorm.weight)
    aux = torch.randn(2, 5, 96)
    assert torch.allclose(drafter.project_aux(aux), aux[..., 64:])  # fc passes the top aux layer through
    assert len(done) == 13

"""A tiny random Llama target (6 layers, hidden 32) for the target adapter's tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from target_model.hf_model import TargetModel


def tiny_target_model(max_positions: int = 128) -> TargetModel:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=max_positions,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return TargetModel(LlamaForCausalLM(cfg), tokenizer=None, name="tiny", source_dir=None)

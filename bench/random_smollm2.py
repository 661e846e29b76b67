"""A random-weight target of SmolLM2-135M-Instruct's shape: what the benchmarks time when the weights do not change
the time (the stream's decode step, the target's right-padded forward), so they need no model file."""

from __future__ import annotations

from typing import Any

import torch

# SmolLM2-135M-Instruct's shape (its config.json): the shipped config's target
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
               tie_word_embeddings=True, rms_norm_eps=1e-5)


def random_smollm2(layers: int, device: torch.device, dtype: torch.dtype) -> Any:
    """A ``LlamaForCausalLM`` of that shape with ``layers`` layers, seeded, built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with device:
        return LlamaForCausalLM(LlamaConfig(**{**SMOLLM2, "num_hidden_layers": layers})).to(dtype)

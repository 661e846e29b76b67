"""A tiny Llama target and a random drafter over its whole vocab, for the speculative engines' tests: small
enough that drafts often match, so caches are cropped and chains run past their first step."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter.factory import fresh_drafter, shape_for_target
from drafter.model import Eagle3Drafter


class TinyTokenizer:
    """What the engines read of a tokenizer: pad, EOS (None: no stop token) and no ChatML end-of-turn."""

    pad_token_id, unk_token_id = 0, None

    def __init__(self, eos_token_id: int | None = 1):
        self.eos_token_id = eos_token_id

    def convert_tokens_to_ids(self, token: str) -> None:
        return None


def tiny_target_and_drafter(vocab: int, aux: tuple[int, int, int], seed: int = 0,
                            target_std: float | None = None) -> tuple[LlamaForCausalLM, Eagle3Drafter]:
    """The target's weights at HF's init, or normal(target_std) to spread its logits; the drafter's normal(0.3)."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, vocab_size=vocab, num_hidden_layers=4, rope_theta=10000.0,
                      max_position_embeddings=512)
    target = LlamaForCausalLM(cfg).eval()
    if target_std is not None:
        for p in target.parameters():
            torch.nn.init.normal_(p, std=target_std)
    drafter = fresh_drafter(shape_for_target(cfg, vocab, aux), target.get_input_embeddings().weight.detach(),
                            torch.zeros(vocab, dtype=torch.long), torch.ones(vocab, dtype=torch.bool))
    for p in drafter.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.3)
    return target, drafter

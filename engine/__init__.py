"""Regeneration's own inference engine over the target's layers: a paged KV cache (``batched``), continuous
batching over it (``continuous_batching``), CUDA-graph decode steps (``decode_graphs``) and degenerate-loop
detection (``loops``). See engine/README.md for its design."""

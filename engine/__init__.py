"""Regeneration's own inference engine over the target's layers (``batched``, ``layer_pieces``): a paged KV cache
(``kv_cache``) and the attention over it (``attention``), continuous batching over it (``continuous_batching``, with
``stream_admission``, ``stream_decoding``, ``sizing``, ``sampling``, ``requests``, ``host_tokens``), CUDA-graph decode
steps (``decode_graphs``) and degenerate-loop detection (``loops``). See engine/README.md for its design."""

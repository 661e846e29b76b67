"""The target LLM, between ``common/`` and ``drafter/``: built with transformers (``hf_model``) or read from its
checkpoint files without building it (``hf_index``), the drafter's aux layer ids against it (``aux_layers``), its
layers over a per-row KV cache (``batched``) and continuous-batching generation on that (``continuous_batching``),
stopped at degenerate loops (``loops``). Imports ``common/`` only; nothing here knows about the drafter."""

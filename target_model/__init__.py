"""The target LLM as every backend needs it, nothing drafter-specific: built with transformers (``hf_model``),
read from its checkpoint files without building it (``hf_index``), and the drafter's aux layer ids against it
(``aux_layers``). Imports ``common/`` only."""

"""Data preparation: ingest prompts, regenerate answers with the target, capture its hidden states."""

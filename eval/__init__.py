"""Eval stage: measure a drafter by speculative decoding against its target, and gate its promotion."""

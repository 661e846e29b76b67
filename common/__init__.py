"""Run-level infrastructure that every stage shares: the run config, file helpers, dtype names and the
embedded default's wheels. Nothing here knows about the drafter."""

"""Other people's harnesses driving sparsedecode: :mod:`.lm_eval` (a model for lm-evaluation-harness)."""

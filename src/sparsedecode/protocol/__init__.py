"""The paired protocol (docs/definitions.md, section 3): the dense reference and sparse runs of the same prompts
(:mod:`.paired`), their results (:mod:`.results`), and why a run departs from dense (:mod:`.diagnostics`: the
omitted-mass audit and the margin certificate)."""

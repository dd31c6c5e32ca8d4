"""One sparse decode step, written once for every route that runs it: :mod:`.schedule` (the rules: what survives a
write, when a row selects afresh, the reuse counter, reads and the tally), :mod:`.plan` (which kernels serve a
layer call), :mod:`.rows` (a row's selection and attention, and every row in one C call) and :mod:`.device` (the
step in tensor operations only, for CUDA graphs). The session (:mod:`sparsedecode.session`) and the compiled op
(:mod:`sparsedecode.compiled.op`) hold the state; the step is the same."""

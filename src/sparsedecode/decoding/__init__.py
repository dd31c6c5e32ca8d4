"""Decoding loops: the one greedy loop every caller uses (:mod:`.loop`: prefill, one token, many tokens),
``generate`` in its three modes (:mod:`.generate`: dense, sparse, lossless) and the lossless draft-and-verify loop
(:mod:`.lossless`)."""

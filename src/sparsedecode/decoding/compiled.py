"""``generate(..., compile=True)``: greedy decoding whose decode step is compiled over a static cache
(:class:`~sparsedecode.compiled.decoder.CompiledDecoder`); lossless mode drafts with the compiled sparse step and
verifies with the decoder's dense multi-token forward."""

from __future__ import annotations

import time

from ..compiled.decoder import check_compilable, decoder_for
from ..errors import SparseDecodeError
from .loop import decode_tokens
from .lossless import StaticDrafter, lossless_loop
from .result import Generation


def generate_compiled(model, ids, mask, cfg, max_new_tokens: int, mode: str, eos_token_id, progress, compile=True,
                      drafting=None):  # fmt: skip
    """``generate(..., compile=True)`` after its checks: one :class:`~sparsedecode.decoding.generate.Generation` per
    sequence of ``ids (B, P)`` (``mask``, if any, all ones). Lossless (one prompt): the compiled sparse step drafts,
    the decoder's dense multi-token forward verifies (``drafting``: draft_tokens, adaptive, max_draft_tokens)."""
    if compile is not True:
        raise SparseDecodeError(f"generate: compile must be True or False, got {compile!r}")
    if mask is not None and not bool(mask.bool().all()):
        raise SparseDecodeError("generate: compile=True needs prompts of one length (no padding); decode without it")
    sparse_cfg = cfg if mode != "dense" else None
    check_compilable(model, sparse_cfg, "generate")
    decoder = decoder_for(model, sparse_cfg, int(ids.shape[0]), int(ids.shape[1]) + max_new_tokens)
    with decoder.installed():
        started = time.perf_counter()
        logits = decoder.prefill(ids, progress=progress)
        prefill_s = time.perf_counter() - started
        first = logits.argmax(dim=-1)
        compile_s = decoder.warm_up(first) if max_new_tokens > 1 else 0.0
        if mode == "lossless":
            result = Generation(mode, first.tolist(), prefill_s, 0.0, compile_s=compile_s)
            if first.item() != eos_token_id:
                stage = "lossless decode (compiled)"
                lossless_loop(StaticDrafter(decoder), result, max_new_tokens, **drafting, progress=progress,
                              eos_token_id=eos_token_id, stage=stage)  # fmt: skip
            return [result]
        started = time.perf_counter()
        rest, _ = decode_tokens(
            model,
            None,
            first.tolist(),
            max_new_tokens - 1,
            stop=eos_token_id,
            progress=progress,
            stage=f"{mode} decode (compiled)",
            step_fn=decoder.step,
            nll=False,
        )
        decode_s = time.perf_counter() - started
    return [
        Generation(mode, [head, *tail], prefill_s, decode_s, compile_s=compile_s)
        for head, tail in zip(first.tolist(), rest)
    ]

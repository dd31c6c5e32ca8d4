"""The lossless loop (self-speculative decoding), one for every way of drafting: rounds of ``k`` sparse drafts, one
dense forward verifying them, the longest agreeing prefix kept plus the dense model's own next token, ``k`` adapted
from the acceptance when asked. What drafts and verifies is a :class:`Drafter`: a ``sparse_decoding`` session over a
growing cache (:class:`SessionDrafter`) or a compiled decoder over a static cache (:class:`StaticDrafter`)."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from ..session.kv_cache import crop_cache, crop_rewinds, restore, snapshot
from ..step.schedule import dense_forwards
from .loop import Progress, argmax_rows, decode_one_token

MAX_DRAFT_TOKENS = 16
"""The longest draft an adaptive ``k`` grows to, unless told otherwise."""


class Drafter(Protocol):
    def draft(self, token: int, k: int) -> list[int]:
        """``k`` greedy sparse tokens after ``token``; the cache afterwards holds what it held before."""

    def verify(self, ids: list[int]) -> list[int]:
        """One dense forward over ``ids`` at the next positions, written to the cache: the argmax after each."""

    def retain(self, fed: int, kept: int) -> None:
        """Of the ``fed`` positions the last :meth:`verify` wrote, keep the first ``kept``."""


def lossless_loop(drafter: Drafter, result, max_new_tokens: int, *, draft_tokens: int, adaptive: bool,
                  max_draft_tokens: int, progress: Progress | None, eos_token_id: int | None, stage: str):  # fmt: skip
    """Extend ``result`` (a :class:`~sparsedecode.decoding.generate.Generation` holding the first token) to
    ``max_new_tokens`` tokens, or to ``eos_token_id``; its draft and verification times, acceptances and draft
    lengths are added. A result that already ends with ``eos_token_id`` (the first token) gets nothing more."""
    k = draft_tokens
    while len(result.tokens) < max_new_tokens and result.tokens[-1] != eos_token_id:
        k_now = min(k, max_new_tokens - len(result.tokens))
        begun = time.perf_counter()
        drafts = drafter.draft(result.tokens[-1], k_now)
        result.draft_s += time.perf_counter() - begun

        begun = time.perf_counter()
        dense = drafter.verify([result.tokens[-1], *drafts])
        accepted = 0
        while accepted < k_now and dense[accepted] == drafts[accepted]:
            accepted += 1
        new = [*drafts[:accepted], dense[accepted]][: max_new_tokens - len(result.tokens)]
        if eos_token_id in new:  # dense greedy decoding would stop there: so does its lossless twin
            new = new[: new.index(eos_token_id) + 1]
        result.tokens.extend(new)
        drafter.retain(k_now + 1, accepted + 1)
        result.verify_s += time.perf_counter() - begun

        result.verifications += 1
        result.accepted.append(accepted)
        result.draft_lengths.append(k_now)
        if adaptive:
            k = min(2 * k, max_draft_tokens) if accepted == k_now else max(1, k // 2) if 2 * accepted < k_now else k
        if progress:
            progress(stage, len(result.tokens), max_new_tokens)
    result.decode_s = result.draft_s + result.verify_s
    return result


class SessionDrafter:
    """Drafts inside an open ``sparse_decoding`` session on ``model`` over ``cache`` (holding ``length`` positions),
    verifies with the session's dense multi-token forward. Layers ``crop`` cannot take back (sliding windows,
    recurrent states) are copied at each round's start and restored."""

    def __init__(self, model, cache, length: int):
        self.model, self.cache, self.length = model, cache, length
        self.device = next(model.parameters()).device
        self.rewinds = crop_rewinds(cache)
        self.start = None
        self.ids = None

    def draft(self, token: int, k: int) -> list[int]:
        self.start = snapshot(self.cache)  # the round's start (copies only the layers crop cannot take back)
        drafts = []
        for _ in range(k):
            token = argmax_rows(decode_one_token(self.model, self.cache, torch.tensor([token], device=self.device))[0])
            drafts.append(token)
        restore(self.cache, self.start)
        return drafts

    def verify(self, ids: list[int]) -> list[int]:
        self.ids = torch.tensor([ids], device=self.device)
        with dense_forwards():
            logits = self.model(
                input_ids=self.ids, cache=self.cache, use_cache=True, position_ids=self._at(len(ids))
            ).logits
        return argmax_rows(logits[0])

    def _at(self, count: int) -> torch.Tensor:
        """The position ids of ``count`` tokens fed after the kept ones (given: a model may count from 0 without)."""
        return torch.arange(self.length, self.length + count, device=self.device).unsqueeze(0)

    def retain(self, fed: int, kept: int) -> None:
        if self.rewinds or kept == fed:
            crop_cache(self.cache, self.length + kept)
        else:  # sliding-window or recurrent layers cannot drop the rejected drafts: back to the round's start,
            restore(self.cache, self.start)  # then the accepted prefix again (dense, as the verification was: one
            with dense_forwards():  # token too, which the session would otherwise take for a decode step)
                self.model(input_ids=self.ids[:, :kept], cache=self.cache, use_cache=True, logits_to_keep=1,
                           position_ids=self._at(kept))  # fmt: skip
        self.length += kept


class StaticDrafter:
    """Drafts with an installed sparse :class:`~sparsedecode.compiled.decoder.CompiledDecoder`'s compiled step, verifies
    with its dense multi-token forward (eager); rejected positions are dropped by moving the decoder's position back
    (its layers' state notices and keeps only what still describes the cache)."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.device = decoder.device

    def draft(self, token: int, k: int) -> list[int]:
        start, drafts = self.decoder.position, []
        for _ in range(k):
            token = argmax_rows(self.decoder.step(torch.tensor([token], device=self.device))[0])
            drafts.append(token)
        self.decoder.position = start
        return drafts

    def verify(self, ids: list[int]) -> list[int]:
        return argmax_rows(self.decoder.extend(torch.tensor([ids], device=self.device))[0])

    def retain(self, fed: int, kept: int) -> None:
        self.decoder.position -= fed - kept

"""Greedy generation: dense, sparse, or lossless (self-speculative: sparse drafts, dense verification).

Sparse greedy decoding does not stay identical to dense decoding. Lossless mode keeps dense output and uses
sparse attention only to *guess*: the same model with sparse attention drafts ``k`` tokens; one dense forward
over the last accepted token and the ``k`` drafts verifies them; the longest prefix on which the dense argmax
agrees is accepted, plus the dense model's own next token. The KV cache is rolled back past everything the
dense pass did not confirm (draft-time keys and values, computed under sparse attention, are never kept).
TriForce and MagicDec use this scheme with sparse KV drafts.

Floating point: a ``(k+1)``-token dense forward and one-token dense steps round differently in the last bits,
so at a near-tie the verifier can pick another token than plain dense decoding would. The run cannot detect
that by itself; :func:`compare_lossless` runs plain dense greedy decoding too and reports every position where
the two differ with the dense top-1/top-2 margin there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import SparseConfig, check_config, check_named_layers
from ..errors import SparseDecodeError
from ..session import dense_attention, prefill_history, sparse_decoding
from ..session.kv_cache import GrowingCache
from ..session.session import attention_windows
from ..validate import (
    attention_modules,
    check_callable,
    check_count,
    check_model,
    check_positions,
    check_prompt_ids,
    check_sparse_attention,
    check_token_id,
)
from .loop import Progress, check_left_padded, decode_one_token, decode_tokens, left_pad, prefill
from .lossless import MAX_DRAFT_TOKENS, SessionDrafter, lossless_loop
from .result import Generation

MODES = ("dense", "sparse", "lossless")


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor | list[torch.Tensor],
    cfg: SparseConfig | None,
    max_new_tokens: int,
    *,
    mode: str = "lossless",
    draft_tokens: int | None = None,
    adaptive: bool | None = None,
    max_draft_tokens: int | None = None,
    progress: Progress | None = None,
    attention_mask: torch.Tensor | None = None,
    eos_token_id: int | None = None,
    compile: bool = False,
) -> Generation | list[Generation]:
    """Greedy generation of ``max_new_tokens`` tokens after one prompt or several; the prefill is dense.

    One prompt (``(1, P)`` ids without a mask) gives one :class:`Generation`. Several (``(B, P)`` ids, left-padded
    when ``attention_mask`` ``(B, P)`` says so; a list of ``(1, P_i)`` prompts, padded here; or one prompt with a
    mask) give one per sequence, decoded together: each as it would be alone (its own support), a sequence that
    emits ``eos_token_id`` stopping there while the others go on; timings are the batch's, the same in every result.

    ``mode="lossless"`` (one prompt) drafts ``draft_tokens`` tokens (default 4) with sparse attention (``cfg``) and
    verifies them with one dense forward; ``adaptive=True`` doubles ``k`` after a fully accepted draft (up to
    ``max_draft_tokens``, default :data:`~sparsedecode.decoding.lossless.MAX_DRAFT_TOKENS`) and halves it when fewer
    than half were accepted; the three are refused in the other modes, which draft nothing. ``"dense"`` and ``"sparse"``
    decode one token per step (:func:`~sparsedecode.decoding.loop.decode_tokens`). All modes use an in-place
    :class:`~sparsedecode.session.kv_cache.GrowingCache`. With ``eos_token_id``, generation ends once that token is
    output (the tokens end with it), in every mode. ``compile=True`` (prompts of one length): the same tokens from a
    whole decode step compiled over a static cache (:mod:`sparsedecode.compiled.decoder`; lossless: its drafts), its
    cost in ``compile_s``.
    """
    drafting = _drafting(mode, draft_tokens=draft_tokens, adaptive=adaptive, max_draft_tokens=max_draft_tokens)
    check_callable(progress, "progress", "generate")
    ids, mask, one = _generation_inputs(
        model, input_ids, cfg, max_new_tokens, mode, attention_mask, eos_token_id, tuple(drafting.values())
    )
    if compile is not False:
        from .compiled import generate_compiled

        generations = generate_compiled(
            model, ids, mask, cfg, max_new_tokens, mode, eos_token_id, progress, compile, drafting
        )
        return generations[0] if one else generations
    lengths = [ids.shape[1]] if one else mask.sum(dim=1).tolist()
    started = time.perf_counter()
    with dense_attention(model):  # dense, and unseen by a session the caller has open on this model
        cache, logits = prefill(model, ids, mask=mask, progress=progress, cache=GrowingCache(config=model.config))
    histories = None
    if mode != "dense" and cfg.selector.uses_history:
        histories = [prefill_history(model, ids[i : i + 1, ids.shape[1] - n :]) for i, n in enumerate(lengths)]
    prefill_s = time.perf_counter() - started
    first = logits.argmax(dim=-1).tolist()
    if mode == "lossless":
        drafting["progress"] = progress
        return _lossless(model, cache, ids, first[0], cfg, max_new_tokens, histories, eos_token_id, prefill_s, drafting)
    started = time.perf_counter()
    # dense even inside a session the caller has open on this model
    with dense_attention(model) if mode == "dense" else sparse_decoding(model, cfg) as session:
        if histories is not None and one:
            session.adopt_history(cache, histories[0])
        elif histories is not None:
            session.adopt_batch_history(cache, histories, [ids.shape[1] - n for n in lengths])
        rest, _ = decode_tokens(
            model,
            cache,
            first,
            max_new_tokens - 1,
            mask=mask,
            stop=eos_token_id,
            progress=progress,
            stage=f"{mode} decode",
            nll=False,
        )
    decode_s = time.perf_counter() - started
    generations = [Generation(mode, [head, *tail], prefill_s, decode_s) for head, tail in zip(first, rest)]
    return generations[0] if one else generations


def _drafting(mode: str, **given) -> dict:
    """The lossless settings, defaults filled in; any given in another mode (which drafts nothing) refused."""
    named = [name for name, value in given.items() if value is not None]
    if named and mode != "lossless":
        raise SparseDecodeError(f"generate: {', '.join(named)} apply to mode='lossless' only, not mode={mode!r}")
    if given.get("max_draft_tokens") is not None and given.get("adaptive") is not True:  # a fixed k drafts k always
        raise SparseDecodeError("generate: max_draft_tokens bounds the adaptive draft length: pass adaptive=True")
    defaults = dict(draft_tokens=4, adaptive=False, max_draft_tokens=MAX_DRAFT_TOKENS)
    return {name: defaults[name] if value is None else value for name, value in given.items()}


def _lossless(model, cache, ids, first, cfg, max_new_tokens, histories, eos_token_id, prefill_s, drafting):
    """:func:`generate`'s lossless mode from the prefilled ``cache`` and the first token."""
    if first == eos_token_id or max_new_tokens == 1:
        return Generation("lossless", [first], prefill_s, 0.0)
    result = lossless_decode(
        model,
        cache,
        int(ids.shape[1]),
        first,
        cfg,
        max_new_tokens,
        history=histories[0] if histories else None,
        eos_token_id=eos_token_id,
        **drafting,
    )
    result.prefill_s = prefill_s
    return result


def _generation_inputs(model, input_ids, cfg, max_new_tokens, mode, attention_mask, eos_token_id, drafting):
    """:func:`generate`'s checks, before the model runs: ``(ids, mask, one)``, ``mask`` ``None`` for one prompt."""
    if mode not in MODES:
        raise SparseDecodeError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    check_model(model, "generate")
    one = not isinstance(input_ids, (list, tuple)) and not (
        isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[0] > 1
    )  # anything but a list or (B, P) ids is checked (and refused) as one prompt
    if one and attention_mask is None:
        check_prompt_ids(model, input_ids, "generate")
        ids, mask = input_ids, None
    else:
        one = False
        ids, mask = _batch_prompts(model, input_ids, attention_mask, mode)
    check_count(max_new_tokens, "max_new_tokens", 1)
    if mode != "dense" and cfg is None:
        raise SparseDecodeError(f"mode {mode} needs a SparseConfig")
    if mode != "dense":
        check_sparse_attention(model, "generate")
    if cfg is not None:
        check_config(cfg, "generate")
    if mode != "dense":  # before the prefill, not as the session opens after it
        check_named_layers(cfg, attention_modules(model))
    if one:
        _check_drafting(*drafting)
    if one and mode == "lossless":
        _check_history_rounds(model, cfg, int(ids.shape[1]))
        check_causal_verify(model, "generate")
    check_token_id(model, eos_token_id, "eos_token_id", "generate")
    check_positions(model, int(ids.shape[1]), max_new_tokens, "generate")
    return ids, mask, one


def check_causal_verify(model, where: str) -> None:
    """Refuse lossless decoding for a model configured with bidirectional attention (Gemma 3's
    ``use_bidirectional_attention``): its verifying forward over the drafts would let each draft see the later ones,
    which one-token dense decoding never does, so lossless would not equal dense."""
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "use_bidirectional_attention", False):
        raise SparseDecodeError(
            f"{where}: lossless decoding verifies drafts in one forward, which this model's bidirectional attention "
            "(use_bidirectional_attention) lets see each other: it would not equal dense decoding; use mode='sparse'"
        )


def _check_history_rounds(model, cfg: SparseConfig, length: int) -> None:
    """Refuse a selector that keeps a history (H2O) in lossless mode where a sliding-window layer would take sparse
    steps inside its window: each round restores a copy of that layer (``crop`` cannot take it back), and the
    session cannot prove a copy holds the keys its history describes (the run stopped at its first draft after a
    round, naming causes that did not apply)."""
    if not cfg.selector.uses_history:
        return
    for layer, window in sorted(attention_windows(model).items()):
        layer_cfg = cfg.for_layer(layer)
        if layer not in layer_cfg.dense_layers and length < window and window > layer_cfg.effective_support:
            raise SparseDecodeError(
                f"generate: {cfg.selector.spec()} keeps a history that lossless rounds cannot carry over layer "
                f"{layer}, a sliding window of {window} the prompt ({length} tokens) is inside: each round restores "
                "a copy of it; use mode='sparse' or a selector without history"
            )


def _check_drafting(draft_tokens: int, adaptive: bool, max_draft_tokens: int) -> None:
    check_count(draft_tokens, "draft_tokens", 1)
    check_count(max_draft_tokens, "max_draft_tokens", 1)
    if not isinstance(adaptive, bool):
        raise SparseDecodeError(f"generate: adaptive must be True or False, got {adaptive!r}")
    if adaptive and max_draft_tokens < draft_tokens:
        raise SparseDecodeError(
            f"generate: max_draft_tokens ({max_draft_tokens}) is below draft_tokens ({draft_tokens}); the adaptive "
            "draft length grows from draft_tokens up to max_draft_tokens"
        )


@torch.no_grad()
def lossless_decode(
    model: torch.nn.Module,
    cache,
    length: int,
    first: int,
    cfg: SparseConfig,
    max_new_tokens: int,
    *,
    draft_tokens: int = 4,
    adaptive: bool = False,
    max_draft_tokens: int = MAX_DRAFT_TOKENS,
    progress: Progress | None = None,
    history: dict[int, torch.Tensor] | None = None,
    eos_token_id: int | None = None,
) -> Generation:
    """The lossless loop from a prefilled ``cache`` holding ``length`` positions and the first token ``first``.

    The cache is left holding the prompt and every generated token except the last (with ``eos_token_id``, which
    ends generation once it is output, it may hold verified tokens past it). ``history``: H2O's history of the
    prefill (:func:`~sparsedecode.session.prefill_history`), which an ``h2o`` draft needs.
    """
    check_causal_verify(model, "lossless_decode")
    result = Generation("lossless", [first], 0.0, 0.0)
    with sparse_decoding(model, cfg) as session:  # one session: its centroid cache lives across rounds
        if history is not None:
            session.adopt_history(cache, history)
        lossless_loop(
            SessionDrafter(model, cache, length), result, max_new_tokens, draft_tokens=draft_tokens,
            adaptive=adaptive, max_draft_tokens=max_draft_tokens, progress=progress, eos_token_id=eos_token_id,
            stage="lossless decode",
        )  # fmt: skip
    return result


@dataclass
class LosslessCheck:
    """Lossless output against plain dense greedy decoding of the same prompt."""

    equal: bool
    mismatches: list[dict]
    dense: Generation
    lossless: Generation

    def to_dict(self) -> dict:
        return {
            "equal": self.equal,
            "mismatches": self.mismatches,
            "dense": self.dense.to_dict(),
            "lossless": self.lossless.to_dict(),
        }


@torch.no_grad()
def compare_lossless(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cfg: SparseConfig,
    max_new_tokens: int,
    *,
    draft_tokens: int = 4,
    adaptive: bool = False,
    progress: Progress | None = None,
    dense: Generation | None = None,
) -> LosslessCheck:
    """Run dense and lossless generation and report every position where they differ.

    For the first differing position the dense top-1/top-2 margin (from one-token dense steps) is reported:
    a tiny margin means a floating-point near-tie, not a flaw of the scheme. Later positions are conditioned
    on different prefixes and only listed. Pass ``dense`` (a dense :class:`Generation` of the same prompt and
    length) to reuse it across settings.
    """
    if dense is None or len(dense.tokens) != max_new_tokens:
        dense = generate(model, input_ids, None, max_new_tokens, mode="dense", progress=progress)
    lossless = generate(
        model, input_ids, cfg, max_new_tokens, draft_tokens=draft_tokens, adaptive=adaptive, progress=progress
    )
    mismatches = [
        {"position": i + 1, "dense": a, "lossless": b}
        for i, (a, b) in enumerate(zip(dense.tokens, lossless.tokens))
        if a != b
    ]
    if mismatches:
        mismatches[0]["dense_margin"] = _dense_margin(model, input_ids, dense.tokens, mismatches[0]["position"])
    return LosslessCheck(not mismatches, mismatches, dense, lossless)


def _dense_margin(model: torch.nn.Module, input_ids: torch.Tensor, tokens: list[int], position: int) -> float:
    """Dense top-1 minus top-2 logit when predicting ``tokens[position - 1]`` by one-token steps."""
    with dense_attention(model):
        cache, logits = prefill(model, input_ids, cache=GrowingCache(config=model.config))
        device = next(model.parameters()).device
        for token in tokens[: position - 1]:
            logits = decode_one_token(model, cache, torch.tensor([token], device=device))
    top = logits[0].topk(2).values
    return float(top[0] - top[1])


def _batch_prompts(model, prompts, attention_mask, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids, mask`` ``(B, P)`` of several prompts (a list, padded here; or ids with their left-padded mask)."""
    if isinstance(prompts, (list, tuple)):
        if attention_mask is not None:
            raise SparseDecodeError(
                "generate: pass attention_mask with (batch, length) ids, not with a list of prompts"
            )
        for p in prompts:
            check_prompt_ids(model, p, "generate")
        ids, mask = left_pad(prompts)
    else:
        if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2:
            raise SparseDecodeError("generate: a batch is (batch, length) ids with an attention_mask, or a list")
        for i in range(prompts.shape[0]):
            check_prompt_ids(model, prompts[i : i + 1], "generate")
        ids = prompts
        if attention_mask is not None:
            check_left_padded(attention_mask)
        mask = torch.ones_like(prompts) if attention_mask is None else attention_mask.to(prompts.device)
        if mask.shape != ids.shape:
            raise SparseDecodeError(
                f"generate: attention_mask {tuple(mask.shape)} does not match ids {tuple(ids.shape)}"
            )
    if mode == "lossless" and ids.shape[0] == 1 and isinstance(prompts, (list, tuple)):
        raise SparseDecodeError(
            "lossless generation takes one (1, length) prompt, not a list of prompts: pass the prompt itself"
        )
    if mode == "lossless" and ids.shape[0] == 1:
        raise SparseDecodeError(
            "lossless generation takes one unpadded (1, length) prompt without attention_mask: drop the padding "
            "and the mask"
        )
    if mode == "lossless":
        raise SparseDecodeError(
            "lossless generation runs one sequence at a time (per-sequence acceptance and rollback are not "
            "implemented for batches): pass a (1, length) prompt, or use mode='sparse' or 'dense'"
        )
    return ids, mask

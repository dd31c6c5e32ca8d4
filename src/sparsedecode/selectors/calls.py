"""How the library calls a selector's code and takes what it returns: user code is handed copies and checked for
writes into them (:func:`call_selector`), scores are checked (:func:`checked_scores`), a step's support count per
head is checked against ``per_query_head`` (:func:`support_rows`). Every route that scores (the session, the compiled
op, vLLM's pages, a built-in that calls another selector: Twilight's base) goes through here.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import USER_CODE_FAILURES, SparseDecodeError, failure, one_line
from ..layout import BlockLayout
from ..validate import finite_sum
from .base import BlockSelector, Selector, library_code

SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)
"""The dtypes a selector's scores may have (half precision widened to float32; nothing else ranks: float8 has no
``topk``, and unsigned or boolean scores are no scores)."""


class _Spec:
    """A selector's spec, made when it is formatted."""

    def __init__(self, selector: Selector):
        self.selector = selector

    def __format__(self, spec: str) -> str:
        return format(self.selector.spec(), spec)


def checked_scores(selector: Selector, scores, shape: tuple[int, int], what: str, device: torch.device) -> torch.Tensor:
    """The selector's scores, checked: a tensor of ``shape`` on ``device``, numbers, finite. Half-precision scores
    are widened to float32; float32, float64 and integer scores are ranked as they are (a cast to float32 would tie
    float64 scores that differ below its precision and overflow large finite ones)."""
    name = _Spec(selector)  # written only into an error: a parameter's text (a tensor's) costs at every step
    if not isinstance(scores, torch.Tensor):
        raise SparseDecodeError(f"selector {name}: {what} returned {type(scores).__name__}, not a tensor")
    if scores.is_nested:
        raise SparseDecodeError(f"selector {name}: {what} returned a nested tensor; return a dense one")
    if tuple(scores.shape) != shape:
        raise SparseDecodeError(f"selector {name}: {what} returned shape {tuple(scores.shape)}, expected {shape}")
    if scores.device != device:
        raise SparseDecodeError(
            f"selector {name}: {what} returned scores on device {scores.device}, expected {device} (the keys')"
        )
    if scores.layout != torch.strided:
        raise SparseDecodeError(f"selector {name}: {what} returned a {scores.layout} tensor; return a dense one")
    if scores.dtype not in SCORE_DTYPES:
        kinds = ", ".join(str(t).replace("torch.", "") for t in SCORE_DTYPES)
        raise SparseDecodeError(f"selector {name}: {what} returned {scores.dtype} scores; return one of: {kinds}")
    if scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    if not finite_sum(scores):
        bad = int((~torch.isfinite(scores)).sum())
        raise SparseDecodeError(
            f"selector {name}: the {what} scores hold NaN or infinite values ({bad}; NaN ranks nowhere): a NaN or "
            "infinite query or key gives them too"
        )
    return scores


def support_rows(selector: Selector, query_heads: int, kv_heads: int) -> int:
    """How many supports a step of ``selector`` has (:meth:`~sparsedecode.selectors.base.Selector.rows`), checked:
    one per query head where it declares ``per_query_head``, else one per KV head; an override of ``rows`` that says
    otherwise is refused in one line naming it (every table and kernel sizes its rows by this)."""
    rows = selector.rows(query_heads, kv_heads)
    expected = query_heads if selector.per_query_head else kv_heads
    if type(rows) is not int or rows != expected:
        per = "query head: it declares per_query_head" if selector.per_query_head else "KV head; declare per_query_head"
        raise SparseDecodeError(
            f"selector {selector.spec()}: rows({query_heads}, {kv_heads}) returned {rows!r}, expected {expected} (one "
            f"support per {per})"
        )
    return rows


def trusted(selector: Selector, method) -> bool:
    """Whether ``method`` of ``selector`` is the library's own code (a built-in's, or the protocol's default) on a
    built-in selector: it is handed the library's tensors themselves. Anything else (a user's class, a user's subclass
    of a built-in, whose inherited methods may call what it overrides) is handed copies (:func:`call_selector`)."""
    # a user's subclass of a built-in is a user's class: a built-in method of it may call any method it overrides
    return library_code(getattr(method, "__func__", method)) and library_code(type(selector))


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, torch.Tensor)]
    return []


def _copy(value):
    """A copy a selector may do anything to; made outside ``inference_mode`` so that it has a version counter."""
    with torch.inference_mode(False):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, dict):
            return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    return value


def _versions(values) -> list[int | None]:
    return [None if t.is_inference() else t._version for value in values for t in _tensors(value)]


def call_selector(selector: Selector, method, *inputs, layout=None):
    """``method(*inputs, layout)``, run so that the selector cannot change what other rows see.

    Code that is not the library's is handed copies of the tensors (queries, keys, block statistics, history, the
    scores a budget reads), and the library keeps a copy of a tensor it returns: whatever it does to them stays its
    own. Every call's inputs are checked by their version
    counters afterwards, and a selector that wrote into them in place is refused in one line naming it (its scores
    came from inputs it changed). A failure inside the selector is one line naming it too. The copies cost one pass
    over what the selector reads; built-ins, and the kernels' own scoring, are handed the tensors themselves.
    """
    own = trusted(selector, method)
    if not own:  # copies, the layout too (frozen, but object.__setattr__ writes into it)
        inputs = tuple(_copy(value) for value in inputs)
        layout = dataclasses.replace(layout) if dataclasses.is_dataclass(layout) else layout
    before = _versions(inputs)
    try:
        result = method(*inputs, layout)
    except SparseDecodeError as error:
        if own and "\n" not in str(error):
            raise
        named = "" if own else f"selector {selector.spec()} failed in {method.__name__}: "
        raise SparseDecodeError(named + one_line(error)) from None  # one line, whatever the selector wrote
    except USER_CODE_FAILURES as error:  # a user's selector failing is one line naming it
        raise SparseDecodeError(f"selector {selector.spec()} failed in {method.__name__}: {failure(error)}") from None
    if _versions(inputs) != before:
        raise SparseDecodeError(
            f"selector {selector.spec()} wrote into the tensors it was handed in {method.__name__} (an in-place "
            "operation such as mul_ or a slice assignment); a selector must only read its inputs: copy them first"
        )
    if not own and isinstance(result, torch.Tensor) and result.layout == torch.strided and not result.is_nested:
        result = _copy(result)  # the selector may keep what it returned and write into it later (in its budget)
    return result


def scores_from(selector: BlockSelector, queries, reads, layout: BlockLayout, kv_heads: int, device) -> torch.Tensor:
    """The selector's checked scores from what it reads, already assembled: its block statistics (a dict of ``(kv,
    n_blocks, d)``, the short last block included) or the keys ``(kv, N, d)``. Every route's scoring: the session's
    and the compiled op's (through :func:`block_scores`) and vLLM's paged cache
    (:mod:`sparsedecode.integrations.vllm`), which assembles the statistics from its pages."""
    scores = call_selector(selector, selector.score_blocks, queries, reads, layout=layout)
    rows = support_rows(selector, queries.shape[0], kv_heads)
    return checked_scores(selector, scores, (rows, layout.n_blocks), "score_blocks", device)

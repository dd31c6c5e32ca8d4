"""Sparse decode attention, hooked into transformers through its front door.

This is the one module that knows about transformers' attention plumbing (docs/definitions.md, section 7). We register
one attention function under the name ``"sparsedecode"`` with ``AttentionInterface`` (and transformers'
SDPA mask builder under the same name with ``AttentionMaskInterface``, without which prefill that continues
a cache and padding masks silently break). The function is dense SDPA unless a :class:`SparseSession` that
owns the calling module is active in the current context (a ``contextvars.ContextVar``, so threads and
asyncio tasks do not see each other's sessions). Inside a session:

* prefill and any multi-token forward stay dense (SDPA);
* a decode step (one query token) with ``N <= effective support`` is dense SDPA, bit for bit;
* a longer decode step selects blocks from cached block centroids, gathers the kept keys and values
  (anchor + chosen blocks + window) and attends over those alone, in float32.

A session keeps per-layer state between calls (the selection being reused, the block-centroid cache, H2O's
attention history, the positions read). :class:`LayerState` says why that state can never describe keys that are
no longer in the cache, at a cost of O(1) per layer and step.

The package: :mod:`.hf` (transformers glue), :mod:`.session` and :mod:`.state` (session and per-layer state),
:mod:`.forward` (a forward of one sequence or a padded batch, each sequence in its own coordinates), :mod:`.rows`
(one layer's sparse step over a batch of rows, a sequence alone being a batch of one), :mod:`.kv_cache` (a cache that
appends in place, rewinding); attention over a support is :mod:`sparsedecode.kernels.reference`.
"""

from ..kernels.reference import attend_positions, attend_support, dense_short_forward
from ..validate import UNSUPPORTED_ARGUMENTS
from .hf import (
    ATTENTION_NAME,
    PREFILL_CHUNK,
    dense_attention,
    prefill_history,
    register,
    sparse_attention_forward,
    sparse_decoding,
)
from .rows import sparse_decode_step, sparse_rows
from .session import SparseSession
from .state import KeyMark, LayerState, StepView

__all__ = [
    "ATTENTION_NAME",
    "PREFILL_CHUNK",
    "UNSUPPORTED_ARGUMENTS",
    "KeyMark",
    "LayerState",
    "SparseSession",
    "StepView",
    "attend_positions",
    "attend_support",
    "dense_attention",
    "dense_short_forward",
    "prefill_history",
    "register",
    "sparse_attention_forward",
    "sparse_decode_step",
    "sparse_decoding",
    "sparse_rows",
]

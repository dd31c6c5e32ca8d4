"""A sparse session: one activation of sparse decoding on one model (:class:`SparseSession`), and the context
variable that says which sessions own which attention modules in the current thread or task."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import Cache

from ..config import SparseConfig
from ..errors import SparseDecodeError
from ..selectors.statistics import BlockStatistics
from ..step.plan import StepPlan
from .kv_cache import seq_length
from .state import LayerState, StepView

ACTIVE_SESSIONS: contextvars.ContextVar[dict[int, tuple[SparseSession, LayerState]] | None] = contextvars.ContextVar(
    "sparsedecode_active", default=None
)
"""Per thread / asyncio task: attention module id -> (the session owning it, that layer's state)."""


_CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value")


def _cache_argument(args: tuple, kwargs: dict) -> object | None:
    for name in _CACHE_ARGUMENTS:
        if kwargs.get(name) is not None:
            return kwargs[name]
    return next((arg for arg in args if isinstance(arg, Cache)), None)


def _layer_of(module: torch.nn.Module) -> int:
    return int(getattr(module, "layer_idx", 0) or 0)


def attention_windows(model: torch.nn.Module | None) -> dict[int, int]:
    """The layers of ``model`` whose attention sees a window of the sequence, with its size, as transformers' caches
    read the config (``layer_types``, else ``sliding_window`` / ``attention_chunk_size`` for every layer): a sliding
    or chunked layer's cache and mask hold that window alone. Empty where the config says none (or cannot be read)."""
    config = getattr(model, "config", None)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        text = config.get_text_config(decoder=True)
        _, per_layer = get_layer_types_and_kwargs(text)
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}
    windows = {layer: kwargs.get("sliding_window") for layer, kwargs in enumerate(per_layer)}
    return {layer: int(window) for layer, window in windows.items() if isinstance(window, int) and window > 0}


@dataclass
class SparseSession:
    """One activation of sparse decoding on one model; see :func:`sparse_decoding`.

    Attributes:
        config: the settings in force.
        sparse_steps / dense_steps: decode-step layer calls that ran sparse, or dense because
            ``N <= effective support`` (or the layer is a sliding-window layer, or one of ``dense_layers``).
        track_reads: record which distant positions each layer and KV head read (for
            :meth:`unique_distant_positions`); off by default to keep the decode step lean.
        observers: callables receiving a :class:`StepView` after every sparse step (the audit uses this;
            with none registered nothing beyond the support is ever read).
    """

    config: SparseConfig
    model: torch.nn.Module
    sparse_steps: int = 0
    dense_steps: int = 0
    track_reads: bool = False
    observers: list[Callable[[StepView], None]] = field(default_factory=list)
    layers: dict[int, LayerState] = field(default_factory=dict)
    sequence_steps: dict[int, list[int]] = field(default_factory=dict)
    """Per sequence of a batch: ``[sparse_steps, dense_steps]`` (the totals above count every sequence)."""
    extents: tuple | None = field(default=None, repr=False)
    closed: bool = field(default=False, repr=False)
    """Set when its ``with`` block ends; sessions exited out of order never bring back a closed one's layers."""
    plans: dict = field(default_factory=dict, repr=False)
    """The sparse step's kernel plans by kind of tensors (:func:`~sparsedecode.step.plan.plan_step`)."""
    plan: StepPlan | None = field(default=None, repr=False)
    """A plan that serves every sparse step instead of the one planned per kind of tensors (tests compare the
    routes of a step so; an insisted-on kernel is ``SparseConfig.kernel``)."""

    windows: dict[int, int] | None = field(default=None, repr=False)
    """Per layer, the attention window transformers' caches and masks give it (:func:`attention_windows`), read
    from the model's config on first use."""

    support_reads: dict[int, list] = field(default_factory=dict)
    """Per sequence: ``[total, count, min, max]`` of the positions each KV head read at a sparse step (recorded with
    ``track_reads``); an adaptive budget makes them vary."""

    def note_support(self, sequence: int, sizes: torch.Tensor) -> None:
        """Positions read by each KV head ``(kv,)`` at one sparse step of one layer of ``sequence``."""
        total, count, low, high = self.support_reads.get(sequence, (0, 0, None, None))
        values = [int(v) for v in sizes.tolist()]
        low = min(values) if low is None else min(low, *values)
        high = max(values) if high is None else max(high, *values)
        self.support_reads[sequence] = [total + sum(values), count + len(values), low, high]

    def support_read(self, sequence: int = 0) -> dict:
        """``support_read_mean / min / max``: positions a KV head read per sparse step (``None`` without any)."""
        total, count, low, high = self.support_reads.get(sequence, (0, 0, None, None))
        return {
            "support_read_mean": total / count if count else None,
            "support_read_min": low,
            "support_read_max": high,
        }

    def layer_window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding (or chunked) attention window from the model's config, ``None`` for a layer that
        attends fully: for a model whose attention call is not told its window (Qwen2-MoE, PhiMoE pass no
        ``sliding_window``), whose mask and cache still hold that window alone."""
        if self.windows is None:
            self.windows = attention_windows(self.model)
        return self.windows.get(layer)

    def layer_state(self, module: torch.nn.Module) -> LayerState:
        layer = _layer_of(module)
        state = self.layers.get(layer)
        if state is None:
            kinds = self.config.selector.cached_statistics()
            state = self.layers[layer] = LayerState(layer, BlockStatistics(self.config.block_size, kinds))
        return state

    def look(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of every attention module the session owns (see :meth:`LayerState.look`)."""
        active = ACTIVE_SESSIONS.get()
        entry = active.get(id(module)) if active else None
        if entry is not None and entry[0] is self:
            entry[1].look(_cache_argument(args, kwargs))
            return
        # a forward this session does not see (dense_attention, a nested session) may write its cache: under
        # torch.inference_mode no version counter would show the write
        state = self.layers.get(_layer_of(module))
        if state is not None:
            state.unseen_forward(_cache_argument(args, kwargs))

    def _states(self, sequence: int | None) -> list[LayerState]:
        states = [s for _, s in sorted(self.layers.items())]
        if sequence is None:
            return states
        return [s.rows[sequence] if s.rows is not None and sequence < len(s.rows) else s for s in states]

    def unique_distant_positions(self, sequence: int | None = None) -> torch.Tensor:
        """Distinct distant positions of the current sequence read so far, per (layer, KV head): ``(layers, kv)``.

        A position read at several steps (dense or sparse) counts once, so no entry exceeds ``N - W - 1``. In a
        batch, ``sequence`` names the sequence (its own positions). Where layers have different numbers of KV heads
        (Gemma 4's full layers with ``attention_k_eq_v``), one row ``(1, all KV heads)`` of every layer's heads.
        """
        rows = [s.reads.sum(dim=1).cpu() for s in self._states(sequence) if s.reads is not None]
        if len({len(row) for row in rows}) > 1:
            return torch.cat(rows).unsqueeze(0)
        return torch.stack(rows) if rows else torch.zeros(0, 0, dtype=torch.long)

    def centroid_bytes(self, sequence: int | None = None) -> int:
        """Bytes held by the block-centroid caches of all layers (of one sequence of a batch with ``sequence``;
        of every sequence without it)."""
        if sequence is not None:
            return sum(s.centroids.nbytes for s in self._states(sequence))
        return sum(s.centroids.nbytes + sum(r.centroids.nbytes for r in s.rows or ()) for s in self.layers.values())

    def attention_history(self) -> dict[int, torch.Tensor]:
        """H2O's history per layer ``(kv, N)``: what the session's forwards so far (a prefill) paid each position."""
        return {
            layer: s.history[:, : s.seen].clone()
            for layer, s in self.layers.items()
            if s.history is not None and s.history_complete
        }

    def adopt_history(self, cache: Cache, history: dict[int, torch.Tensor]) -> None:
        """Take ``history`` (from :meth:`attention_history` of a session that ran the same prefill) as H2O's history
        of the sequence ``cache`` holds now; the caller vouches that it holds that prefill. Other state is dropped.
        """
        for layer, received in history.items():
            state = self.layers.get(layer)
            if state is None:
                continue
            length = self._history_length(cache, layer)
            if received.shape[1] != length:
                raise SparseDecodeError(
                    f"layer {layer}: the history covers {received.shape[1]} positions, the cache holds {length}"
                )
            keys = cache.layers[layer].keys
            state.forget()
            state.history = received.to(device=keys.device, dtype=torch.float32).clone()
            state.end(keys, length)

    def _history_length(self, cache: Cache, layer: int) -> int:
        """The positions layer ``layer``'s own cache holds, which a history adopted for it must cover; a layer that
        reads another layer's cache (Gemma 3n's KV-shared layers hold a placeholder with no length) is refused."""
        if not hasattr(cache.layers[layer], "get_seq_length"):
            raise SparseDecodeError(
                f"{self.config.selector.spec()} keeps the attention each layer's cached positions received, and layer "
                f"{layer} reads another layer's cache (a KV-shared layer), which it cannot follow; use a block selector"
            )
        return seq_length(cache, layer)

    def adopt_batch_history(self, cache: Cache, histories: list[dict[int, torch.Tensor]], pads: list[int]) -> None:
        """:meth:`adopt_history` for a left-padded batch: ``histories[i]`` is sequence ``i``'s (its own positions,
        from :func:`prefill_history` of its prompt alone), ``pads[i]`` where it starts in the cache."""
        pads = tuple(int(p) for p in pads)
        if pads == (0,):  # one unpadded sequence: its rows are the layers' own states (LayerState.rows_for)
            self.adopt_history(cache, histories[0])
            return
        for layer, state in self.layers.items():
            if not all(layer in h for h in histories):
                continue
            length = self._history_length(cache, layer)
            keys = cache.layers[layer].keys
            state.forget()
            rows = state.batch_rows(pads)
            for i, (row, pad) in enumerate(zip(rows, pads)):
                received = histories[i][layer]
                if received.shape[1] != length - pad:
                    raise SparseDecodeError(
                        f"layer {layer}, sequence {i}: the history covers {received.shape[1]} positions, the cache "
                        f"holds {length - pad}"
                    )
                row.history = received.to(device=keys.device, dtype=torch.float32).clone()
                row.end_row(length - pad)
            state.end(keys, length)

    def reset(self) -> None:
        """Forget all per-generation state (selections, centroids, history, read counts)."""
        for state in self.layers.values():
            state.forget()

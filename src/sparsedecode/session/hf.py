"""The transformers glue (docs/definitions.md, section 7): the attention function registered with
``AttentionInterface`` (and transformers' SDPA mask builder under the same name with ``AttentionMaskInterface``), the
``sparse_decoding`` and ``dense_attention`` context managers, and H2O's prefill history."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..config import SparseConfig, check_config, check_named_layers, config_from_overrides
from ..errors import SparseDecodeError
from ..selectors.methods.h2o import H2O
from ..step.schedule import dense_forwards
from ..validate import attention_modules, check_attention_arguments, check_model, check_sparse_attention
from .forward import session_forward
from .session import ACTIVE_SESSIONS, SparseSession

ATTENTION_NAME = "sparsedecode"

_SWITCH_LOCK = threading.Lock()
_MODEL_USERS: dict[int, tuple[int, str]] = {}


def sparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: dense SDPA, or sparse decode inside an active session."""
    active = ACTIVE_SESSIONS.get()
    entry = active.get(id(module)) if active else None
    if entry is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    session, state = entry
    check_attention_arguments(kwargs, "sparse decoding")
    if dropout:
        raise SparseDecodeError(
            f"sparse decoding does not apply attention dropout ({type(module).__name__} is in training mode with "
            f"dropout {dropout}; its sparse steps and short forwards would leave it out): call model.eval() first"
        )
    if _biased(attention_mask):
        raise SparseDecodeError(
            f"sparse decoding does not support an additive bias in the attention mask ({type(module).__name__}'s "
            "mask holds finite values other than 0, as ALiBi's does): the sparse step and the session's dense "
            "forwards would leave it out"
        )
    return session_forward(session, state, module, query, key, value, attention_mask, dropout, scaling, kwargs)


def _biased(mask) -> bool:
    """Whether a float attention mask adds a bias where it lets a query attend (a position bias such as ALiBi): a
    mask of 0 and -inf (or a boolean one) only allows or forbids. One row is read, the last query's: cheap at
    every call, and a bias shows there as anywhere."""
    if not isinstance(mask, torch.Tensor) or not mask.is_floating_point() or mask.numel() == 0:
        return False
    row = mask[..., -1, :]
    low = torch.finfo(mask.dtype).min  # transformers' float masks forbid with the dtype's minimum, or -inf
    return bool(((row != 0) & torch.isfinite(row) & (row != low)).any())


_NAMES: set[str] = set()


def register_attention(name: str, function) -> None:
    """Register ``function`` as transformers attention implementation ``name``, with SDPA's mask builder (once per
    name)."""
    if name not in _NAMES:
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
        _NAMES.add(name)


def register() -> None:
    """Register the sparse attention function and its mask builder with transformers (idempotent)."""
    register_attention(ATTENTION_NAME, sparse_attention_forward)


def check_switch_held(model: torch.nn.Module, what: str) -> None:
    """Refuse ``model`` when its attention is this library's while no session (in any thread) holds it: a copy made
    inside a session (``copy.deepcopy`` copies the switch, and nothing switches the copy back)."""
    with _SWITCH_LOCK:
        held = id(model) in _MODEL_USERS
    if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME and not held:
        raise SparseDecodeError(
            f"{what}: {type(model).__name__}'s attention is routed through sparsedecode, yet no session holds it (a "
            "copy made inside a session keeps that): call model.set_attn_implementation('sdpa') (or 'eager') first"
        )


def _switch_on(model: torch.nn.Module) -> None:
    with _SWITCH_LOCK:
        users, previous = _MODEL_USERS.get(id(model), (0, model.config._attn_implementation))
        if users == 0 and previous != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
            if model.config._attn_implementation != ATTENTION_NAME:
                raise SparseDecodeError(
                    f"{type(model).__name__} does not use transformers' attention interface; "
                    "sparse decoding cannot hook into it"
                )
        _MODEL_USERS[id(model)] = (users + 1, previous)


def _switch_off(model: torch.nn.Module) -> None:
    with _SWITCH_LOCK:
        users, previous = _MODEL_USERS[id(model)]
        if users == 1:
            del _MODEL_USERS[id(model)]
            if previous != ATTENTION_NAME:
                model.set_attn_implementation(previous)
        else:
            _MODEL_USERS[id(model)] = (users - 1, previous)


@contextlib.contextmanager
def sparse_decoding(model: torch.nn.Module, config: SparseConfig | None = None, **overrides) -> Iterator[SparseSession]:
    """Decode with sparse attention inside the ``with`` block; restore the model afterwards.

    ``config`` (or keyword overrides of :class:`SparseConfig` fields) sets the support. Prefill stays dense.
    Works with ``model.generate`` and with manual loops over a ``DynamicCache`` (or any cache), across prompts,
    crops and rollbacks: a forward pre-hook on each attention module (removed on exit) lets the session check the
    cache before every append, so its state never outlives the keys it describes (see :class:`LayerState`).
    Sessions are per context (thread / asyncio task); nested sessions on different models are independent.

    Example::

        cfg = SparseConfig(support=193)
        with sparse_decoding(model, cfg) as session:
            out = model.generate(input_ids, max_new_tokens=64, do_sample=False)
    """
    check_model(model, "sparse_decoding", generates=False)  # a session only hooks the attention layers
    if config is None:
        config = config_from_overrides(overrides)
    elif overrides:
        raise SparseDecodeError("pass either a SparseConfig or keyword overrides, not both")
    check_config(config, "sparse_decoding")
    check_sparse_attention(model, "sparse_decoding")
    register()
    session = SparseSession(config=config, model=model)
    modules = attention_modules(model)
    if not modules:
        raise SparseDecodeError(f"{type(model).__name__} has no attention layers with a layer_idx to hook into")
    check_named_layers(config, modules)
    owned = {id(module): (session, session.layer_state(module)) for module in modules}
    _switch_on(model)
    hooks = [module.register_forward_pre_hook(session.look, with_kwargs=True) for module in modules]
    active = ACTIVE_SESSIONS.get() or {}
    mine = {**active, **owned}
    token = ACTIVE_SESSIONS.set(mine)
    try:
        yield session
    finally:
        session.closed = True
        _leave(token, mine, active, owned)
        for hook in hooks:
            hook.remove()
        _switch_off(model)


def _leave(token, mine: dict, before: dict, owned: dict) -> None:
    """A session's layers leave the sessions in force. Last in, first out: as they were before it. Exited out of
    order (``__exit__`` called by hand; a session entered after it still open): only its own layers go, an open
    session's that it covered come back, and no closed session's."""
    current = ACTIVE_SESSIONS.get() or {}
    if current is mine:
        ACTIVE_SESSIONS.reset(token)
        if all(not entry[0].closed for entry in (ACTIVE_SESSIONS.get() or {}).values()):
            return
        current = ACTIVE_SESSIONS.get() or {}
    kept = {key: entry for key, entry in current.items() if owned.get(key) is not entry and not entry[0].closed}
    kept.update({key: before[key] for key in owned if key not in kept and key in before and not before[key][0].closed})
    ACTIVE_SESSIONS.set(kept or None)


@contextlib.contextmanager
def dense_attention(model: torch.nn.Module) -> Iterator[None]:
    """Dense attention for ``model`` inside the block, even within a :func:`sparse_decoding` session on it.

    The library's dense passes (dense references, ``generate(mode="dense")``) run under it, so a session the caller
    has open does not make them sparse. Sessions on other models, and sessions opened inside the block, are
    unaffected."""
    active = ACTIVE_SESSIONS.get()
    if not active:
        yield
        return
    own = {id(module) for module in model.modules()}
    token = ACTIVE_SESSIONS.set({key: entry for key, entry in active.items() if key not in own} or None)
    try:
        yield
    finally:
        ACTIVE_SESSIONS.reset(token)


PREFILL_CHUNK = 1024
"""Tokens per forward of :func:`prefill_history` (the chunk :func:`~sparsedecode.decoding.loop.prefill` uses)."""


@torch.no_grad()
def prefill_history(model: torch.nn.Module, prompt_ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """H2O's history of a prompt: per layer ``(kv_heads, P)``, the attention each position received from the
    prompt's queries during a dense prefill, summed over each GQA group.

    Runs one more dense prefill (into a scratch cache), for a cache that was prefilled outside any session: give
    the result to :meth:`SparseSession.adopt_history`. Attention probabilities are taken in bounded chunks.
    """
    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    with sparse_decoding(model, SparseConfig(selector=H2O())) as recorder, dense_forwards():  # a last chunk of one too
        for start in range(0, prompt_ids.shape[1], PREFILL_CHUNK):
            chunk = prompt_ids[:, start : start + PREFILL_CHUNK].to(device)
            model(input_ids=chunk, cache=cache, use_cache=True, logits_to_keep=1)
    return recorder.attention_history()

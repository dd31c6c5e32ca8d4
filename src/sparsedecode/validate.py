"""Argument checks shared by the library's entry points, run at call time, before any expensive work.

Every check raises :class:`~sparsedecode.errors.SparseDecodeError` with one line that names the argument and
says what was expected, so a wrong type, a non-finite tensor or a context past the model's positions fails at
the call instead of deep inside transformers (an ``AttributeError``) or, worse, not at all (a silent selection).
"""

from __future__ import annotations

import functools
import inspect
import math
import threading

import torch

from .errors import NONFINITE_SCORES, SparseDecodeError


def _name(value: object) -> str:
    return "None" if value is None else type(value).__name__


def check_model(model: object, where: str, *, generates: bool = True) -> None:
    """``model`` is a torch module with a transformers ``config`` (what ``load_model`` returns); with ``generates``
    (every entry point that decodes tokens), one with a language-model head: transformers' ``can_generate()``, which
    a base model (``LlamaModel``), a classifier or a masked LM answers False."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise SparseDecodeError(
            f"{where}: model must be a transformers causal LM (a torch.nn.Module with a config), got {_name(model)}"
        )
    can_generate = getattr(model, "can_generate", None)
    if generates and callable(can_generate) and not can_generate():
        raise SparseDecodeError(
            f"{where}: {type(model).__name__} cannot generate text (no causal language-model head); load the model "
            "as a causal LM (sparsedecode.load_model, or AutoModelForCausalLM)"
        )
    check_not_compiled_elsewhere(model, where)
    own_cache = getattr(type(model), "_supports_default_dynamic_cache", None)
    if generates and callable(own_cache) and not own_cache():
        raise SparseDecodeError(
            f"{where}: {type(model).__name__} keeps a cache of its own kind (transformers gives it no DynamicCache), "
            "and sparsedecode decodes over caches of the standard kind; this model cannot be decoded here"
        )


_COMPILED_OWNERS: dict[int, list[int]] = {}
"""Models installed for compiled decoding: ``id(model) -> [thread ident, installs]`` (the install swaps the model's
attention for every thread, so no other thread may decode it meanwhile)."""
_OWNERS_LOCK = threading.Lock()


def claim_compiled(model: torch.nn.Module, where: str) -> None:
    """This thread installs ``model`` for compiled decoding (again, nested, in the same thread is fine); refused in one
    line while another thread decodes it compiled."""
    with _OWNERS_LOCK:
        owner = _COMPILED_OWNERS.setdefault(id(model), [threading.get_ident(), 0])
        if owner[0] != threading.get_ident():
            raise SparseDecodeError(_BUSY.format(where=where))
        owner[1] += 1


def release_compiled(model: torch.nn.Module) -> None:
    with _OWNERS_LOCK:
        owner = _COMPILED_OWNERS.get(id(model))
        if owner is not None:
            owner[1] -= 1
            if owner[1] <= 0:
                del _COMPILED_OWNERS[id(model)]


def check_not_compiled_elsewhere(model: object, where: str) -> None:
    """Refuse ``model`` while another thread has it installed for compiled decoding (its attention is swapped for
    every thread then: decoding it here would run the other thread's step)."""
    owner = _COMPILED_OWNERS.get(id(model))
    if owner is not None and owner[0] != threading.get_ident():
        raise SparseDecodeError(_BUSY.format(where=where))


_BUSY = (
    "{where}: another thread is decoding this model compiled (which swaps its attention for every thread): one "
    "thread per model meanwhile; give each thread its own copy of the model, made before (a copy made meanwhile keeps "
    "the swapped attention)"
)


def check_callable(value: object, name: str, where: str) -> None:
    """``value`` is ``None`` or something to call (a hook, a progress callback): refused at once, not after a
    prefill."""
    if value is not None and not callable(value):
        raise SparseDecodeError(f"{where}: {name} must be callable or None, got {_name(value)}")


def check_count(value: object, name: str, minimum: int) -> None:
    """``value`` is an ``int`` (not a bool, not a float) of at least ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SparseDecodeError(f"{name} must be an integer >= {minimum} (got {value!r})")


def _text_config(model: torch.nn.Module):
    """The config of the model's language part (a multimodal config holds it apart)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


EXTENDING_ROPE = ("linear", "yarn", "longrope", "llama3")
"""RoPE scalings that extend a model's context by their ``factor`` over ``original_max_position_embeddings`` (the
way Qwen2.5's long-context setting extends it without changing ``max_position_embeddings``); ``dynamic`` (NTK)
scales for any length, so it sets no limit."""


def max_positions(model: torch.nn.Module) -> int | None:
    """How many positions the model serves (``None`` when its config does not say, or its RoPE scales for any
    length): ``max_position_embeddings``, or where a RoPE scaling of :data:`EXTENDING_ROPE` is set, ``factor`` times
    ``original_max_position_embeddings`` if that is more."""
    text = _text_config(model)
    limit = getattr(text, "max_position_embeddings", None)
    if not (isinstance(limit, int) and limit > 0):
        return None
    parameters = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kinds = (
        parameters.values() if all(isinstance(p, dict) for p in parameters.values()) and parameters else [parameters]
    )
    for rope in kinds:  # one per layer type where the config holds several (Gemma 3's)
        kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
        if kind == "dynamic":
            return None
        if kind in EXTENDING_ROPE and isinstance(factor, (int, float)) and factor > 1:
            original = rope.get("original_max_position_embeddings") or limit
            limit = max(limit, int(original * factor))
    return limit


def uses_alibi(model: torch.nn.Module) -> bool:
    """Whether ``model`` adds ALiBi's position bias to its attention mask (Falcon, MPT, BLOOM: a config's ``alibi``)."""
    return getattr(_text_config(model), "alibi", False) is True


def unsupported_attention(model: torch.nn.Module) -> str | None:
    """What of ``model``'s attention a sparse session cannot compute, or ``None``: logit soft-capping (Gemma 2's
    ``attn_logit_softcapping``), ALiBi (a config's ``alibi``) or attention sinks (a ``sinks`` tensor on a module,
    as gpt-oss has). Read from the config and the modules, before any forward; the attention function refuses the
    same from the forward's own arguments (``softcap``, ``s_aux``, a mask holding a bias) for anything this
    misses."""
    softcap = getattr(_text_config(model), "attn_logit_softcapping", None)
    if softcap is not None:
        return f"attention logit soft-capping (attn_logit_softcapping = {softcap})"
    if uses_alibi(model):
        return "ALiBi's position bias (alibi = True; added to the attention mask)"
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            return f"attention sinks ({name}.sinks)"
    return None


UNSUPPORTED_ARGUMENTS = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "position_bias": "an additive position bias",
    "indices": "the model's own sparse-attention indices",
    "block_indices": "the model's own block-sparse indices",
}
"""Arguments some models pass to their attention function that change its result and that SDPA (the session's
dense forwards, a compiled decoder's) and the sparse step would leave out: refused at the first attention call of a
session or a compiled decoder (:func:`check_attention_arguments`)."""


def check_attention_arguments(kwargs: dict, what: str) -> None:
    """Refuse an attention call handed one of :data:`UNSUPPORTED_ARGUMENTS` (one line naming it)."""
    for argument, meaning in UNSUPPORTED_ARGUMENTS.items():
        if kwargs.get(argument) is not None:
            raise SparseDecodeError(f"{what} does not support {meaning} ({argument} in the attention call) yet")


@functools.cache
def _told_its_layer(kind: type) -> bool:
    """Whether modules of class ``kind`` take their layer as an argument of ``forward`` (``layer_idx``)."""
    try:
        return "layer_idx" in inspect.signature(kind.forward).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def shared_attention(model: torch.nn.Module) -> str | None:
    """A module of ``model`` that its caller tells which layer it is, or ``None``: it holds a config but no layer of
    its own (``layer_idx`` None or negative) and its ``forward`` takes ``layer_idx``, as Zamba's attention block does
    (one block run at several depths). A session keeps its state per attention module, found in the cache by the
    module's own ``layer_idx``: such a block's depths would share one layer's block statistics (Zamba 2, whose block
    holds -1) or not be hooked at all (Zamba, whose blocks hold None: silently dense)."""
    for name, module in model.named_modules():
        layer = getattr(module, "layer_idx", None)
        own = isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0
        if not own and hasattr(module, "config") and _told_its_layer(type(module)):
            return f"{name} ({type(module).__name__})"
    return None


def check_sparse_attention(model: torch.nn.Module, where: str) -> None:
    """Refuse a model whose attention has what sparse sessions leave out (:func:`unsupported_attention`), or whose
    attention block is shared across layers (:func:`shared_attention`)."""
    reason = unsupported_attention(model)
    if reason is not None:
        raise SparseDecodeError(
            f"{where}: sparse decoding does not support {reason} yet: its sparse steps, and the dense forwards it "
            "runs inside a session (SDPA), would leave it out"
        )
    shared = shared_attention(model)
    if shared is not None:
        raise SparseDecodeError(
            f"{where}: sparse decoding does not support an attention block shared across layers yet ({shared} is "
            "told its layer by its caller): a session keeps its state per attention module, so the layers would "
            "share one layer's block statistics, or go unhooked and stay dense"
        )


def check_positions(model: torch.nn.Module, context: int, tokens: int, where: str) -> None:
    """Refuse a prompt of ``context`` positions plus ``tokens`` generated tokens past the model's positions."""
    limit = max_positions(model)
    if limit is not None and context + tokens > limit:
        raise SparseDecodeError(
            f"{where}: context {context} + {tokens} tokens exceeds the model's {limit} positions; "
            "use a shorter prompt or fewer tokens"
        )


def _vocab_size(model: torch.nn.Module) -> int | None:
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError, TypeError):
        return None


def check_prompt_ids(model: torch.nn.Module, ids: object, where: str) -> None:
    """``ids`` is an integer tensor of shape ``(1, P)``, ``P >= 1``, of token ids the model knows, on its device."""
    if not isinstance(ids, torch.Tensor):
        raise SparseDecodeError(f"{where}: prompt ids must be a torch tensor of shape (1, length), got {_name(ids)}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise SparseDecodeError(f"{where}: prompt ids must be a tensor of int64 (torch.long) or int32, got {ids.dtype}")
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise SparseDecodeError(f"{where}: expected prompt ids of shape (1, length >= 1), got {tuple(ids.shape)}")
    check_has_values(ids, f"{where}: prompt ids")
    vocab = _vocab_size(model)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise SparseDecodeError(
            f"{where}: prompt ids must lie in [0, {vocab if vocab is not None else 'vocab'}), got ids from {low} to "
            f"{high}: was the prompt tokenised with this model's tokenizer?"
        )
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.device != ids.device:
        raise SparseDecodeError(
            f"{where}: prompt ids are on {ids.device} but the model's embeddings on {weight.device}; "
            f"move them with ids.to({str(weight.device)!r})"
        )


def check_token_id(model: torch.nn.Module, value: object, name: str, where: str) -> None:
    """``value`` is ``None`` or a token id of the model's vocabulary (an ``int``, not a bool)."""
    if value is None:
        return
    vocab = _vocab_size(model)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (vocab is not None and value >= vocab):
        raise SparseDecodeError(
            f"{where}: {name} must be None or one token id in [0, {vocab if vocab is not None else 'vocab'}), "
            f"got {value!r}"
        )


def check_has_values(tensor: torch.Tensor, name: str) -> None:
    """``tensor`` holds values to read: a dense (strided) tensor, not one on the meta device."""
    if tensor.device.type == "meta":
        raise SparseDecodeError(f"{name} are on the meta device, which holds no values; give real tensors")
    if tensor.layout != torch.strided:
        raise SparseDecodeError(f"{name} are a {tensor.layout} tensor; give a dense one (.to_dense())")


def check_finite(tensor: object, name: str) -> None:
    """``tensor`` is a floating-point tensor without NaN or infinite entries (reads all of it)."""
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        got = f"a tensor of {tensor.dtype}" if isinstance(tensor, torch.Tensor) else _name(tensor)
        raise SparseDecodeError(f"{name} must be a floating-point torch tensor, got {got}")
    check_has_values(tensor, name)
    if not bool(torch.isfinite(tensor).all()):
        raise SparseDecodeError(f"{name} hold NaN or infinite values; selection needs finite {name}")


def finite_sum(tensor: torch.Tensor) -> bool:
    """Whether every entry of ``tensor`` is finite, by one float64 reduction and one read-back.

    Cheaper than ``isfinite(...).all()`` for the small tensors of a decode step: a NaN or an infinity makes the
    sum NaN or infinite, and a float64 sum of float32 (or narrower) values cannot overflow. float64 values can (a
    sum of finite values near the largest float64 overflows), so they are checked entry by entry; integers are.
    """
    if not tensor.is_floating_point():
        return True
    if tensor.dtype == torch.float64:
        return bool(torch.isfinite(tensor).all())
    return math.isfinite(float(tensor.detach().sum(dtype=torch.float64)))


def check_scores(scores: torch.Tensor) -> None:
    """Refuse non-finite selection scores ``(rows, n)``: NaN would otherwise pick blocks in index order."""
    if not finite_sum(scores):
        raise SparseDecodeError(NONFINITE_SCORES)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention layers, in order: the modules that carry a ``layer_idx`` (an integer: an MLP holding
    ``layer_idx=None`` is none) and a ``config`` (what a session hooks, what the compiled step replaces, what a
    per-layer budget counts)."""
    return [
        module
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "config")
    ]

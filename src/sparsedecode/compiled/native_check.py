"""What the native decode step (:mod:`sparsedecode.compiled.native`) serves, checked before any decoding: the model's
structure (each part the family's own class, its forward the class's as first seen, no hook), every tensor the C
call reads (float32 and contiguous, or a quantized layer's own formats), the shapes it addresses them by, one
attention scaling, and the selector of every sparse layer. :func:`check` raises one line naming what it does not
compute."""

from __future__ import annotations

import importlib

import torch

from ..errors import SparseDecodeError
from ..kernels import cpu
from ..kernels.cpu import model as kernel
from ..layout import BlockLayout
from ..models.catalog import attention_shape
from ..step.plan import plan_step
from .prepared import serves

NATIVE = "native"
"""The :class:`~sparsedecode.compiled.decoder.CompiledDecoder` backend naming the native step."""
FAMILIES = {"LlamaForCausalLM": "Llama", "Qwen2ForCausalLM": "Qwen2", "MistralForCausalLM": "Mistral"}
"""The model classes served, each with the prefix of its parts' classes (``LlamaDecoderLayer``, ...)."""
_FORWARDS: dict[type, object] = {}
"""Each served class's ``forward`` as first seen here: a forward replaced on the class afterwards is refused (and one
named otherwise, or defined in another module, at any time)."""


def _hooked(module: torch.nn.Module) -> bool:
    """A hook or a forward of its own on ``module``: what the C call would skip."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
    return any(hooks) or "forward" in vars(module)


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return any(getattr(torch_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks"))


def _classes(family: str) -> dict[str, type]:
    """The classes of a family's parts by their names, and the shared ones (the embedding, SiLU)."""
    from transformers.activations import SiLUActivation

    modeling = importlib.import_module(f"transformers.models.{family.lower()}.modeling_{family.lower()}")
    names = ("ForCausalLM", "Model", "DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding")
    found = {f"{family}{name}": getattr(modeling, f"{family}{name}") for name in names}
    return {**found, "Embedding": torch.nn.Embedding, "SiLUActivation": SiLUActivation}


def parts(model) -> list[tuple[str, torch.nn.Module, str]]:
    """Every module the C call replaces, with its name and the class it must be (``""``: a linear layer)."""
    family, inner = FAMILIES[type(model).__name__], model.model
    found = [("the model", model, f"{family}ForCausalLM"), ("model.embed_tokens", inner.embed_tokens, "Embedding")]
    found += [("model.norm", inner.norm, f"{family}RMSNorm"), ("lm_head", model.lm_head, "")]
    found += [("model", inner, f"{family}Model"), ("model.rotary_emb", inner.rotary_emb, f"{family}RotaryEmbedding")]
    for i, layer in enumerate(inner.layers):
        at = f"model.layers.{i}"
        found += [(at, layer, f"{family}DecoderLayer"), (f"{at}.self_attn", layer.self_attn, f"{family}Attention")]
        found += [(f"{at}.mlp", layer.mlp, f"{family}MLP"), (f"{at}.mlp.act_fn", layer.mlp.act_fn, "SiLUActivation")]
        norms = ("input_layernorm", "post_attention_layernorm")
        found += [(f"{at}.{n}", getattr(layer, n), f"{family}RMSNorm") for n in norms]
        found += [(f"{at}.self_attn.{n}", getattr(layer.self_attn, n), "") for n in kernel.LINEARS[:4]]
        found += [(f"{at}.mlp.{n}", getattr(layer.mlp, n), "") for n in kernel.LINEARS[4:]]
    return found


def _replaced_forward(cls: type) -> bool:
    """Whether ``cls.forward`` is not the class's own: another function than the first seen here, or one defined
    elsewhere (transformers' own decorators keep the wrapped function's name and module)."""
    forward = cls.forward
    foreign = getattr(forward, "__qualname__", "") != f"{cls.__name__}.forward" or forward.__module__ != cls.__module__
    return foreign or _FORWARDS.setdefault(cls, forward) is not forward


def _tensor_refusal(name: str, module: torch.nn.Module, linear: bool) -> str | None:
    """Every tensor of ``module`` the C call reads: float32 and contiguous (a quantized layer: its own formats)."""
    from ..models.quantized import Int4Linear, Int5Linear, Int8Linear

    quantized = type(module) in (Int4Linear, Int5Linear, Int8Linear)
    if linear and not quantized and type(module) is not torch.nn.Linear:
        return f"{name} is a {type(module).__name__}, neither torch's Linear nor one of the quantized layers"
    sizes = {torch.nn.Linear: ("out_features", "in_features"), torch.nn.Embedding: ("num_embeddings", "embedding_dim")}
    named = sizes.get(type(module))  # the C call addresses the weight by these numbers, torch's forward by its shape
    if named and tuple(module.weight.shape) != (shape := tuple(getattr(module, n) for n in named)):
        return f"{name}.weight is {tuple(module.weight.shape)}, not the {shape} its {' and '.join(named)} give"
    for attribute, tensor in [*module._parameters.items(), *module._buffers.items()]:  # its own, as registered
        if tensor is None or (quantized and attribute != "bias"):
            continue  # a quantized layer's packed weights and scales: checked by its constructor and the C++ op
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            return f"{name}.{attribute} is {tensor.dtype}{'' if tensor.is_contiguous() else ', not contiguous'}: it " \
                "serves float32 weights, biases and norms in contiguous CPU memory"  # fmt: skip
    if quantized and not all(t.is_contiguous() for t in module._buffers.values() if t is not None):
        return f"{name}'s quantized weights are not contiguous"
    return None


def _module_refusal(model) -> str | None:
    classes = _classes(FAMILIES[type(model).__name__])
    try:
        found = parts(model)
    except AttributeError as error:
        return f"the model lacks a part it reads ({error})"
    for name, module, kind in found:
        expected = classes.get(kind)
        if kind and type(module) is not expected:
            return f"{name} is a {type(module).__module__}.{type(module).__name__}, not the {kind} it computes"
        if kind and _replaced_forward(expected):
            return f"{kind}.forward was replaced on the class, which the C call would skip"
        if _hooked(module) or (not kind and any(map(_hooked, module.modules()))):
            return f"{name} has a hook or a forward of its own, which the C call would skip"
        read = not kind or kind.endswith("RMSNorm") or kind == "Embedding"
        reason = _tensor_refusal(name, module, not kind) if read else None
        if reason:
            return reason
    return None


def _config_refusal(model) -> str | None:
    config = model.config
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    windowed = getattr(config, "sliding_window", None) is not None and (
        type(model).__name__ != "Qwen2ForCausalLM" or getattr(config, "use_sliding_window", False)
    )
    if types != {"full_attention"} or windowed:
        return "it serves models whose every layer attends fully (this one has a sliding window)"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
        return "it serves a SiLU-gated MLP without biases"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "it does not serve pretraining_tp > 1"
    return None


def refusal(model, device) -> str | None:
    """Why the native step cannot run ``model`` (None: it can); see the module."""
    if torch.device(device).type != "cpu":
        return f"it runs on the CPU (the model is on {device})"
    if cpu.library() is None:
        return f"the C kernel did not build here ({cpu.BUILD_ERROR})"
    if type(model).__name__ not in FAMILIES:
        return f"it serves {', '.join(FAMILIES)}, not {type(model).__name__}"
    if _global_hooks():
        return "a global module hook is registered, which the C call would skip"
    reason = _config_refusal(model) or _module_refusal(model)
    if reason is None and model.model.embed_tokens.max_norm is not None:
        reason = "an embedding with max_norm (renormalised at each lookup) is not served"
    return reason or _shape_refusal(model)


def _shape_refusal(model) -> str | None:
    """Every weight the C call reads has the size the config gives (it addresses them by these numbers), and every
    layer's attention one scaling."""
    heads, kv, d, layers = attention_shape(model.config)
    text = model.config.get_text_config(decoder=True)
    hidden, inter = text.hidden_size, text.intermediate_size
    shapes = {"q_proj": (hidden, heads * d), "k_proj": (hidden, kv * d), "v_proj": (hidden, kv * d)}
    shapes.update(o_proj=(heads * d, hidden), gate_proj=(hidden, inter), up_proj=(hidden, inter))
    shapes.update(down_proj=(inter, hidden))
    inner = model.model
    if len(inner.layers) != layers:  # the C call reads a table of the config's count of layers
        held = len(inner.layers)
        return f"model.model.layers holds {held} decoder layers, not the config's {layers} (num_hidden_layers)"
    for i, layer in enumerate(inner.layers):
        for name, shape in shapes.items():
            module = getattr(layer.self_attn if name in kernel.LINEARS[:4] else layer.mlp, name)
            bias = module.bias
            if (module.in_features, module.out_features) != shape or (bias is not None and bias.numel() != shape[1]):
                return f"model.layers.{i}.{name} does not have the config's shape {shape}"
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.numel() != hidden for w in norms):
            return f"model.layers.{i}'s norms do not have the config's hidden size"
    if model.lm_head.in_features != hidden or inner.embed_tokens.embedding_dim != hidden or d % 2:
        return "the embeddings, the vocabulary projection or an odd head dim do not fit the config"
    if inner.norm.weight.numel() != hidden:
        return "model.norm does not have the config's hidden size"
    if len({float(layer.self_attn.scaling) for layer in inner.layers}) != 1:
        return "every layer's attention must share one scaling"
    return None


def selector_refusal(cfg, state, q: torch.Tensor, keys: torch.Tensor):
    """``(plan, None)``, or ``(None, why)`` when the prepared call does not serve ``cfg``'s layer over a cache like
    ``keys`` with ``state`` (a :class:`~sparsedecode.compiled.op.StepBuffers`, or dummies of its shapes)."""
    if not cfg.selector.token_level and cfg.blocks == 0:  # its C step selects and reads at least one block
        return None, (
            f"it reads at least one distant block, and a support of {cfg.support} holds none (below 1 + W + B = "
            f"{1 + cfg.window + cfg.block_size}): decode it with another compile backend"
        )
    layout = BlockLayout(n=keys.shape[2], window=cfg.window, block_size=cfg.block_size)
    plan = plan_step(cfg, q[0], keys[0], keys[0], layout)
    if cfg.kernel not in ("auto", "c"):  # what the plan scores in would otherwise read as the selector's fault
        return None, f"it selects and attends in the C kernel, not kernel={cfg.kernel!r} (use 'auto' or 'c')"
    if not serves(cfg, plan, q, *state):
        return None, (
            "it serves selectors scored in the C kernel with a fixed budget (mean-pooled blocks); "
            f"{cfg.selector.spec()} is not one (decode it with another compile backend)"
        )
    return plan, None


def check(model, cfg, device, length: int | None = None) -> None:
    """One line saying why the native step cannot decode ``model`` with ``cfg`` (nothing when it can): the model
    (:func:`refusal`) and every sparse layer's selector, over a cache of ``length`` positions (default: a little
    more than the support)."""
    reason = refusal(model, device)
    if reason is None and cfg is not None:
        heads, kv, d, layers = attention_shape(model.config)
        sparse = [cfg.for_layer(index) for index in range(layers) if index not in cfg.dense_layers]
        for layer in {layer.identity(): layer for layer in sparse}.values():  # each configuration once
            n = length or layer.effective_support + 2 * layer.block_size
            state = [torch.zeros(1, dtype=torch.int64), torch.zeros(1, kv, max(layer.blocks, 1), dtype=torch.int64)]
            state += [torch.zeros(1, dtype=torch.int64) for _ in range(2)] + [torch.zeros(4, dtype=torch.int64)]
            _, reason = selector_refusal(layer, state, torch.empty(1, heads, d), torch.empty(1, kv, n, d))
            if reason:
                break
    if reason:
        raise SparseDecodeError(f"the native decode step (backend {NATIVE!r}): {reason}")

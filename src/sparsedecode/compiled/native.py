"""The native decode step (``backend="native"``, ``SPARSEDECODE_COMPILE_BACKEND=native``): a
:class:`~sparsedecode.compiled.decoder.CompiledDecoder` whose step is one C call for the whole model
(``model_step`` in ``kernels/cpu/csrc/model.h``) instead of a ``torch.compile`` graph: no graph, guards or operator
dispatch between its products, which is what the compiled step spends beside them at a small model's step on a CPU.

It serves what that C call computes, and refuses everything else in one line (:func:`refusal`): on the CPU, a
float32 Llama, Qwen2 or Mistral model (their decoder layers: RMSNorm, attention with RoPE as ``rotate_half`` and
optional q/k/v/o biases, a SiLU-gated MLP without biases) whose modules are the classes' own (no forward replaced,
no hooks), each linear layer float32 or one of :mod:`sparsedecode.models.quantized`'s (GGUF's blocks read as
stored), dense, or sparse with a selector the prepared C call serves (mean-dot block selection with a fixed budget:
:func:`~sparsedecode.compiled.prepared.serves`). Its selection, attention and state bookkeeping are the prepared
call's (the step's schedule, written once in :mod:`sparsedecode.step.schedule`, mirrored there); RoPE's cos and sin
come from the model's own rotary module at each step (any of its scalings). The prefill and every multi-token forward
stay the model's own (eager, :meth:`CompiledDecoder.extend`), so do lossless drafts' verifications.

Its float32 arithmetic (norms, RoPE, sums) rounds otherwise than torch's kernels: logits agree with the compiled
step's to round-off, greedy tokens until a near tie (tests/test_native_step.py). A support of at least the context
decodes exactly as this step's dense decoding (both attend over every position in the same C function).
"""

from __future__ import annotations

import torch

from ..errors import SparseDecodeError
from ..kernels import cpu
from ..kernels.cpu import model as kernel
from ..layout import BlockLayout
from ..models.catalog import attention_shape
from ..models.quantized import Int4Linear, Int8Linear
from ..step.plan import plan_step
from .prepared import Prepared, serves

NATIVE = "native"
"""The :class:`CompiledDecoder` backend naming this step."""
FAMILIES = {"LlamaForCausalLM": "Llama", "Qwen2ForCausalLM": "Qwen2", "MistralForCausalLM": "Mistral"}
"""The model classes served, each with the prefix of its parts' classes (``LlamaDecoderLayer``, ...)."""


def _hooked(module: torch.nn.Module) -> bool:
    """A hook or a forward of its own on ``module``: what the C call would skip."""
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
    return any(hooks) or "forward" in vars(module)


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return any(getattr(torch_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks"))


def _linear_refusal(name: str, module) -> str | None:
    if type(module) in (Int4Linear, Int8Linear):
        return None
    if type(module) is not torch.nn.Linear:
        return f"{name} is a {type(module).__name__}, neither torch's Linear nor one of the quantized layers"
    if module.weight.dtype != torch.float32:
        return f"{name}'s weight is {module.weight.dtype}, not float32"
    return None


def _parts(model) -> list[tuple[str, torch.nn.Module, str]]:
    """Every module the C call replaces, with its name and the class it must be (``""``: a linear layer)."""
    family, inner = FAMILIES[type(model).__name__], model.model
    parts = [("the model", model, type(model).__name__), ("model.embed_tokens", inner.embed_tokens, "Embedding")]
    parts += [("model.norm", inner.norm, f"{family}RMSNorm"), ("lm_head", model.lm_head, "")]
    parts += [("model", inner, f"{family}Model"), ("model.rotary_emb", inner.rotary_emb, f"{family}RotaryEmbedding")]
    for i, layer in enumerate(inner.layers):
        at = f"model.layers.{i}"
        parts += [(at, layer, f"{family}DecoderLayer"), (f"{at}.self_attn", layer.self_attn, f"{family}Attention")]
        parts += [(f"{at}.mlp", layer.mlp, f"{family}MLP"), (f"{at}.mlp.act_fn", layer.mlp.act_fn, "SiLUActivation")]
        norms = ("input_layernorm", "post_attention_layernorm")
        parts += [(f"{at}.{n}", getattr(layer, n), f"{family}RMSNorm") for n in norms]
        parts += [(f"{at}.self_attn.{n}", getattr(layer.self_attn, n), "") for n in kernel.LINEARS[:4]]
        parts += [(f"{at}.mlp.{n}", getattr(layer.mlp, n), "") for n in kernel.LINEARS[4:]]
    return parts


def refusal(model, device) -> str | None:
    """Why the native step cannot run ``model`` (None: it can); see the module."""
    if torch.device(device).type != "cpu":
        return f"it runs on the CPU (the model is on {device})"
    if cpu.library() is None:
        return f"the C kernel did not build here ({cpu.BUILD_ERROR})"
    if type(model).__name__ not in FAMILIES:
        return f"it serves {', '.join(FAMILIES)}, not {type(model).__name__}"
    config = model.config
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    windowed = getattr(config, "sliding_window", None) is not None and (
        type(model).__name__ != "Qwen2ForCausalLM" or getattr(config, "use_sliding_window", False)
    )
    if types != {"full_attention"} or windowed:
        return "it serves models whose every layer attends fully (this one has a sliding window)"
    if _global_hooks():
        return "a global module hook is registered, which the C call would skip"
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "mlp_bias", False):
        return "it serves a SiLU-gated MLP without biases"
    if (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "it does not serve pretraining_tp > 1"
    try:
        parts = _parts(model)
    except AttributeError as error:
        return f"the model lacks a part it reads ({error})"
    for name, module, kind in parts:
        if kind and type(module).__name__ != kind:
            return f"{name} is a {type(module).__name__}, not the {kind} it computes"
        if _hooked(module) or (not kind and any(map(_hooked, module.modules()))):
            return f"{name} has a hook or a forward of its own, which the C call would skip"
        reason = None if kind else _linear_refusal(name, module)
        if reason:
            return reason
    floats = [model.model.embed_tokens.weight, model.model.norm.weight]
    if any(t.dtype != torch.float32 for t in floats) or type(model.model.embed_tokens) is not torch.nn.Embedding:
        return "it serves float32 models (embeddings and norms in float32)"
    return None


def check(model, cfg, device) -> None:
    """One line saying why the native step cannot decode ``model`` with ``cfg`` (nothing when it can)."""
    reason = refusal(model, device)
    if reason:
        raise SparseDecodeError(f"the native decode step (backend {NATIVE!r}): {reason}")


def _linear_fields(module) -> list[int]:
    """A linear layer's :data:`~sparsedecode.kernels.cpu.model.LINEAR_FIELDS`."""
    bias = 0 if module.bias is None else module.bias.data_ptr()
    if type(module) is Int4Linear:
        wide = int(module.scale.dtype == torch.float32)
        return [4, module.out_features, module.in_features, module.packed.data_ptr(), module.scale.data_ptr(),
                module.offset.data_ptr(), bias, 32, wide]  # fmt: skip
    if type(module) is Int8Linear:
        wide = int(module.scale.dtype == torch.float32)
        return [8, module.out_features, module.in_features, module.q.data_ptr(), module.scale.data_ptr(), 0, bias,
                module.block, wide]  # fmt: skip
    weight = module.weight.detach()
    if not weight.is_contiguous() or (module.bias is not None and module.bias.dtype != torch.float32):
        raise SparseDecodeError("the native decode step: a float32 linear layer's weight must be contiguous")
    return [0, module.out_features, module.in_features, weight.data_ptr(), 0, 0, bias, 0, 0]


def _check_shapes(model, hidden: int, inter: int, heads: int, kv: int, d: int) -> None:
    """Every weight the C call reads has the size the config gives (it addresses them by these numbers)."""
    shapes = {"q_proj": (hidden, heads * d), "k_proj": (hidden, kv * d), "v_proj": (hidden, kv * d)}
    shapes.update(o_proj=(heads * d, hidden), gate_proj=(hidden, inter), up_proj=(hidden, inter))
    shapes.update(down_proj=(inter, hidden))
    inner, wrong = model.model, []
    for i, layer in enumerate(inner.layers):
        for name, shape in shapes.items():
            module = getattr(layer.self_attn if name in kernel.LINEARS[:4] else layer.mlp, name)
            bias = module.bias
            if (module.in_features, module.out_features) != shape or (bias is not None and bias.numel() != shape[1]):
                wrong.append(f"model.layers.{i}.{name}")
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        wrong += [f"model.layers.{i} norms" for w in norms if w.numel() != hidden]
    if model.lm_head.in_features != hidden or inner.embed_tokens.embedding_dim != hidden or d % 2:
        wrong.append("the embeddings, the vocabulary projection or an odd head dim")
    if wrong:
        raise SparseDecodeError(f"the native decode step: {wrong[0]} does not have the config's shape")


class NativeStep:
    """The decoder's step as one C call (see the module): ``step(input_ids (batch, 1), position_ids (batch, 1))`` ->
    logits ``(batch, vocab)`` float32, as the compiled step's. Its tables (addresses of the weights, the cache and
    the state) are built at the first call after each :meth:`forget` (the decoder's every install)."""

    def __init__(self, decoder):
        check(decoder.model, decoder.cfg, decoder.device)
        kernel.check_layout()
        self.decoder = decoder
        self.tables = None
        self.prepared: dict[int, tuple] = {}  # per layer: (what it addresses, its Prepared call)
        heads, kv, d, _ = attention_shape(decoder.model.config)
        keys = torch.empty(decoder.batch, kv, decoder.max_len, d)
        for state in decoder.states.values():  # refused now, not at the first step after a prefill
            self._plan(state, self._query(heads, d), keys)

    def forget(self) -> None:
        """Build the tables afresh at the next call (the model's modules may have been replaced since)."""
        self.tables = None

    def _build(self):
        decoder, model = self.decoder, self.decoder.model
        check(model, decoder.cfg, decoder.device)
        heads, kv, d, layers = attention_shape(model.config)
        batch, inner, text = decoder.batch, model.model, model.config.get_text_config(decoder=True)
        scales = {float(layer.self_attn.scaling) for layer in inner.layers}
        if len(scales) != 1:
            raise SparseDecodeError("the native decode step: every layer's attention must share one scaling")
        norm, hidden, inter = inner.norm, text.hidden_size, text.intermediate_size
        _check_shapes(model, hidden, inter, heads, kv, d)
        fields = [layers, batch, hidden, heads, kv, d, inter, kernel.float_bits(scales.pop())]
        fields += [norm.weight.data_ptr(), kernel.float_bits(norm.variance_epsilon), *_linear_fields(model.lm_head)]
        table = torch.tensor(fields, dtype=torch.int64)
        rows = [self._layer_fields(i, layer, heads, kv, d) for i, layer in enumerate(inner.layers)]
        layer_table = torch.tensor(rows, dtype=torch.int64)
        work = torch.zeros(kernel.work_floats(table.data_ptr()), dtype=torch.float32)
        logits = torch.empty(batch, model.lm_head.out_features, dtype=torch.float32)
        self.tables = (table, layer_table, work, logits, torch.zeros(2, batch, d), torch.zeros(1, dtype=torch.int64))

    def _query(self, heads: int, d: int) -> torch.Tensor:
        """The work buffer's query part, as the prepared calls address it (its offsets are the C call's)."""
        return torch.empty(self.decoder.batch, heads, d, dtype=torch.float32)

    def _layer_fields(self, index: int, layer, heads: int, kv: int, d: int) -> list[int]:
        decoder = self.decoder
        cache_layer = decoder.cache.layers[index]
        if not getattr(cache_layer, "is_initialized", True) or getattr(cache_layer, "keys", None) is None:
            empty = torch.empty(decoder.batch, kv, 0, d, device=decoder.device)
            cache_layer.lazy_initialization(empty, empty)
        keys, values = cache_layer.keys, cache_layer.values
        for t in (keys, values):
            if t.dtype != torch.float32 or t.stride(3) != 1 or tuple(t.shape) != (decoder.batch, kv, t.shape[2], d):
                raise SparseDecodeError("the native decode step needs a float32 static cache of (batch, kv, L, d)")
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        out = [norm1.weight.data_ptr(), kernel.float_bits(norm1.variance_epsilon)]
        out += [norm2.weight.data_ptr(), kernel.float_bits(norm2.variance_epsilon)]
        out += [keys.data_ptr(), *keys.stride()[:3], values.data_ptr(), *values.stride()[:3]]
        out += self._state_fields(layer.self_attn, keys, values, heads, d)
        for name in kernel.LINEARS:
            out += _linear_fields(getattr(layer.self_attn if name in kernel.LINEARS[:4] else layer.mlp, name))
        return out

    def _state_fields(self, module, keys, values, heads: int, d: int) -> list[int]:
        """``sparse`` .. ``support``: a dense layer's zeros, a sparse layer's state and its prepared call."""
        state = self.decoder.states.get(module)
        if state is None:
            return [0] * 13
        cfg = state.cfg
        support = cfg.effective_support
        table = 0
        if keys.shape[2] > support:  # some step of this cache is sparse: the prepared call serves it
            addresses = tuple(t.data_ptr() for t in (keys, values, state.stats, *state_in_order(state)))
            kept = self.prepared.get(module.layer_idx)
            if kept is None or kept[0] != (addresses, keys.shape, values.shape):  # else: made at an earlier install
                q = self._query(heads, d)
                plan = self._plan(state, q, keys)
                made = Prepared(cfg, plan, q, keys, values, state.stats, *state_in_order(state), 1.0)
                self.prepared[module.layer_idx] = kept = ((addresses, keys.shape, values.shape), made)
            prepared = kept[1]
            table = prepared.table
            reuse, every, split = prepared.settings
        else:
            reuse, every, split = cfg.reuse, int(bool(cfg.selector.reselects_every_step)), 0
        pointers = [t.data_ptr() for t in (state.count, state.step, state.last, state.tally)]
        means = int(tuple(state.kinds) == ("mean",))  # the C call completes them itself
        return [1, table, cfg.window, cfg.block_size, reuse, every, split, *pointers, support, means]

    @staticmethod
    def _plan(state, q: torch.Tensor, keys: torch.Tensor):
        """The step plan of ``state``'s layer over a cache like ``keys``, refused unless the prepared call serves it."""
        cfg = state.cfg
        layout = BlockLayout(n=keys.shape[2], window=cfg.window, block_size=cfg.block_size)
        plan = plan_step(cfg, q[0], keys[0], keys[0], layout)
        if not serves(cfg, plan, q, *state_in_order(state)):
            raise SparseDecodeError(
                "the native decode step serves selectors scored in the C kernel with a fixed budget (mean-pooled "
                f"blocks); {cfg.selector.spec()} is not one (decode it with another compile backend)"
            )
        return plan

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.tables is None:
            self._build()
        table, layer_table, work, logits, rope, stopped = self.tables
        decoder, inner = self.decoder, self.decoder.model.model
        batch, n = decoder.batch, int(position_ids.reshape(-1)[-1]) + 1
        x = inner.embed_tokens(input_ids.reshape(batch, 1)).reshape(batch, -1)
        work[: x.numel()].copy_(x.reshape(-1))
        cos, sin = inner.rotary_emb(x, position_ids.reshape(batch, 1))
        rope[0].copy_(cos.reshape(batch, -1))
        rope[1].copy_(sin.reshape(batch, -1))
        first = resumed = 0
        while True:
            status = kernel.step(
                table.data_ptr(), layer_table.data_ptr(), work.data_ptr(), rope[0].data_ptr(), rope[1].data_ptr(), n,
                first, resumed, torch.get_num_threads(), logits.data_ptr(), stopped.data_ptr(),
            )  # fmt: skip
            if status != kernel.NEEDS_STATISTICS:
                return logits.clone()
            first, resumed = int(stopped[0]), 1
            state = decoder.states[inner.layers[first].self_attn]
            self.prepared[first][1].complete_statistics(decoder.cache.layers[first].keys, state.stats, n)


def state_in_order(state) -> tuple:
    """A :class:`~sparsedecode.compiled.op.StepBuffers`'s ``count, blocks, step, last, tally``, as
    :class:`Prepared` takes them."""
    return state.count, state.blocks, state.step, state.last, state.tally

"""The native decode step (``backend="native"``, ``SPARSEDECODE_COMPILE_BACKEND=native``): a
:class:`~sparsedecode.compiled.decoder.CompiledDecoder` whose step is one C call for the whole model
(``model_step`` in ``kernels/cpu/csrc/model.h``) instead of a ``torch.compile`` graph: no graph, guards or operator
dispatch between its products, which is what the compiled step spends beside them at a small model's step on a CPU.

It serves what that C call computes, and refuses everything else in one line before any decoding
(:mod:`.native_check`): on the CPU, a
float32 Llama, Qwen2 or Mistral model (their decoder layers: RMSNorm, attention with RoPE as ``rotate_half`` and
optional q/k/v/o biases, a SiLU-gated MLP without biases) whose modules are the classes' own (no forward replaced,
no hooks), each linear layer float32 or one of :mod:`sparsedecode.models.quantized`'s (GGUF's blocks read as
stored), dense, or sparse with a selector the prepared C call serves (mean-dot block selection with a fixed budget:
:func:`~sparsedecode.compiled.prepared.serves`). Its selection, attention and state bookkeeping are the prepared
call's (the step's schedule, written once in :mod:`sparsedecode.step.schedule`, mirrored there); RoPE's cos and sin
come from the model's own rotary module (any of its scalings: a table of every position made once where they
depend on the position alone, :data:`STATIC_ROPE`, else at each step); the token's embedding row is copied in the C
call. The prefill and every multi-token forward stay the model's own (eager, :meth:`CompiledDecoder.extend`), so do
lossless drafts' verifications. The weights are read where the model holds them: on huge pages in one buffer when
:func:`~sparsedecode.models.catalog.load_model` loaded it (:mod:`sparsedecode.models.arena`).

Its float32 arithmetic (norms, RoPE, sums) rounds otherwise than torch's kernels: logits agree with the compiled
step's to round-off, greedy tokens until a near tie (tests/test_native_step.py). A support of at least the context
decodes exactly as this step's dense decoding (both attend over every position in the same C function).
"""

from __future__ import annotations

import operator

import torch

from ..errors import SparseDecodeError
from ..kernels.cpu import NEEDS_STATISTICS
from ..kernels.cpu import model as kernel
from ..models.catalog import attention_shape
from .native_check import NATIVE, check, selector_refusal
from .prepared import Prepared

__all__ = ["NATIVE", "STATIC_ROPE", "NativeStep", "check"]

STATIC_ROPE = ("default", "linear", "llama3", "yarn")
"""RoPE types whose cos and sin at a position do not depend on the sequence's length (``dynamic`` and ``longrope``
change their frequencies past a length): the native step reads them from a table of every position."""


def _linear_fields(module, address) -> list[int]:
    """A linear layer's :data:`~sparsedecode.kernels.cpu.model.LINEAR_FIELDS`, each tensor's address taken by
    ``address(module, name)``."""
    from ..models.quantized import Int4Linear, Int5Linear, Int8Linear

    kinds, shape = kernel.KINDS, [module.out_features, module.in_features]
    bias = 0 if module.bias is None else address(module, "bias")
    scale = getattr(module, "scale", None)  # a quantized layer's: float16, or float32 (a K-quant's products)
    wide = int(scale is not None and scale.dtype == torch.float32)
    if type(module) in (Int4Linear, Int5Linear):
        weights = [address(module, "packed"), address(module, "scale"), address(module, "offset")]
        high = address(module, "high") if type(module) is Int5Linear else 0
        return [kinds["int4"], *shape, *weights, bias, 32, wide, high]
    if type(module) is Int8Linear:
        return [kinds["int8"], *shape, address(module, "q"), address(module, "scale"), 0, bias, module.block, wide, 0]
    return [kinds["float32"], *shape, address(module, "weight"), 0, 0, bias, 0, 0, 0]


class NativeStep:
    """The decoder's step as one C call (see the module): ``step(input_ids (batch, 1), position_ids (batch, 1))`` ->
    logits ``(batch, vocab)`` float32, as the compiled step's. Its tables hold the addresses of the weights, the
    cache and the state; they are built at the first call, and again at any call that finds a module, tensor or
    number they address replaced (each step compares them: about 0.5 ms on SmolLM2 with its caches cold), the
    tensors kept alive meanwhile. RoPE's cos and sin come from the model's rotary module: for every position of the
    cache at once where they depend on the position alone (:data:`STATIC_ROPE`), rebuilt when its ``inv_freq`` is
    replaced or edited; else at each step."""

    def __init__(self, decoder):
        check(decoder.model, decoder.cfg, decoder.device, decoder.max_len)
        kernel.check_layout()
        self.decoder = decoder
        self.tables = self.rope_table = None
        self.prepared: dict[int, tuple] = {}  # per layer: (what it addresses, its Prepared call)
        self.watched: list[tuple] = []  # (container, name, object): the modules and numbers the tables read
        self.tensors: list[tuple] = []  # (container, name, address): the tensors they address, as owners hold them
        self.kept: list[torch.Tensor] = []  # those tensors, alive while addressed (no other can take an address)
        capacity = min((getattr(layer, "max_cache_len", None) or decoder.max_len for layer in decoder.cache.layers),
                       default=decoder.max_len)  # fmt: skip
        if capacity < decoder.max_len:
            raise SparseDecodeError(
                f"the native decode step: the cache holds {capacity} positions, fewer than its {decoder.max_len}"
            )

    def installed(self) -> None:
        """At each install of the decoder: the model checked again (a hook or a class's forward may have changed
        since; the compiled step's guards are checked at each install too); the tables are built afresh at the next
        call where what they address moved."""
        check(self.decoder.model, None, self.decoder.device)

    def _address(self, module: torch.nn.Module, name: str) -> int:
        """The address of ``module``'s tensor ``name`` (a parameter or a buffer), watched from now on."""
        return self._watch_tensor(module._parameters if name in module._parameters else module._buffers, name)

    def _watch_tensor(self, container: dict, name: str) -> int:
        """The address of the tensor ``container[name]``, watched from now on."""
        tensor = container[name]
        self.tensors.append((container, name, tensor.data_ptr()))
        self.kept.append(tensor)
        return tensor.data_ptr()

    def _watch_modules(self, model) -> None:
        """Every module the tables read, as its parent holds it (a module replaced there is seen)."""
        inner = model.model
        parents = [(model, "model"), (model, "lm_head"), (inner, "norm"), (inner, "embed_tokens")]
        parents += [(inner, "rotary_emb"), (inner, "layers")]  # a layer list replaced (layers pruned) is seen too
        for i, layer in enumerate(inner.layers):
            parents += [(inner.layers, str(i)), (layer, "self_attn"), (layer, "mlp"), (layer, "input_layernorm")]
            parents += [(layer, "post_attention_layernorm"), *((layer.self_attn, n) for n in kernel.LINEARS[:4])]
            parents += [(layer.mlp, n) for n in kernel.LINEARS[4:]]
        self.watched += [(parent._modules, name, parent._modules[name]) for parent, name in parents]

    @staticmethod
    def _numbers(layer) -> list[tuple]:
        """The numbers of a layer the tables hold (the norms' epsilons, the attention's scaling)."""
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        return [*((m, "variance_epsilon") for m in norms), (layer.self_attn, "scaling")]

    def _moved(self) -> bool:
        """Whether a module or number the tables read was replaced, or a tensor they address replaced or its storage
        swapped (the tensor its owner holds now lies elsewhere: the tensors addressed are kept alive, so no other
        can take their addresses)."""
        containers, names, items = self.columns  # C-level loops: SmolLM2's 480 modules and numbers, 750 tensors
        if not all(map(operator.is_, map(dict.get, containers, names), items)):
            return True
        holders, keys, addresses = self.tensor_columns
        try:
            if list(map(torch.Tensor.data_ptr, map(dict.get, holders, keys))) != addresses:
                return True
        except TypeError:  # a tensor removed, or replaced by something else
            return True
        return self.rope_table is not None and self.rope_version[0]._version != self.rope_version[1]

    def _build(self):
        decoder, model = self.decoder, self.decoder.model
        decoder.hold_states()  # an attention module replaced since: its layer's state is the new module's
        self.watched, self.tensors, self.kept = [], [], []
        self._watch_modules(model)
        heads, kv, d, layers = attention_shape(model.config)
        batch, inner, text = decoder.batch, model.model, model.config.get_text_config(decoder=True)
        norm, scale = inner.norm, float(inner.layers[0].self_attn.scaling)
        fields = [layers, batch, text.hidden_size, heads, kv, d, text.intermediate_size, kernel.float_bits(scale)]
        fields += [self._address(norm, "weight"), kernel.float_bits(norm.variance_epsilon)]
        embed = inner.embed_tokens
        fields += [self._address(embed, "weight"), embed.num_embeddings]
        self.watched += [(vars(norm), "variance_epsilon", norm.variance_epsilon), (vars(embed), "max_norm", None)]
        fields += _linear_fields(model.lm_head, self._address)
        table = torch.tensor(fields, dtype=torch.int64)
        rows = [self._layer_fields(i, layer, heads, kv, d) for i, layer in enumerate(inner.layers)]
        layer_table = torch.tensor(rows, dtype=torch.int64)
        work = torch.zeros(kernel.work_floats(table.data_ptr()), dtype=torch.float32)
        logits = torch.empty(batch, model.lm_head.out_features, dtype=torch.float32)
        self.tables = (table, layer_table, work, logits, torch.zeros(2, batch, d), torch.zeros(1, dtype=torch.int64))
        self.rope_table = self._rope_table(inner.rotary_emb, work)
        self.columns = tuple(map(list, zip(*self.watched)))
        self.tensor_columns = tuple(map(list, zip(*self.tensors)))

    def _rope_table(self, rotary, work: torch.Tensor) -> tuple | None:
        """cos and sin ``(max_len, d)`` of every position as ``rotary`` gives them, where they depend on the position
        alone (its ``inv_freq`` and numbers watched; its edits in place seen by their version); else None."""
        if getattr(rotary, "rope_type", None) not in STATIC_ROPE or "inv_freq" not in rotary._buffers:
            return None
        self._address(rotary, "inv_freq")
        self.watched += [(vars(rotary), name, getattr(rotary, name)) for name in ("rope_type", "attention_scaling")]
        self.rope_version = (rotary.inv_freq, rotary.inv_freq._version)
        cos, sin = rotary(work, torch.arange(self.decoder.max_len).reshape(1, -1))
        return cos.reshape(self.decoder.max_len, -1).contiguous(), sin.reshape(self.decoder.max_len, -1).contiguous()

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
            if t.shape[2] < decoder.max_len:
                raise SparseDecodeError(
                    f"the native decode step: the cache holds {t.shape[2]} positions, fewer than {decoder.max_len}"
                )
        self._watch_tensor(vars(cache_layer), "keys")
        self._watch_tensor(vars(cache_layer), "values")
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.watched += [(vars(m), name, getattr(m, name)) for m, name in self._numbers(layer)]
        out = [self._address(norm1, "weight"), kernel.float_bits(norm1.variance_epsilon)]
        out += [self._address(norm2, "weight"), kernel.float_bits(norm2.variance_epsilon)]
        out += [keys.data_ptr(), *keys.stride()[:3], values.data_ptr(), *values.stride()[:3]]
        out += self._state_fields(layer.self_attn, keys, values, heads, d)
        for name in kernel.LINEARS:
            out += _linear_fields(
                getattr(layer.self_attn if name in kernel.LINEARS[:4] else layer.mlp, name), self._address
            )
        return out

    def _state_fields(self, module, keys, values, heads: int, d: int) -> list[int]:
        """``sparse`` .. ``means``: a dense layer's zeros, a sparse layer's state and its prepared call."""
        state = self.decoder.states.get(module.layer_idx)
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
                plan, reason = selector_refusal(cfg, state_in_order(state), q, keys)
                if reason:
                    raise SparseDecodeError(f"the native decode step: {reason}")
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

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.tables is None or self._moved():
            if self.tables is not None:
                check(self.decoder.model, None, self.decoder.device)  # what replaced them is checked too
            self._build()
        table, layer_table, work, logits, rope, stopped = self.tables
        decoder, inner = self.decoder, self.decoder.model.model
        batch, n = decoder.batch, int(position_ids.reshape(-1)[-1]) + 1
        tokens = input_ids.reshape(batch).to(torch.int64).contiguous()  # the C call reads their embeddings
        if self.rope_table is not None:
            positions = position_ids.reshape(batch)
            torch.index_select(self.rope_table[0], 0, positions, out=rope[0])
            torch.index_select(self.rope_table[1], 0, positions, out=rope[1])
        else:
            cos, sin = inner.rotary_emb(work, position_ids.reshape(batch, 1))  # its x: float32 on the CPU
            rope[0].copy_(cos.reshape(batch, -1))
            rope[1].copy_(sin.reshape(batch, -1))
        first = resumed = 0
        while True:
            status = kernel.step(
                table.data_ptr(), layer_table.data_ptr(), tokens.data_ptr(), work.data_ptr(), rope[0].data_ptr(),
                rope[1].data_ptr(), n, first, resumed, torch.get_num_threads(), logits.data_ptr(), stopped.data_ptr(),
            )  # fmt: skip
            if status != NEEDS_STATISTICS:
                return logits.clone()
            first, resumed = int(stopped[0]), 1
            state = decoder.states[first]
            self.prepared[first][1].complete_statistics(decoder.cache.layers[first].keys, state.stats, n)


def state_in_order(state) -> tuple:
    """A :class:`~sparsedecode.compiled.op.StepBuffers`'s ``count, blocks, step, last, tally``, as
    :class:`Prepared` takes them."""
    return state.count, state.blocks, state.step, state.last, state.tally

"""Compiled decoding: the decode step over a static (preallocated) KV cache taken whole by ``torch.compile(...,
fullgraph=True)``, the sparse attention of every layer one custom op (:mod:`sparsedecode.compiled.op`).

:class:`CompiledDecoder` owns the cache and the per-layer state; its :meth:`~CompiledDecoder.step` is what the one
decode loop (:func:`~sparsedecode.decoding.loop.decode_tokens`) calls instead of a plain forward. ``generate(...,
compile=True)`` and ``--compile`` use it. What it serves: one prompt, or a batch of equal-length prompts (no padding),
greedy, dense or sparse with any selector but those that keep an attention history (H2O). The first step compiles
(seconds to a minute on a CPU); a decoder is kept on the model per configuration, batch and cache size (rounded up
to :data:`CACHE_ROUND` positions), so later calls of the same shape reuse the compiled step.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types

import torch

from .. import env
from ..config import SparseConfig, check_named_layers
from ..errors import SparseDecodeError
from ..models.catalog import attention_shape, layer_types
from ..step.device import fill_statistics
from ..step.schedule import dense_forwards
from ..validate import attention_modules, claim_compiled, release_compiled, unsupported_attention
from . import cpu as compile_cpu
from .guards import drop_module_guards, model_fingerprint, weight_versions
from .memory import place_statistics, static_cache
from .native import NATIVE, NativeStep
from .op import STATE, STATIC_ATTENTION, allocate, raise_kept, static_attention_forward, step_form
from .prepared import prompt_statistics

_NOTHING = contextlib.nullcontext()
CACHE_ROUND = 512
"""Cache sizes are rounded up to a multiple of this, so prompts of similar length share one compiled step."""
DEFAULT_BACKEND = env.text("SPARSEDECODE_COMPILE_BACKEND", "inductor")
"""``torch.compile``'s backend (``SPARSEDECODE_COMPILE_BACKEND``; ``aot_eager`` captures without code generation;
``native``: no ``torch.compile``, the whole step one C call, :mod:`sparsedecode.compiled.native`); checked by
:func:`check_backend` before any work that compiles."""
KEPT = 4
"""Decoders kept per model (each holds its compiled step; those of one batch and cache size share one cache)."""
MODULE_GUARDS_PER_INSTALL = env.choice("SPARSEDECODE_MODULE_GUARDS", "install", ("install", "step")) == "install"
"""dynamo's guards on the model's modules are checked once per install (:mod:`sparsedecode.compiled.guards`);
``SPARSEDECODE_MODULE_GUARDS=step`` keeps them all, checked before every step."""


def register() -> None:
    """Register the capturable step's attention function and mask builder with transformers (idempotent)."""
    from ..session.hf import register_attention

    register_attention(STATIC_ATTENTION, static_attention_forward)


def check_backend(backend: str | None = None) -> str:
    """``backend`` (default :data:`DEFAULT_BACKEND`) if ``torch.compile`` knows it, else one line naming the known
    ones: asked before any work, not at the first compiled step after minutes of other rows."""
    name = backend or DEFAULT_BACKEND
    if callable(name) or name == NATIVE:
        return name
    from torch._dynamo import list_backends
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.exc import InvalidBackend

    try:
        lookup_backend(name)
    except InvalidBackend:
        where = "" if backend else " (SPARSEDECODE_COMPILE_BACKEND)"
        known = ", ".join([*list_backends(), NATIVE, "or a debug one such as aot_eager or eager"])
        raise SparseDecodeError(
            f"compile backend {name!r}{where} is not one torch.compile knows; choose one of: {known}"
        ) from None
    return name


def check_compilable(model: torch.nn.Module, cfg: SparseConfig | None, what: str) -> None:
    """One line saying why ``cfg`` cannot decode compiled on ``model`` (nothing when it can), the compile backend
    included (:func:`check_backend`)."""
    from ..session.hf import check_switch_held

    check_backend()
    if cfg is not None and cfg.selector.uses_history:
        raise SparseDecodeError(
            f"{what}: {cfg.selector.spec()} keeps the attention every position received, which the compiled step "
            "does not; decode it without compile"
        )
    unsupported = unsupported_attention(model)  # ALiBi's bias is built over the cache's length; the rest left out
    if unsupported is not None:
        raise SparseDecodeError(
            f"{what}: {type(model).__name__}'s attention has {unsupported}, which the compiled step (dense too) does "
            "not compute; decode it densely without compile"
        )
    other = sorted(set(layer_types(model.config)) - {"full_attention"})
    if other:  # a sliding window's mask reads the cache's length as a number: every step would compile again
        raise SparseDecodeError(
            f"{what}: compile serves models whose every layer attends fully ({type(model).__name__} has {other} "
            "layers); decode without compile"
        )
    check_switch_held(model, what)
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager", STATIC_ATTENTION):
        raise SparseDecodeError(
            f"{what}: compile needs the model's own SDPA or eager attention (it has "
            f"{model.config._attn_implementation!r}; inside a sparse_decoding session, decode without compile)"
        )


def _seek(cache, length: int) -> None:
    """Make a ``StaticCache`` write its next tokens at ``length`` (its layers append at their own counter)."""
    for layer in cache.layers:
        counter = getattr(layer, "cumulative_length", None)
        if isinstance(counter, torch.Tensor):
            counter.fill_(length)
        elif counter is not None:
            layer.cumulative_length = length


def _own_method(owner, name: str):
    """``owner.name`` bound to a copy of the function with a code object of its own: dynamo keeps compiled graphs per
    code object, at most ``recompile_limit`` of them, so decoders sharing one code object would run out (and each
    call would check every other decoder's guards)."""
    function = getattr(type(owner), name)
    fresh = types.FunctionType(
        function.__code__.replace(),
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return types.MethodType(fresh, owner)


class CompiledDecoder:
    """Greedy decoding of ``batch`` unpadded sequences over a ``StaticCache`` of ``max_len`` positions, dense
    (``cfg=None``) or sparse, the decode step compiled with ``backend`` and ``mode`` (``torch.compile``,
    ``fullgraph=True``; ``mode="reduce-overhead"`` replays it from a CUDA graph on CUDA).

    Use it inside :meth:`installed`: :meth:`prefill` (dense, in chunks, eager) then :meth:`step` per token.
    ``tally()`` sums the layers' counts: sparse and dense row-steps (``dense_layers``' steps dense, as a session counts
    them), positions read by sparse steps. ``form``: how the sparse step runs (:data:`~sparsedecode.compiled.op.FORMS`;
    by default the host's prepared C call on the CPU, the host-free step on CUDA where it serves the selector)."""

    def __init__(
        self,
        model,
        cfg: SparseConfig | None,
        *,
        batch: int,
        max_len: int,
        backend: str | None = None,
        cache=None,
        mode: str | None = None,
        form: str | None = None,
    ):
        register()
        backend = check_backend(backend)
        self.model, self.cfg, self.batch, self.max_len, self.backend = model, cfg, batch, max_len, backend
        self.device = next(model.parameters()).device
        self.cache = cache if cache is not None else static_cache(model, max_len, batch, self.device)  # huge pages
        self.position = 0
        self.compile_s = 0.0
        self.states, self._held = {}, set()  # the sparse layers' states by layer index; the modules holding them
        self._dense_steps = 0  # dense_layers' row-steps (they hold no state to count them)
        if cfg is not None:
            heads, kv_heads, head_dim, _ = attention_shape(model.config)
            form = step_form(cfg, self.device, form)
            modules = attention_modules(model)
            check_named_layers(cfg, modules)
            shape = (batch, kv_heads, head_dim, max_len, self.device, form, heads)
            for module in modules:
                if module.layer_idx in cfg.dense_layers:
                    continue  # a module without step buffers decodes dense
                self.states[module.layer_idx] = allocate(cfg.for_layer(module.layer_idx), module.layer_idx, *shape)
            place_statistics(self.states, self.device)  # one buffer on huge pages (compiled/memory.py)
        self._row_linears = {}
        if compile_cpu.uses_row_products(model, self.device):
            self._row_linears = {
                m: functools.partial(compile_cpu.row_linear, m) for m in model.modules() if type(m) is torch.nn.Linear
            }
        # guards on the modules' attributes checked once per install (compile_guards), not at every step
        self._options = {"guard_filter_fn": drop_module_guards} if MODULE_GUARDS_PER_INSTALL else {}
        if backend == "inductor":
            from torch._inductor import list_mode_options

            # mode="reduce-overhead": replayed from CUDA graphs on CUDA (the state tensors have static addresses);
            # inductor's own size and stride checks of every input repeat dynamo's tensor guards, which stay
            self._options.update(list_mode_options(mode) if mode else {}, size_asserts=False)
        self.frozen, self.autotuned = compile_cpu.choices(model, self.device, backend, batch, bool(self._row_linears))
        self._compiled = self._compile()
        self._fingerprint = None
        self._installs = 0

    def _fingerprinted(self):
        """What the compiled step assumes of the model and does not check at each step (None: nothing)."""
        if not (self._options.get("guard_filter_fn") or self.frozen):
            return None
        modules = model_fingerprint(self.model) if self._options.get("guard_filter_fn") else None
        return modules, weight_versions(self.model) if self.frozen else None

    def _inductor_settings(self):
        """inductor's settings for this step's compiling (applied around every call: a recompile gets them too)."""
        return compile_cpu.inductor_settings(self.autotuned, quiet=not self._warm) if self.frozen else _NOTHING

    def _compile(self):
        """A new compiled step (nothing compiled yet: its first call compiles; the native step builds its tables)."""
        self._warm = False
        if self.backend == NATIVE:
            return NativeStep(self)
        options = dict(self._options)  # torch.compile takes the guard filter out of the dict it is given
        return torch.compile(
            _own_method(self, "_forward"), fullgraph=True, backend=self.backend, dynamic=False, options=options
        )

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True)
        return out.logits[:, -1].float()

    @contextlib.contextmanager
    def installed(self):
        """The model routes attention through the capturable step inside the block; restored afterwards."""
        from ..session.hf import ATTENTION_NAME

        model = self.model
        previous = model.config._attn_implementation
        if previous == ATTENTION_NAME:  # a session open here is refused before; one open in another thread
            raise SparseDecodeError(
                "compiled decoding: a sparse_decoding session (in another thread) has this model; give each thread "
                "its own copy of the model, made before the session opened (a copy made inside one keeps its attention)"
            )
        claim_compiled(model, "compiled decoding")
        if previous != STATIC_ATTENTION:
            model.set_attn_implementation(STATIC_ATTENTION)
        self.hold_states()
        linears = [(m, f) for m, f in self._row_linears.items() if "forward" not in vars(m)]
        for linear, forward in linears:
            linear.forward = forward  # the same object at every install: the compiled step's guards hold
        if self._warm and self._fingerprint is not None and self._fingerprinted() != self._fingerprint:
            self._compiled = self._compile()  # the model changed since the step was compiled: what guards saw
        self._installs += 1
        try:
            if self.backend == NATIVE:
                self._compiled.installed()  # the model checked as it is now, as the compiled step's guards are
            yield self
        finally:
            self._installs -= 1
            release_compiled(model)
            for linear, _ in linears:
                del linear.forward
            for module in self._held:
                if hasattr(module, STATE):
                    delattr(module, STATE)
            self._held.clear()
            if previous != STATIC_ATTENTION:
                model.set_attn_implementation(previous)

    def hold_states(self) -> None:
        """Each sparse layer's state set on the attention module the model holds for that layer now (at every
        install, and where the native step finds a module replaced within one): a module replaced since takes over
        its layer's state, where keyed by the module it replaced it found none and decoded dense."""
        for module in attention_modules(self.model):
            if module.layer_idx in self.states:
                setattr(module, STATE, self.states[module.layer_idx])
                self._held.add(module)

    def _check_installed(self, what: str) -> None:
        """A step outside :meth:`installed` would compile another graph without the step's state (and, its module
        guards dropped, replay it later): refused."""
        if not self._installs:
            raise SparseDecodeError(f"CompiledDecoder.{what} runs inside `with decoder.installed():`")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, *, chunk: int = 1024, progress=None) -> torch.Tensor:
        """Dense prefill of ``ids (batch, P)`` from position 0 (a new prompt: nothing earlier survives); returns the
        last position's logits ``(batch, vocab)`` float32."""
        if ids.dim() != 2 or ids.shape[0] != self.batch:
            raise SparseDecodeError(f"expected prompt ids of shape ({self.batch}, length), got {tuple(ids.shape)}")
        length = ids.shape[1]
        if length >= self.max_len:
            raise SparseDecodeError(f"a prompt of {length} tokens leaves no room in a cache of {self.max_len}")
        self.position, logits = 0, None
        for start in range(0, length, chunk):
            logits = self.extend(ids[:, start : start + chunk], logits_to_keep=1)[:, -1]
            if progress:
                progress("prefill", self.position, length)
        for state in self.states.values():  # the host-free forms' are filled by the forwards themselves
            if not state.host_free:
                prompt_statistics(state, self.cache.layers[state.layer].keys, length)
        return logits

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens (batch,)`` at the next position; the next logits ``(batch, vocab)`` float32. The first call
        compiles (its time, the step included, is ``compile_s``)."""
        self._check_installed("step")
        if self.position >= self.max_len:
            raise SparseDecodeError(f"the compiled decoder's cache of {self.max_len} positions is full")
        position = torch.full((self.batch, 1), self.position, dtype=torch.long, device=self.device)
        if self.backend != NATIVE:  # the native step writes at the position itself (extend seeks before a forward)
            _seek(self.cache, self.position)
        if not self._warm and self.frozen and not compile_cpu.room_to_freeze(self.model):
            self.frozen = self.autotuned = False  # memory taken since the decoder was made (another's compiling)
        started = time.perf_counter()
        with self._inductor_settings():
            try:
                logits = self._compiled(tokens.reshape(self.batch, 1).to(self.device), position)
            except RuntimeError as error:
                raise_kept(error)  # an error of the sparse step's Python part, kept by its C++ kernel
                raise
        if self.cfg is not None:  # a session counts dense_layers' steps as dense
            self._dense_steps += self.batch * len(self.cfg.dense_layers)
        if not self._warm:
            self._warm, self.compile_s = True, time.perf_counter() - started
            self._fingerprint = self._fingerprinted()
        self.position += 1
        return logits

    @torch.no_grad()
    def extend(self, ids: torch.Tensor, *, logits_to_keep: int = 0) -> torch.Tensor:
        """Feed ``ids (batch, T)`` at the next positions in one dense forward (eager: a prefill chunk, or what
        verifies lossless drafts); the logits after each ``(batch, T, vocab)`` float32 (the last ``logits_to_keep``
        only, when given). Setting :attr:`position` back afterwards drops the last of them (their keys are written
        over later)."""
        self._check_installed("extend")
        if ids.dim() != 2 or ids.shape[0] != self.batch or self.position + ids.shape[1] > self.max_len:
            raise SparseDecodeError(f"extend: ({self.batch}, T) ids fitting a cache of {self.max_len} positions")
        position = torch.arange(self.position, self.position + ids.shape[1], device=self.device).expand(self.batch, -1)
        _seek(self.cache, self.position)
        with dense_forwards():  # one token too (the last chunk of a prefill of 1024 k + 1)
            out = self.model(
                input_ids=ids.to(self.device), position_ids=position, cache=self.cache, use_cache=True,
                logits_to_keep=logits_to_keep,
            )  # fmt: skip
        self.position += ids.shape[1]
        return out.logits.float()

    def warm_up(self, tokens: torch.Tensor) -> float:
        """Compile now if not yet (one step at the next position, which the next :meth:`step` writes again): the
        seconds it took, 0 when the step was compiled already. The step it took is not counted in :meth:`tally`."""
        if self._warm:
            return 0.0
        counted, dense_steps = [state.tally.clone() for state in self.states.values()], self._dense_steps
        self.step(tokens)
        for state, before in zip(self.states.values(), counted):
            state.tally.copy_(before)
        self.position, self._dense_steps = self.position - 1, dense_steps
        return self.compile_s

    def resume(self, length: int) -> None:
        """The cache holds a prompt of ``length`` positions prefilled elsewhere (another decoder sharing it): decode
        from there, deriving nothing from earlier steps (the state is reset; the first step reads the prompt's
        blocks afresh; their statistics are computed here, as a prefill's are)."""
        self._dense_steps = 0
        for state in self.states.values():
            state.reset()
            keys = self.cache.layers[state.layer].keys
            if state.host_free:  # its statistics are filled by the forwards that write keys: fill the prompt's
                fill_statistics(state.stats, state.kinds, keys, 0, length, state.cfg.block_size)
            else:
                prompt_statistics(state, keys, length)
        self.position = length

    def load(self, caches, length: int) -> None:
        """The cache's rows take ``caches`` (one batch-1 cache per row holding ``length`` prefilled positions, such as
        a :class:`~sparsedecode.session.kv_cache.GrowingCache`), copied in; then :meth:`resume` from ``length``."""
        if len(caches) != self.batch or length >= self.max_len:
            raise SparseDecodeError(f"load: {self.batch} caches of fewer than {self.max_len} positions expected")
        _seek(self.cache, 0)
        for index, layer in enumerate(self.cache.layers):
            keys = torch.cat([c.layers[index].keys[:, :, :length] for c in caches]).to(self.device)
            values = torch.cat([c.layers[index].values[:, :, :length] for c in caches]).to(self.device)
            layer.update(keys, values)  # positions [0, length), allocating the layer if this is its first write
        self.resume(length)

    def tally(self) -> dict[str, int]:
        totals = torch.zeros(4, dtype=torch.long)
        for state in self.states.values():
            totals += state.tally.cpu()
        sparse, dense, read, heads = totals.tolist()
        dense += self._dense_steps
        return {"sparse_steps": sparse, "dense_steps": dense, "positions_read": read, "kv_head_steps": heads}


def decoder_for(model, cfg: SparseConfig | None, batch: int, length: int, backend: str | None = None):
    """The model's :class:`CompiledDecoder` for ``cfg``, ``batch`` and a cache of at least ``length`` positions
    (made once per configuration, batch and rounded size, then reused: its step stays compiled)."""
    backend = backend or DEFAULT_BACKEND
    size = -(-length // CACHE_ROUND) * CACHE_ROUND
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit:
        size = max(min(size, int(limit)), length)
    kept = model.__dict__.setdefault("_sparsedecode_decoders", {})
    weights = next(model.parameters())  # a model moved to another dtype or device: other decoders, another cache
    where = (weights.dtype, weights.device)
    key = (None if cfg is None else cfg.identity(), batch, size, backend, where)  # the selector itself, not its repr
    if key not in kept:
        shared = next((d.cache for k, d in kept.items() if (d.batch, d.max_len, k[-1]) == (batch, size, where)), None)
        while len(kept) >= KEPT:
            kept.pop(next(iter(kept)))
        kept[key] = CompiledDecoder(model, cfg, batch=batch, max_len=size, backend=backend, cache=shared)
    return kept[key]

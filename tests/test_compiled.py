"""The capturable sparse step (sparsedecode.compiled.op, sparsedecode.compiled.decoder): a whole decode step compiled
with fullgraph=True on tiny Llama and Qwen2, and the session's guarantees on the new path.

Compiling uses the ``aot_eager`` backend here: it runs dynamo's full-graph capture and AOT autograd's
functionalisation of the custom op's mutations (what capturability means), without inductor's C++ build (half a
minute per model on this CPU); ``test_inductor_compiled_step`` (slow) runs inductor too. The eager references are
the session's step (``sparse_decoding`` over a ``GrowingCache``, through the one decode loop) and the same static
step uncompiled."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch
from conftest import logits_tolerance, tiny_model

from sparsedecode import SparseConfig, sparse_decoding
from sparsedecode.compiled.decoder import CompiledDecoder
from sparsedecode.decoding.generate import generate
from sparsedecode.decoding.loop import decode_tokens, prefill
from sparsedecode.errors import SparseDecodeError
from sparsedecode.selectors import BlockSelector, selector_names
from sparsedecode.selectors.ops import group_mean_queries
from sparsedecode.session.kv_cache import GrowingCache

PROMPT, STEPS = 300, 24
SMALL_CFG = dict(support=97, window=32, block_size=8)  # 97 = 1 + 32 + 8 * 8: sparse from the first step at 300


def _prompt(seed: int = 1, length: int = PROMPT, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 90, (batch, length), generator=generator)


def _session_run(model, ids, cfg, steps=STEPS):
    """The session's eager step: tokens per sequence and the logits of every step ``(steps, B, vocab)``."""
    cache, logits = prefill(model, ids, cache=GrowingCache(config=model.config))
    first = logits.argmax(dim=-1).tolist()
    seen = []
    with sparse_decoding(model, cfg) if cfg is not None else _nothing():
        out, _ = decode_tokens(model, cache, first, steps, on_logits=lambda _, lg: seen.append(lg.clone()))
    return [[f, *o] for f, o in zip(first, out)], torch.stack(seen)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _static_run(decoder: CompiledDecoder, ids, steps=STEPS, *, compiled=True):
    """The static step (compiled, or its eager function): tokens per sequence and every step's logits."""
    step = decoder.step if compiled else (lambda t: decoder._forward(*decoder_inputs(decoder, t)))
    seen = []
    with decoder.installed():
        first = decoder.prefill(ids).argmax(dim=-1).tolist()
        out, _ = decode_tokens(
            decoder.model, None, first, steps, on_logits=lambda _, lg: seen.append(lg.clone()), step_fn=step
        )
    return [[f, *o] for f, o in zip(first, out)], torch.stack(seen)


def decoder_inputs(decoder: CompiledDecoder, tokens: torch.Tensor):
    """What :meth:`CompiledDecoder.step` hands its compiled function, for calling the function uncompiled."""
    from sparsedecode.compiled.decoder import _seek

    position = torch.full((decoder.batch, 1), decoder.position, dtype=torch.long)
    _seek(decoder.cache, decoder.position)
    decoder.position += 1
    return tokens.reshape(decoder.batch, 1), position


FORMS = {"fused": "traced", "op": "prepared"}


@pytest.fixture(params=["fused", "op"])
def path(request):
    """Both forms of the compiled step, as a decoder's ``form``: the host-free step traced into the graph
    (``"traced"``, where it serves the selector) and the custom op ``torch.ops.sparsedecode.sparse_step`` (every
    selector; ``"prepared"``, the CPU's default)."""
    return FORMS[request.param]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_whole_decode_step_compiles_fullgraph_and_gives_the_eager_tokens(arch, path):
    model = tiny_model(arch)
    ids, cfg = _prompt(), SparseConfig(**SMALL_CFG)
    eager_tokens, eager_logits = _session_run(model, ids, cfg)
    uncompiled = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + STEPS + 1, backend="aot_eager", form=path)
    static_tokens, static_logits = _static_run(uncompiled, ids, compiled=False)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + STEPS + 1, backend="aot_eager", form=path)
    tokens, logits = _static_run(decoder, ids)
    assert decoder.compile_s > 0
    assert tokens == eager_tokens == static_tokens
    # the compiled graph calls the same op and the same float32 layers as the uncompiled step
    assert float((logits - static_logits).abs().max()) <= 1e-5
    # the session's step and the static one attend with other kernels over the same support (sums reordered)
    assert torch.allclose(logits, eager_logits, rtol=0, atol=logits_tolerance(eager_logits, model, positions=PROMPT))
    tally = decoder.tally()
    assert tally["sparse_steps"] == STEPS * model.config.num_hidden_layers and tally["dense_steps"] == 0
    assert tally["positions_read"] <= tally["kv_head_steps"] * cfg.effective_support


def _selector_paths() -> list[tuple[str, str]]:
    """Every registered selector but H2O (refused, see below) through the op; those the host-free step serves
    fused too (for the others both settings take the op)."""
    from sparsedecode.step.device import serves

    cases = []
    for name in selector_names():
        if name != "h2o":
            cases.append((name, "op"))
            if serves(SparseConfig(**SMALL_CFG, selector=name)):
                cases.append((name, "fused"))
    return cases


@pytest.mark.parametrize("selector, path", _selector_paths(), indirect=["path"])
@pytest.mark.parametrize("reuse", [1, 4])
def test_static_step_equals_the_session_step_for_every_selector(selector, reuse, path):
    """The op runs the library's selection and kernels: the same tokens as the session for every registered
    selector, with reuse 1 and 4."""
    model = tiny_model("llama")
    ids, cfg = _prompt(2), SparseConfig(**SMALL_CFG, selector=selector, reuse=reuse)
    eager_tokens, eager_logits = _session_run(model, ids, cfg)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + STEPS + 1, backend="aot_eager", form=path)
    tokens, logits = _static_run(decoder, ids, compiled=False)
    assert tokens == eager_tokens
    assert torch.allclose(logits, eager_logits, rtol=0, atol=logits_tolerance(eager_logits, model, positions=PROMPT))


@dataclass(frozen=True)
class MaxKeyBlocks(BlockSelector):
    """A user's selector (the protocol's example): blocks by their largest logit under the group-mean query."""

    name = "max-key-test"

    def score_blocks(self, queries, keys, layout):
        q = group_mean_queries(queries, keys.shape[0])
        logits = torch.einsum("hd,hnd->hn", q, keys.float())[:, 1 : layout.distant_end]
        padded = torch.nn.functional.pad(
            logits, (0, layout.n_blocks * layout.block_size - logits.shape[1]), value=float("-inf")
        )
        return padded.view(keys.shape[0], layout.n_blocks, -1).amax(dim=-1)


def test_a_users_selector_compiles_too():
    model = tiny_model("qwen2")
    ids, cfg = _prompt(3), SparseConfig(**SMALL_CFG, selector=MaxKeyBlocks())
    eager_tokens, _ = _session_run(model, ids, cfg, steps=12)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 13, backend="aot_eager")
    tokens, _ = _static_run(decoder, ids, steps=12)
    assert tokens == eager_tokens


@pytest.mark.parametrize(
    "selector, support, form",
    [
        ("mean-pooled", 40, "prepared"),
        ("mean-pooled", 40, "general"),
        ("mean-pooled", 40, "device"),
        (MaxKeyBlocks(), 40, "prepared"),
        ("streaming", 33, "prepared"),
    ],
)
def test_a_support_without_distant_positions_reads_the_anchor_and_the_window(selector, support, form):
    """A support too small for one distant block (``b = 0``: 40 < 1 + 32 + 8) or position (``S = 1 + W``) reads the
    anchor and the window alone, compiled as in the session: the step's state had room for one block (one position),
    which the C call filled with a block no one asked for, and an empty selection could not be copied into."""
    model = tiny_model("llama")
    ids, cfg = _prompt(4), SparseConfig(support=support, window=32, block_size=8, selector=selector)
    eager_tokens, eager_logits = _session_run(model, ids, cfg, steps=8)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 9, backend="aot_eager", form=form)
    tokens, logits = _static_run(decoder, ids, steps=8, compiled=False)
    assert tokens == eager_tokens
    assert torch.allclose(logits, eager_logits, rtol=0, atol=logits_tolerance(eager_logits, model, positions=PROMPT))
    tally = decoder.tally()
    assert tally["positions_read"] == tally["kv_head_steps"] * (1 + cfg.window) > 0


@pytest.mark.parametrize("support", [40, 33])
def test_the_native_step_refuses_a_support_without_a_distant_block(support):
    """The native step's C call selects and reads at least one block: given none (b = 0) it read a block no one
    asked for (silently other tokens) and, once the step's state had the support's width, crashed the process."""
    model = tiny_model("llama")
    cfg = SparseConfig(support=support, window=32, block_size=8)
    with pytest.raises(SparseDecodeError, match="holds none"):
        decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 9, backend="native")
        _static_run(decoder, _prompt(4), steps=8)


@pytest.mark.parametrize("length", [150, 129])  # 129: a last chunk of one token, dense like the others
@pytest.mark.parametrize("sparse", [False, True])
def test_a_prefill_reads_only_the_positions_written(sparse, length):
    """A prefill chunk attends over the static cache's written positions only (SDPA over the whole cache spent time
    on masked positions): with every position past the prompt poisoned (NaN), the prefill's logits still equal the
    growing cache's prefill, bit for bit in float32, chunk by chunk. A chunk of one token is no decode step."""
    model = tiny_model("llama")
    ids = _prompt(22, length=length)
    _, expected = prefill(model, ids, cache=GrowingCache(config=model.config), chunk=64)
    decoder = CompiledDecoder(model, SparseConfig(**SMALL_CFG) if sparse else None, batch=1, max_len=400)
    with decoder.installed():
        decoder.prefill(ids, chunk=64)  # the cache's tensors exist from here on
        for layer in decoder.cache.layers:
            layer.keys.fill_(float("nan"))
            layer.values.fill_(float("nan"))
        logits = decoder.prefill(ids, chunk=64)
    if length % 64 == 1:  # the growing cache's one-token forward has no mask (another SDPA kernel): round-off apart
        assert torch.allclose(logits, expected, rtol=0, atol=1e-5)
    else:
        assert torch.equal(logits, expected)
    assert decoder.tally()["sparse_steps"] == 0


def test_full_support_equals_dense_and_dense_compiles():
    """A support covering the context is dense attention over ``[0, n)``; the dense decoder (no op) compiles too."""
    model = tiny_model("llama")
    ids = _prompt(4, length=120)
    dense_tokens, dense_logits = _session_run(model, ids, None, steps=16)
    full = CompiledDecoder(model, SparseConfig(support=193), batch=1, max_len=140, backend="aot_eager")
    tokens, logits = _static_run(full, ids, steps=16, compiled=False)
    dense = CompiledDecoder(model, None, batch=1, max_len=140, backend="aot_eager")
    compiled_tokens, compiled_logits = _static_run(dense, ids, steps=16)
    assert tokens == dense_tokens == compiled_tokens
    tolerance = logits_tolerance(dense_logits, model, positions=140)
    assert torch.allclose(logits, dense_logits, rtol=0, atol=tolerance)
    assert torch.allclose(compiled_logits, dense_logits, rtol=0, atol=tolerance)
    assert full.tally()["sparse_steps"] == 0 and full.tally()["dense_steps"] == 16 * 2


def test_full_support_is_the_compiled_dense_decoders_attention_to_the_bit_in_bfloat16():
    """Found by probing: in bfloat16 the op's dense step (SDPA over ``[0, n)``) rounded otherwise than the compiled
    dense decoder's (the whole static cache under its mask) and parted from its tokens at token 18 of 24 here; it
    is now that decoder's computation, so full support is the compiled path's own dense decoding in every dtype."""
    model = tiny_model("llama", dtype=torch.bfloat16)
    ids = _prompt(4, length=200)
    full = CompiledDecoder(model, SparseConfig(support=577, window=64, block_size=8), batch=1, max_len=224,
                           backend="aot_eager")  # fmt: skip
    dense = CompiledDecoder(model, None, batch=1, max_len=224, backend="aot_eager")
    tokens, logits = _static_run(full, ids, steps=8)
    dense_tokens, dense_logits = _static_run(dense, ids, steps=8)
    assert tokens == dense_tokens and torch.equal(logits, dense_logits)
    assert full.tally()["sparse_steps"] == 0


def test_a_long_lived_decoder_equals_fresh_ones_across_prompts_and_rollbacks(path):
    """One decoder over three prompts (the second shorter, so stale blocks would lie inside its context), then a
    rollback of 50 steps (past the window: blocks whose keys change) and other tokens: each the same as a fresh
    decoder's. A rollback restarts the reuse chain (as in a session), so that part runs with reuse 1."""
    model = tiny_model("llama")
    size = PROMPT + 64
    lived = CompiledDecoder(model, SparseConfig(**SMALL_CFG, reuse=3), batch=1, max_len=size, backend="aot_eager")
    for seed, length in ((5, PROMPT), (6, 220), (7, PROMPT)):
        ids = _prompt(seed, length=length)
        fresh = CompiledDecoder(model, lived.cfg, batch=1, max_len=size, backend="aot_eager", form=path)
        assert _static_run(lived, ids, compiled=False)[0] == _static_run(fresh, ids, compiled=False)[0]
    ids, cfg = _prompt(8), SparseConfig(**SMALL_CFG)

    def feed(decoder, tokens):
        return [decoder._forward(*decoder_inputs(decoder, torch.tensor([t]))) for t in tokens]

    lived = CompiledDecoder(model, cfg, batch=1, max_len=size, backend="aot_eager", form=path)
    with lived.installed():
        lived.prefill(ids)
        feed(lived, range(60))
        lived.position -= 50  # roll back 50 steps, then decode other tokens from there
        rolled = feed(lived, range(40, 52))
    fresh = CompiledDecoder(model, cfg, batch=1, max_len=size, backend="aot_eager", form=path)
    with fresh.installed():
        fresh.prefill(ids)
        feed(fresh, range(10))
        direct = feed(fresh, range(40, 52))
    assert all(torch.equal(a, b) for a, b in zip(rolled, direct))


def test_a_batch_decodes_as_each_sequence_alone(path):
    model = tiny_model("qwen2")
    cfg = SparseConfig(**SMALL_CFG)
    ids = torch.cat([_prompt(9), _prompt(10)])
    batch = CompiledDecoder(model, cfg, batch=2, max_len=PROMPT + STEPS + 1, backend="aot_eager", form=path)
    tokens, logits = _static_run(batch, ids, compiled=False)
    for i in range(2):
        alone = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + STEPS + 1, backend="aot_eager", form=path)
        alone_tokens, alone_logits = _static_run(alone, ids[i : i + 1], compiled=False)
        assert tokens[i] == alone_tokens[0]
        # batched and batch-1 float32 layers sum in another order
        tolerance = logits_tolerance(alone_logits, model, positions=PROMPT)
        assert torch.allclose(logits[:, i], alone_logits[:, 0], rtol=0, atol=tolerance)


def test_generate_compile_gives_generate_tokens_and_reuses_the_compiled_step(monkeypatch):
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("llama")
    ids, cfg = _prompt(11), SparseConfig(**SMALL_CFG)
    plain = generate(model, ids, cfg, 20, mode="sparse")
    first = generate(model, ids, cfg, 20, mode="sparse", compile=True)
    again = generate(model, _prompt(12, length=280), cfg, 20, mode="sparse", compile=True)
    assert first.tokens == plain.tokens and first.compile_s > 0
    assert again.tokens == generate(model, _prompt(12, length=280), cfg, 20, mode="sparse").tokens
    assert again.compile_s == 0.0  # the same shapes: the step compiled by the first call
    batch = generate(model, torch.cat([ids, _prompt(13)]), cfg, 8, mode="sparse", compile=True)
    assert [g.tokens for g in batch] == [g.tokens for g in generate(model, [ids, _prompt(13)], cfg, 8, mode="sparse")]
    dense = generate(model, ids, None, 12, mode="dense", compile=True)
    assert dense.tokens == generate(model, ids, None, 12, mode="dense").tokens


@pytest.mark.parametrize("backend", ["aot_eager", "native"])
def test_the_warm_up_step_is_not_counted(backend, monkeypatch):
    """generate(compile=True) compiles with one step at the first decode position, which the decode writes again:
    the tally counted it (30 sparse steps a layer for 29 taken), and dense_layers' steps as dense ones too."""
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", backend)
    model = tiny_model("llama")
    ids, cfg = _prompt(6), SparseConfig(**SMALL_CFG, dense_layers=(0,) if backend == "aot_eager" else ())
    generate(model, ids, cfg, 30, mode="sparse", compile=True)
    tally = compiled.decoder_for(model, cfg, 1, PROMPT + 30).tally()
    layers = model.config.num_hidden_layers
    assert (tally["sparse_steps"], tally["dense_steps"]) == (
        29 * (layers - len(cfg.dense_layers)),
        29 * len(cfg.dense_layers),
    )


def test_lossless_compiled_equals_dense_and_the_sessions_lossless(path, monkeypatch):
    """Lossless with compile=True: the compiled sparse step drafts, the decoder's dense multi-token forward verifies,
    rejected drafts are dropped by moving the position back. Its tokens are dense greedy decoding's, and it drafts
    and accepts exactly as the session's lossless loop does (the same sparse tokens), adaptive ``k`` included; an
    end-of-sequence token stops both where dense decoding stops."""
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("qwen2")
    cfg, ids = SparseConfig(**SMALL_CFG, reuse=3), _prompt(24)  # reuse chains that a rollback must restart
    dense = generate(model, ids, None, 40, mode="dense").tokens
    kwargs = dict(mode="lossless", draft_tokens=2, adaptive=True)
    session, compiled_run = (generate(model, ids, cfg, 40, **kwargs, compile=c) for c in (False, True))
    assert compiled_run.tokens == dense == session.tokens
    assert compiled_run.accepted == session.accepted and compiled_run.draft_lengths == session.draft_lengths
    assert sum(compiled_run.accepted) < sum(compiled_run.draft_lengths), "nothing rolled back"
    assert len(set(compiled_run.draft_lengths)) > 1, "k never adapted"
    stop = dense[17]
    stopped = generate(model, ids, cfg, 40, **kwargs, eos_token_id=stop, compile=True).tokens
    assert stopped == dense[: dense.index(stop) + 1]


@pytest.mark.parametrize(
    "call, message",
    [
        (dict(cfg=SparseConfig(**SMALL_CFG, selector="h2o")), "keeps the attention every position received"),
        (dict(compile="yes"), "compile must be True or False"),
        (dict(padded=True), "needs prompts of one length"),
    ],
)
def test_compile_refuses_what_it_cannot_decode(call, message):
    model = tiny_model("llama")
    cfg = call.get("cfg", SparseConfig(**SMALL_CFG))
    ids = _prompt(14)
    kwargs = {"mode": call.get("mode", "sparse"), "compile": call.get("compile", True)}
    if call.get("padded"):
        ids = [ids, _prompt(15, length=200)]
    with pytest.raises(SparseDecodeError, match=message):
        generate(model, ids, cfg, 8, **kwargs)


def test_compile_refuses_sliding_window_layers():
    """Named in ``layer_types`` (Qwen2 with its window on) or only by ``sliding_window`` (Mistral, whose config has
    no ``layer_types``): refused in one line, dense as sparse (the window's mask reads the cache's length as a
    number, so every compiled step would compile again until dynamo's limit). Mistral without a window is served."""
    from conftest import SMALL
    from transformers import MistralConfig, MistralForCausalLM

    from sparsedecode.compiled.decoder import check_compilable
    from sparsedecode.models.catalog import layer_types

    qwen = tiny_model("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert "sliding_attention" in qwen.config.layer_types
    config = MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=4096, attn_implementation="sdpa")
    mistral = MistralForCausalLM(config).eval()
    assert getattr(mistral.config, "layer_types", None) is None
    for model in (qwen, mistral):
        for mode in ("sparse", "dense"):
            with pytest.raises(SparseDecodeError, match="whose every layer attends fully"):
                generate(model, _prompt(20), SparseConfig(**SMALL_CFG), 8, mode=mode, compile=True)
    mistral.config.sliding_window = None
    assert layer_types(mistral.config) == ["full_attention"] * 2
    for cfg in (None, SparseConfig(**SMALL_CFG)):
        check_compilable(mistral, cfg, "generate")  # nothing to refuse


def test_a_config_that_misstates_the_kv_heads_is_refused_in_one_line(monkeypatch):
    """The step's state is sized from the config before any forward; an architecture that ignores its config's
    ``num_key_value_heads`` (GPT-NeoX given one) would reach the kernel with other shapes: refused when traced."""
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("llama")
    model.config.num_key_value_heads = 4  # the modules were built with 2
    with pytest.raises(SparseDecodeError, match="has 2 KV heads of 16 where the model's config gives 4 of 16"):
        generate(model, _prompt(21), SparseConfig(**SMALL_CFG), 4, mode="sparse", compile=True)


def test_compile_inside_a_session_is_refused():
    model = tiny_model("llama")
    with sparse_decoding(model, SparseConfig(**SMALL_CFG)):
        with pytest.raises(SparseDecodeError, match="inside a sparse_decoding session"):
            generate(model, _prompt(16), SparseConfig(**SMALL_CFG), 8, mode="sparse", compile=True)


@pytest.mark.slow
def test_inductor_compiled_step():
    """The default backend (inductor, C++ code generation): the eager tokens, logits within 1e-5 (inductor fuses
    float32 operations, reordering a few sums: far below that on a 2-layer model)."""
    model = tiny_model("llama")
    ids, cfg = _prompt(17), SparseConfig(**SMALL_CFG)
    eager_tokens, eager_logits = _static_run(
        CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + STEPS + 1), ids, compiled=False
    )
    tokens, logits = _static_run(CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + STEPS + 1), ids)
    assert tokens == eager_tokens
    assert float((logits - eager_logits).abs().max()) <= 1e-5


@pytest.fixture
def device_step_on_cpu():
    """The form CUDA runs (the host-free step inside the op), on the CPU."""
    return "device"


@pytest.mark.parametrize("selector", ["mean-pooled", "quest:grouping=mean-query"])
@pytest.mark.parametrize("reuse", [1, 4])
def test_host_free_step_equals_the_session_step(device_step_on_cpu, selector, reuse):
    """The step CUDA runs inside the op (tensor operations only), run on the CPU: the session's tokens, dense steps
    included (a prompt shorter than the support grows past it)."""
    model = tiny_model("llama")
    for length in (PROMPT, 80):
        ids, cfg = _prompt(18, length=length), SparseConfig(**SMALL_CFG, selector=selector, reuse=reuse)
        _assert_uncompiled_form_equals_session(model, ids, cfg, 40, PROMPT + 41, device_step_on_cpu)


def _assert_uncompiled_form_equals_session(model, ids, cfg, steps: int, max_len: int, form: str) -> None:
    """The decoder's step in ``form``, run uncompiled, gives the session's tokens and logits for ``steps`` steps."""
    eager_tokens, eager_logits = _session_run(model, ids, cfg, steps=steps)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=max_len, backend="aot_eager", form=form)
    tokens, logits = _static_run(decoder, ids, steps=steps, compiled=False)
    assert tokens == eager_tokens
    tolerance = logits_tolerance(eager_logits, model, positions=max_len - 1)
    assert torch.allclose(logits, eager_logits, rtol=0, atol=tolerance)


@pytest.mark.parametrize("supports", [dict(support=1000), dict(support=97, layer_supports={1: 1000, 2: 161})])
def test_host_free_step_serves_a_support_wider_than_the_cache(device_step_on_cpu, supports):
    """Found by probing: a support of more distant blocks than the cache holds (S = 769 over a cache of 512, CUDA's
    default form) ranked its ``capacity`` statistics slots for ``b`` blocks and failed with a tensor-size traceback;
    it is dense attention over the context, as in the session, for every layer's support."""
    model = tiny_model("llama", layers=3)
    for length in (80, PROMPT):
        ids, cfg = _prompt(3, length=length), SparseConfig(window=32, block_size=8, **supports)
        _assert_uncompiled_form_equals_session(model, ids, cfg, 30, length + 31, device_step_on_cpu)


def test_host_free_step_keeps_the_guarantees(device_step_on_cpu):
    """Long-lived across prompts and a rollback past the window, and a batch as each sequence alone, on the step
    CUDA runs inside the op."""
    test_a_long_lived_decoder_equals_fresh_ones_across_prompts_and_rollbacks(device_step_on_cpu)
    test_a_batch_decodes_as_each_sequence_alone(device_step_on_cpu)
    # a prompt prefilled by another decoder sharing the cache (bench e2e --compile, gpu_check.py): resumed
    model, ids, cfg = tiny_model("llama"), _prompt(21), SparseConfig(**SMALL_CFG)
    dense = CompiledDecoder(model, None, batch=1, max_len=PROMPT + 20, backend="aot_eager", form=device_step_on_cpu)
    resumed = CompiledDecoder(
        model, cfg, batch=1, max_len=PROMPT + 20, backend="aot_eager", cache=dense.cache, form=device_step_on_cpu
    )
    with dense.installed():
        first = dense.prefill(ids).argmax(dim=-1).tolist()
    with resumed.installed():
        resumed.resume(PROMPT)
        step = lambda t: resumed._forward(*decoder_inputs(resumed, t))  # noqa: E731
        out, _ = decode_tokens(model, None, first, 16, step_fn=step)
    direct = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 20, backend="aot_eager", form=device_step_on_cpu)
    assert [first + out[0]] == _static_run(direct, ids, steps=16, compiled=False)[0]


def test_host_free_step_traces_without_a_host_read():
    """Dynamo refuses a full graph at any host read (``.item()``, ``bool()``, ``.tolist()``): the host-free step
    traced whole, as CUDA graphs need, and equal to its eager run."""
    from sparsedecode.compiled.op import allocate
    from sparsedecode.step.device import device_step

    cfg = SparseConfig(**SMALL_CFG, reuse=2)
    generator = torch.Generator().manual_seed(19)
    query = torch.randn(2, 4, 1, 16, generator=generator)
    key, value = torch.randn(2, 2, 400, 16, generator=generator), torch.randn(2, 2, 400, 16, generator=generator)

    def run(step):
        state = allocate(cfg, 0, 2, 2, 16, 400, "cpu", "device")
        outs = []
        for n in (90, 97, 98, 300, 301, 302):
            position = torch.full((2, 1), n - 1)
            outs.append(
                step(cfg, ("mean",), 0, 0.25, query, key, value, position, state.stats, state.blocks, state.step,
                     state.last, state.tally)
            )  # fmt: skip
        return torch.stack(outs), state.tally

    compiled = torch.compile(device_step, fullgraph=True, backend="aot_eager", dynamic=False)
    eager_out, eager_tally = run(device_step)
    compiled_out, compiled_tally = run(compiled)
    assert torch.equal(eager_out, compiled_out) and torch.equal(eager_tally, compiled_tally)


@pytest.mark.parametrize("batch", [1, 2])
def test_the_prepared_call_equals_the_general_op_path(batch, monkeypatch):
    """The op's prepared C call (made once per layer state, integers through NumPy views) gives the general path's
    logits bit for bit (the same C call) and the same state: over prompts of other lengths (stale blocks inside the
    second), reuse 3 (rows reusing and reselecting), a rollback, and positions read counted alike."""
    from sparsedecode.compiled import prepared as prepared_module

    model = tiny_model("qwen2")
    cfg = SparseConfig(**SMALL_CFG, reuse=3)
    size = PROMPT + 64

    def run(fast: bool):
        prepared_module.PREPARED.clear()
        form = "prepared" if fast else "general"
        decoder = CompiledDecoder(model, cfg, batch=batch, max_len=size, backend="aot_eager", form=form)
        seen = []
        for seed, length in ((5, PROMPT), (6, 220)):
            seen += _static_run(decoder, _prompt(seed, length=length, batch=batch), steps=20, compiled=False)[1]
        with decoder.installed():
            decoder.position -= 30
            for t in range(40, 52):
                seen.append(decoder._forward(*decoder_inputs(decoder, torch.full((batch,), t))))
        prepared = [p for p in prepared_module.PREPARED.values() if p is not None]
        return seen, decoder.tally(), [s.step.clone() for s in decoder.states.values()], prepared

    general, general_tally, general_steps, none = run(False)
    fast, fast_tally, fast_steps, prepared = run(True)
    assert not none and len(prepared) == model.config.num_hidden_layers  # one prepared call per layer, used
    assert all(torch.equal(a, b) for a, b in zip(general, fast))
    assert general_tally == fast_tally and all(torch.equal(a, b) for a, b in zip(general_steps, fast_steps))


@pytest.mark.parametrize("chunk", [8192, 16])  # 16: the 40 outputs in pieces of 16, 16 and 8, as a vocabulary's
def test_half_precision_linear_rows_sum_in_float32(monkeypatch, chunk):
    """A half-precision model's one-token linear layers in the compiled step: products and one sum in float32,
    rounded once, so within one rounding of the float32 result (as F.linear's own half-precision path), whether the
    outputs are summed at once or in pieces; more than one token goes through F.linear itself."""
    from sparsedecode.compiled import cpu as compile_cpu
    from sparsedecode.compiled.cpu import row_linear

    monkeypatch.setattr(compile_cpu, "ROW_CHUNK", chunk)

    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        linear = torch.nn.Linear(96, 40, bias=True).to(dtype)
        x = torch.randn(1, 1, 96, generator=generator).to(dtype)
        exact = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
        out = row_linear(linear, x)
        assert out.dtype == dtype and out.shape == (1, 1, 40)
        # one rounding to dtype (half an ulp of the result) plus float32 round-off of 97 terms, far below it
        ulp = torch.finfo(dtype).eps * exact.abs()
        assert bool(((out.double() - exact).abs() <= ulp / 2 + 1e-5).all())
        several = torch.randn(1, 3, 96, generator=generator).to(dtype)
        assert torch.equal(row_linear(linear, several), linear(several))


def test_a_half_precision_compiled_step_uses_row_linears_and_gives_the_uncompiled_step(monkeypatch):
    """bfloat16 on the CPU: the compiled step computes its one-token linears as float32 row sums (the installed
    layers), the compiled graph and the same step uncompiled give the same logits, and the layers are restored."""
    from sparsedecode.compiled import cpu as compile_cpu

    model = tiny_model("llama").to(torch.bfloat16)
    ids, cfg = _prompt(3), SparseConfig(**SMALL_CFG)
    uncompiled = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 9, backend="aot_eager")
    with uncompiled.installed():
        patched = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and "forward" in vars(m)]
    assert patched and len(patched) == sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))
    static_tokens, static_logits = _static_run(uncompiled, ids, steps=8, compiled=False)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 9, backend="aot_eager")
    tokens, logits = _static_run(decoder, ids, steps=8)
    assert tokens == static_tokens and torch.equal(logits, static_logits)
    monkeypatch.setattr(compile_cpu, "ROW_PRODUCTS", False)
    with CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 9, backend="aot_eager").installed():
        assert not any("forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_a_model_changed_between_installs_gets_a_step_compiled_for_it(monkeypatch):
    """dynamo's guards on the modules' attributes are checked once per install (sparsedecode.compiled.guards): one
    layer's attention scale changed between two installs is decoded with the new value, as the uncompiled step
    decodes it. Without the install's check the guards left would replay the old step (shown last)."""

    model = tiny_model("llama")
    ids, cfg = _prompt(4), SparseConfig(**SMALL_CFG)

    def decoder():
        return CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 9, backend="aot_eager")

    kept = decoder()
    before = _static_run(kept, ids, steps=8)
    attention = model.model.layers[0].self_attn
    monkeypatch.setattr(attention, "scaling", attention.scaling * 0.5)
    changed, reference = _static_run(kept, ids, steps=8), _static_run(decoder(), ids, steps=8, compiled=False)
    assert not torch.equal(changed[1], before[1])
    assert changed[0] == reference[0] and torch.equal(changed[1], reference[1])
    stale = decoder()
    _static_run(stale, ids, steps=8)  # compiled with the halved scale
    monkeypatch.setattr(stale, "_fingerprinted", lambda: "unchanged")  # an install that checks nothing
    monkeypatch.setattr(stale, "_fingerprint", "unchanged")
    monkeypatch.setattr(attention, "scaling", attention.scaling * 2)  # back to the first run's
    assert not torch.equal(_static_run(stale, ids, steps=8)[1], before[1]), "the halved scale's step, replayed"


def _replace_attention(model, layer: int) -> None:
    """Layer ``layer``'s attention replaced by another module of its class holding the same weights."""
    old = model.model.layers[layer].self_attn
    new = type(old)(model.config, layer_idx=old.layer_idx)
    new.load_state_dict(old.state_dict())
    model.model.layers[layer].self_attn = new.eval().requires_grad_(False)


@pytest.mark.parametrize("backend", ["aot_eager", "native"])
def test_an_attention_module_replaced_between_installs_keeps_its_layer_sparse(backend):
    """Found by probing: a layer's attention replaced by an equal module of its class (the step's fingerprint cannot
    tell them apart) between two installs takes over its layer's state (states are kept by layer index): its steps
    stay sparse, the session's tokens. Keyed by the old module, the new one found no state and decoded dense."""
    model = tiny_model("llama")
    ids, cfg = _prompt(3), SparseConfig(**SMALL_CFG)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 17, backend=backend)
    before = _static_run(decoder, ids, steps=16)
    _replace_attention(model, 1)
    tally = decoder.tally()
    after = _static_run(decoder, ids, steps=16)
    assert after[0] == before[0] == _session_run(model, ids, cfg, steps=16)[0]
    assert decoder.tally()["sparse_steps"] - tally["sparse_steps"] == tally["sparse_steps"]  # both layers sparse
    assert not any(hasattr(m, "_sparsedecode_static") for m in model.modules())  # nothing left after the install


def test_which_decoders_freeze_the_weights(monkeypatch):
    """inductor on the CPU freezes the weights into the step (sparsedecode.compiled.cpu.FREEZE), except where the
    half-precision one-row step computes its linears as row products or the memory available does not hold four times
    the weights (what freezing keeps and needs while compiling), and autotunes a frozen step of several rows
    (AUTOTUNE); not with other backends, nor when turned off. Constructing a decoder compiles nothing."""
    from sparsedecode.compiled import cpu as compile_cpu

    model = tiny_model("llama")

    def decoder(m, batch: int, backend: str = "inductor") -> CompiledDecoder:
        return CompiledDecoder(m, None, batch=batch, max_len=64, backend=backend)

    def frozen(m, batch: int, backend: str = "inductor") -> bool:
        return decoder(m, batch, backend).frozen

    assert frozen(model, 1) and frozen(model, 2) and not frozen(model, 2, "aot_eager")
    half = tiny_model("llama").to(torch.bfloat16)
    assert not frozen(half, 1) and frozen(half, 2)
    assert decoder(half, 2).autotuned and decoder(model, 2).autotuned  # several rows
    assert not decoder(half, 1).autotuned and not decoder(model, 1).autotuned
    weights = sum(p.nelement() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(compile_cpu, "available_memory_bytes", lambda: 4 * weights)
    assert frozen(model, 2)
    monkeypatch.setattr(compile_cpu, "available_memory_bytes", lambda: 4 * weights - 1)  # no room for the copies
    assert not frozen(model, 2) and frozen(half, 2)  # half the bytes: room
    monkeypatch.setattr(compile_cpu, "available_memory_bytes", lambda: 2 * weights - 1)
    assert not frozen(half, 2) and not decoder(half, 2).autotuned
    monkeypatch.setattr(compile_cpu, "available_memory_bytes", lambda: None)  # unknown: room
    assert frozen(model, 2)
    monkeypatch.setattr(compile_cpu, "FREEZE", False)
    assert not frozen(model, 2)


def test_memory_taken_before_compiling_unfreezes_the_step(monkeypatch):
    """Room to freeze is asked again when the step compiles: decoders made together (a dense and a sparse one over one
    cache) each saw the memory free before any compiled, and the later ones must not freeze into what the earlier
    ones' copies took (a CPU run with llama3-8b's shapes was killed for memory so). A step compiled frozen stays so."""
    from sparsedecode.compiled import cpu as compile_cpu

    model = tiny_model("llama")
    ids, cfg = _prompt(8, batch=2), SparseConfig(**SMALL_CFG)
    weights = sum(p.nelement() * p.element_size() for p in model.parameters())
    made = [CompiledDecoder(model, cfg, batch=2, max_len=PROMPT + 9, backend="aot_eager") for _ in range(2)]
    for decoder in made:
        decoder.frozen = decoder.autotuned = True  # what inductor with room would choose; aot_eager compiles fast
    monkeypatch.setattr(compile_cpu, "available_memory_bytes", lambda: 4 * weights)
    first = _static_run(made[0], ids, steps=3)
    assert made[0].frozen and made[0].autotuned
    monkeypatch.setattr(compile_cpu, "available_memory_bytes", lambda: 4 * weights - 1)  # the first one's copies
    second = _static_run(made[1], ids, steps=3)
    assert not made[1].frozen and not made[1].autotuned
    assert _static_run(made[0], ids, steps=3)[0] == first[0] and made[0].frozen  # compiled: nothing asked again
    assert second[0] == first[0]


def test_weights_changed_in_place_compile_a_frozen_step_again():
    """A step with the weights frozen into it holds their values: an in-place change between installs (a
    fine-tuning step, ``load_state_dict``) must compile it again, at the next install; an install with nothing
    changed keeps it (a captured step standing in for inductor's frozen one)."""
    model = tiny_model("llama")
    ids, cfg = _prompt(5, batch=2), SparseConfig(**SMALL_CFG)
    decoder = CompiledDecoder(model, cfg, batch=2, max_len=PROMPT + 9, backend="aot_eager")
    decoder.frozen = True
    _static_run(decoder, ids, steps=4)
    step = decoder._compiled
    _static_run(decoder, ids, steps=4)
    assert decoder._compiled is step
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
    changed = _static_run(decoder, ids, steps=4)
    assert decoder._compiled is not step
    reference = _static_run(CompiledDecoder(model, cfg, batch=2, max_len=PROMPT + 9), ids, steps=4, compiled=False)
    assert changed[0] == reference[0] and torch.equal(changed[1], reference[1])


@pytest.mark.slow
def test_inductor_frozen_batch_step():
    """inductor with the weights frozen (a batch of two, float32): the eager tokens and logits within 1e-5 (packed
    linear layers sum in another order); a weight changed in place between installs is decoded with its new value,
    as the uncompiled step decodes it, and with the install's check disabled the frozen step would replay the old
    value (shown last)."""
    model = tiny_model("llama")
    ids, cfg = _prompt(6, batch=2), SparseConfig(**SMALL_CFG)

    def run(compiled=True, decoder=None):
        decoder = decoder or CompiledDecoder(model, cfg, batch=2, max_len=PROMPT + STEPS + 1)
        return _static_run(decoder, ids, compiled=compiled)

    kept = CompiledDecoder(model, cfg, batch=2, max_len=PROMPT + STEPS + 1)
    assert kept.frozen
    (tokens, logits), (eager_tokens, eager_logits) = run(decoder=kept), run(compiled=False)
    assert tokens == eager_tokens and float((logits - eager_logits).abs().max()) <= 1e-5
    weight = model.model.layers[1].mlp.down_proj.weight
    with torch.no_grad():
        weight.mul_(-1.0)
    (tokens, logits), (eager_tokens, eager_logits) = run(decoder=kept), run(compiled=False)
    assert tokens == eager_tokens and float((logits - eager_logits).abs().max()) <= 1e-5
    kept._fingerprinted = lambda: "unchanged"  # an install that checks nothing
    kept._fingerprint = "unchanged"
    with torch.no_grad():
        weight.mul_(-1.0)
    stale = run(decoder=kept)[1]
    assert float((stale - run(compiled=False)[1]).abs().max()) > 1e-3, "the frozen step replayed the old weight"


@pytest.mark.slow
def test_autotuned_step_compiles_quietly(capfd):
    """An autotuned step (frozen, bfloat16, two rows) compiles and decodes without writing autotuning's timings, its
    choices' statistics or torch's own warnings to the user's stderr (a command's output stays the command's); no
    cache of inductor's may skip the autotuning."""
    from torch._inductor import config

    model = tiny_model("llama").to(torch.bfloat16)
    # config.patch, not monkeypatch: monkeypatch's undo left the option hidden ("does not exist") for later compiles
    with config.patch(force_disable_caches=True):
        decoder = CompiledDecoder(model, SparseConfig(**SMALL_CFG), batch=2, max_len=PROMPT + 5)
        assert decoder.autotuned
        tokens, _ = _static_run(decoder, _prompt(7, batch=2), steps=4)
    assert len(tokens) == 2 and all(len(row) == 5 for row in tokens)
    err = capfd.readouterr().err
    assert "Autotune" not in err and "AUTOTUNE" not in err and "Warning" not in err, err[-2000:]


def test_the_guard_filter_keeps_tensor_guards_and_drops_module_attributes():
    """What sparsedecode.compiled.guards.drop_module_guards leaves to dynamo: a parameter of another shape is seen
    (tensor guards stay), a module's plain attribute is not (the install's fingerprint covers those)."""
    from sparsedecode.compiled.guards import drop_module_guards, model_fingerprint

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.factor = torch.nn.Linear(4, 4, bias=False), 2.0

        def forward(self, x):
            return self.linear(x) * self.factor

    module, x = Scaled(), torch.ones(1, 4)
    step = torch.compile(module, fullgraph=True, backend="eager", options={"guard_filter_fn": drop_module_guards})
    assert torch.equal(step(x), module(x))
    module.linear.weight = torch.nn.Parameter(torch.ones(3, 4))
    assert step(x).shape == (1, 3) and torch.equal(step(x), module(x))
    module.config = types.SimpleNamespace()  # model_fingerprint reads a model's config
    fingerprint = model_fingerprint(module)
    module.factor = 3.0
    assert not torch.equal(step(x), module(x)), "dropped: the attribute's guard"
    assert model_fingerprint(module) != fingerprint


def test_a_hook_replaced_between_installs_compiles_the_step_again(monkeypatch):
    """Found by probing: a forward hook removed and another registered in its place between two calls (a steering
    hook of other strength, as a ``with`` block registering its own hook makes) left the hook count as it was, so the
    install's fingerprint saw no change and the compiled step replayed the old hook: the prefill (eager) gave the new
    hook's first token, the decode steps the old hook's tokens, dense and sparse."""
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("llama")
    ids, cfg = _prompt(3), SparseConfig(**SMALL_CFG)

    def shifted(by):
        return lambda module, inputs, output: output + by

    mlp = model.model.layers[0].mlp
    for mode, config in (("sparse", cfg), ("dense", None)):
        handle = mlp.register_forward_hook(shifted(0.0))
        generate(model, ids, config, 12, mode=mode, compile=True)
        handle.remove()
        handle = mlp.register_forward_hook(shifted(5.0))
        tokens = generate(model, ids, config, 12, mode=mode, compile=True).tokens
        assert tokens == generate(model, ids, config, 12, mode=mode).tokens
        handle.remove()


def test_a_hooks_own_state_changed_between_installs_compiles_the_step_again(monkeypatch):
    """Found by probing: a hook object's attribute (a steering strength) changed between two calls: dynamo's guard on
    it was dropped with the modules' attribute guards (it is reached through a module's hook dict) although it is on
    what is not a module, so the compiled step replayed the old strength (decode tokens parting from the eager ones
    at the second token)."""
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("llama")
    ids, cfg = _prompt(3), SparseConfig(**SMALL_CFG)

    class Steer:
        def __init__(self):
            self.by = 0.0

        def __call__(self, module, inputs, output):
            return output + self.by

    steer = Steer()
    model.model.layers[0].mlp.register_forward_hook(steer)
    generate(model, ids, cfg, 12, mode="sparse", compile=True)
    steer.by = 5.0
    tokens = generate(model, ids, cfg, 12, mode="sparse", compile=True).tokens
    assert tokens == generate(model, ids, cfg, 12, mode="sparse").tokens


def test_a_compiled_decoder_is_used_installed_by_one_thread_per_model(monkeypatch):
    """Found by probing: a step outside ``installed()`` compiled a graph without the step's state that later
    installed runs replayed (wrong tokens for good); a model installed in one thread was decoded by another with
    the first one's step (wrong tokens in both); a model moved to bfloat16 reused its float32 decoder and cache."""
    import threading

    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("llama")
    ids, cfg = _prompt(3), SparseConfig(**SMALL_CFG)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=PROMPT + 8, backend="aot_eager")
    with pytest.raises(SparseDecodeError, match="inside `with decoder.installed"):
        decoder.step(torch.tensor([5]))
    with pytest.raises(SparseDecodeError, match="inside `with decoder.installed"):
        decoder.prefill(ids)
    refused = []

    def elsewhere():
        try:
            generate(model, ids, cfg, 4, mode="sparse")
        except SparseDecodeError as error:
            refused.append(str(error))

    with decoder.installed():
        decoder.prefill(ids)
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    assert refused and "another thread is decoding this model compiled" in refused[0]
    eager = generate(model, ids, cfg, 8, mode="sparse").tokens
    assert generate(model, ids, cfg, 8, mode="sparse", compile=True).tokens == eager  # after all that
    model.to(torch.bfloat16)
    assert (
        generate(model, ids, cfg, 8, mode="sparse", compile=True).tokens
        == generate(model, ids, cfg, 8, mode="sparse").tokens
    )


@pytest.mark.parametrize("kernel", ["c", "triton"])
def test_the_host_free_step_is_not_chosen_over_an_insisted_kernel(kernel):
    """Found by probing: the host-free forms run torch operations of their own, so a kernel insisted on (``c``,
    ``triton``) was ignored there (the session and the prepared form use it, or refuse it in one line)."""
    from sparsedecode.compiled.op import step_form

    cfg = SparseConfig(**SMALL_CFG, kernel=kernel)
    assert step_form(cfg, "cuda") == "prepared" and step_form(SparseConfig(**SMALL_CFG), "cuda") == "device"
    for form in ("device", "traced"):
        with pytest.raises(SparseDecodeError, match=f"on torch operations; mean-pooled, kernel='{kernel}' is not one"):
            step_form(cfg, "cpu", form)

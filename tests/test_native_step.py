"""The native decode step (sparsedecode.compiled.native, ``model_step`` in kernels/cpu/csrc/model.h): a whole decode
step in one C call. It must give the static step's tokens, logits (to round-off) and state (counts, chosen blocks,
reuse counters, tallies) on tiny Llama and Qwen2 models, float32 and quantized, dense and sparse, one row and two;
a support of at least the context must decode exactly as its own dense decoding; what it does not compute is
refused in one line before any decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import logits_tolerance, tiny_family, tiny_model

from sparsedecode import SparseConfig
from sparsedecode.compiled.decoder import CompiledDecoder, _seek, check_backend
from sparsedecode.compiled.native import NATIVE
from sparsedecode.decoding.loop import decode_tokens
from sparsedecode.errors import SparseDecodeError
from sparsedecode.kernels import cpu
from sparsedecode.models.quantized import quantize_linears
from sparsedecode.protocol.diagnostics import margin_certificate
from sparsedecode.selectors import selector_names

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="the C kernel does not build here")

STEPS = 40
SMALL_CFG = dict(support=97, window=32, block_size=8)


def _prompt(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


def _run(model, cfg, ids, backend, steps=STEPS):
    """Tokens, every step's logits and the final state of a decoder with ``backend`` (``"eager"``: the static
    step's function uncompiled, the reference), prefilled with ``ids``."""
    decoder = CompiledDecoder(model, cfg, batch=ids.shape[0], max_len=512, backend=backend)

    def eager(tokens):
        position = torch.full((decoder.batch, 1), decoder.position, dtype=torch.long)
        _seek(decoder.cache, decoder.position)
        decoder.position += 1
        return decoder._forward(tokens.reshape(decoder.batch, 1), position)

    seen = []
    with decoder.installed():
        first = decoder.prefill(ids).argmax(dim=-1).tolist()
        step = eager if backend == "aot_eager" else decoder.step
        out, _ = decode_tokens(model, None, first, steps, on_logits=lambda _, lg: seen.append(lg.clone()), step_fn=step)
    state = {
        i: [getattr(s, name).clone() for name in ("stats", "count", "blocks", "step", "last", "tally")]
        for i, s in enumerate(decoder.states.values())
    }
    return [[f, *o] for f, o in zip(first, out)], torch.stack(seen), state


def _model(arch: str, weights: str, **overrides):
    model = tiny_model(arch, **overrides)
    if weights != "float32":
        quantize_linears(model, weights)
    return model


def _assert_same(reference, native, model, weights: str) -> None:
    """The native run decodes as the reference up to the first step the greedy certificate does not cover (the
    reference's top-1/top-2 margin at most twice the native logits' difference: a near tie, where sums in another
    order, or a quantized layer's int8 rounding of its activations, may pick the other token): each step's logits
    within tolerance and the tokens they give equal until then; the state compared where every step is covered. At
    least four steps are compared (a near tie is rare: the test cannot pass on none)."""
    tokens, logits, state = reference
    n_tokens, n_logits, n_state = native
    # float32: the same model in other kernels (sums reordered); quantized: the activations' int8 rounding turns a
    # last-bit difference into a step of one of 127 in a group's scale now and then
    tolerance = logits_tolerance(logits, model, positions=512)
    if weights != "float32":
        tolerance = 0.02 * float(logits.abs().max())
    # logits[i] (batch, vocab) gives every row's token i + 1; the project's certificate, row by row
    certified = [margin_certificate(logits[:, r], n_logits[:, r])["certified"] for r in range(logits.shape[1])]
    uncovered = [i for i in range(len(logits)) if not all(c[i] for c in certified)]
    covered = uncovered[0] if uncovered else len(logits)
    assert float((n_logits[: covered + 1] - logits[: covered + 1]).abs().max()) <= tolerance
    assert covered >= min(4, len(logits)), f"a near tie at step {covered}"
    assert [row[: covered + 1] for row in n_tokens] == [row[: covered + 1] for row in tokens]
    if covered < len(logits):
        return
    assert n_tokens == tokens
    for layer, tensors in state.items():
        for mine, theirs in zip(n_state[layer], tensors):
            assert torch.equal(mine, theirs) or torch.allclose(mine, theirs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", ["float32", "int4", "int5", "int8"])
def test_native_step_gives_the_static_steps_tokens_logits_and_state(arch, weights):
    model = _model(arch, weights)
    cases = [(None, 2, 300), (SparseConfig(**SMALL_CFG), 2, 300), (SparseConfig(**SMALL_CFG, reuse=4), 1, 80)]
    for cfg, batch, length in cases:  # the short prompt: dense steps (N <= S), then sparse ones
        ids = _prompt(batch, length)
        reference, native = _run(model, cfg, ids, "aot_eager"), _run(model, cfg, ids, NATIVE)
        _assert_same(reference, native, model, weights)
        if cfg is not None:
            tally = native[2][0][-1]
            assert tally[0] > 0 and (length > cfg.effective_support or tally[1] > 0)


@pytest.mark.parametrize("weights", ["float32", "int4", "int5", "int8"])
def test_native_step_at_two_threads_splits_its_products_and_gives_the_static_steps_results(weights):
    """Weights large enough to split over two threads (q of 512 x 512, an MLP of 1024: int4's groups in two slices,
    int8's and float32's outputs in parts), q, k and v in one parallel region and gate and up in another, k and v
    too small to split (GQA) beside q's parts; Qwen2's q/k/v biases added after: the static step's tokens, logits
    and state."""
    model = _model("qwen2", weights, hidden_size=512, intermediate_size=1024, num_attention_heads=8, head_dim=64,
                   num_key_value_heads=2)  # fmt: skip
    ids, cfg = _prompt(1, 300), SparseConfig(**SMALL_CFG)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        reference, native = _run(model, cfg, ids, "aot_eager", steps=12), _run(model, cfg, ids, NATIVE, steps=12)
    finally:
        torch.set_num_threads(previous)
    _assert_same(reference, native, model, weights)


def test_native_step_of_odd_sizes():
    """Sizes no vector width divides: head dim 18, an MLP of 50, a hidden size of 72 (the float32 product's tail,
    the attention's remainder lanes)."""
    model = _model("llama", "float32", hidden_size=72, intermediate_size=50, head_dim=18)
    ids, cfg = _prompt(1, 300), SparseConfig(**SMALL_CFG)
    _assert_same(_run(model, cfg, ids, "aot_eager"), _run(model, cfg, ids, NATIVE), model, "float32")


@pytest.mark.parametrize("weights", ["float32", "int4"])
def test_full_support_is_the_native_steps_own_dense_decoding(weights):
    model = _model("llama", weights)
    ids = _prompt(1, 300)
    dense_tokens, dense_logits, _ = _run(model, None, ids, NATIVE)
    full = SparseConfig(support=1 + 32 + 8 * 64, window=32, block_size=8)  # >= every context of a 512 cache
    tokens, logits, state = _run(model, full, ids, NATIVE)
    assert tokens == dense_tokens and torch.equal(logits, dense_logits)
    assert int(state[0][-1][0]) == 0 and int(state[0][-1][1]) == STEPS  # every step dense, counted so


def test_every_selector_is_served_as_the_static_step_or_refused_in_one_line():
    model = tiny_model("llama")
    ids = _prompt(1, 300)
    served = []
    for name in selector_names():
        if name == "h2o":  # refused by every compiled decoder (tests/test_compiled.py)
            continue
        cfg = SparseConfig(**SMALL_CFG, selector=name)
        try:
            native = _run(model, cfg, ids, NATIVE, steps=12)
        except SparseDecodeError as error:
            assert "\n" not in str(error) and "native decode step" in str(error)
            continue
        _assert_same(_run(model, cfg, ids, "aot_eager", steps=12), native, model, "float32")
        served.append(name)
    assert SparseConfig().selector.spec() in served  # the default selector at least


def test_a_kernel_other_than_the_c_one_is_refused_by_its_name():
    """kernel='torch' scores in torch: refused naming the kernel, not the (served) default selector."""
    model = tiny_model("llama")
    with pytest.raises(SparseDecodeError, match="not kernel='torch'") as caught:
        CompiledDecoder(model, SparseConfig(**SMALL_CFG, kernel="torch"), batch=1, max_len=512, backend=NATIVE)
    assert "mean-pooled is not one" not in str(caught.value) and "\n" not in str(caught.value)
    CompiledDecoder(model, SparseConfig(**SMALL_CFG, kernel="c"), batch=1, max_len=512, backend=NATIVE)


def test_what_it_does_not_compute_is_refused_before_decoding():
    assert check_backend(NATIVE) == NATIVE
    cfg = SparseConfig(**SMALL_CFG)
    hooked = tiny_model("llama")
    hooked.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 2)
    half = tiny_model("llama", dtype=torch.bfloat16)
    other = tiny_family("gemma")
    windowed = tiny_family("mistral", sliding_window=128)
    for model, words in ((hooked, "hook"), (half, "float32"), (other, "serves"), (windowed, "sliding window")):
        with pytest.raises(SparseDecodeError, match=words) as caught:
            CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
        assert "\n" not in str(caught.value)
    plain = tiny_model("llama")
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: out)
    try:
        with pytest.raises(SparseDecodeError, match="global module hook"):
            CompiledDecoder(plain, cfg, batch=1, max_len=512, backend=NATIVE)
    finally:
        handle.remove()
    CompiledDecoder(plain, cfg, batch=1, max_len=512, backend=NATIVE)  # served once the hook is gone
    CompiledDecoder(tiny_family("mistral", sliding_window=None), cfg, batch=1, max_len=512, backend=NATIVE)


def test_modules_replaced_between_installs_are_read_at_the_next_install():
    model = tiny_model("llama")
    ids, cfg = _prompt(1, 300), SparseConfig(**SMALL_CFG)
    decoder = CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    with decoder.installed():
        token = decoder.prefill(ids).argmax(-1)
        before = decoder.step(token)
    replaced = torch.nn.Linear(model.config.intermediate_size, model.config.hidden_size, bias=False)
    model.model.layers[0].mlp.down_proj = replaced
    reference = CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    with reference.installed():
        reference.prefill(ids)
        expected = reference.step(token)
    with decoder.installed():
        decoder.prefill(ids)
        after = decoder.step(token)
    assert not torch.allclose(before, after) and torch.equal(after, expected)


def test_the_block_means_it_completes_are_the_keys_means():
    """A layer keeping block means only completes them in the C call (complete_means): each equals the float64 mean
    of its block's cached keys to float32 round-off, for every row and block the state counts."""
    model = _model("qwen2", "float32")
    ids = _prompt(2, 300)
    decoder = CompiledDecoder(model, SparseConfig(**SMALL_CFG), batch=2, max_len=512, backend=NATIVE)
    with decoder.installed():
        first = decoder.prefill(ids).argmax(dim=-1).tolist()
        decode_tokens(model, None, first, STEPS, step_fn=decoder.step)
    for index, state in enumerate(decoder.states.values()):
        keys = decoder.cache.layers[index].keys.double()
        for row in range(2):
            count = int(state.count[row])
            assert count >= (300 - 32 - 1) // 8  # every prompt block, and those completed while decoding
            blocks = keys[row, :, 1 : 1 + count * 8].reshape(keys.shape[1], count, 8, -1).mean(dim=2)
            stored = state.stats[0, row, :, :, :count].transpose(1, 2).double()
            assert torch.allclose(stored, blocks, rtol=1e-6, atol=1e-6)


def test_block_means_split_over_threads_are_one_threads_to_the_bit():
    """complete_means splits the prompt's blocks over threads in ranges of 64 per row and KV head: at two threads
    (a 700-token prompt: 82 blocks of 8 per head, two ranges each) the means, the tokens and the logits are one
    thread's, bit for bit, and the means are the keys' own."""
    model = _model("llama", "int4")
    ids = _prompt(2, 700, seed=3)
    runs = []
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            decoder = CompiledDecoder(model, SparseConfig(**SMALL_CFG), batch=2, max_len=760, backend=NATIVE)
            with decoder.installed():
                first = decoder.prefill(ids).argmax(dim=-1).tolist()
                seen: list[torch.Tensor] = []
                out, _ = decode_tokens(
                    model, None, first, 4, on_logits=lambda _, lg, seen=seen: seen.append(lg.clone()),
                    step_fn=decoder.step,
                )  # fmt: skip
        finally:
            torch.set_num_threads(previous)
        stats = [(s.stats.clone(), s.count.clone()) for s in decoder.states.values()]
        runs.append((out, torch.stack(seen), stats, decoder))
    (out1, logits1, stats1, _), (out2, logits2, stats2, decoder) = runs
    assert out1 == out2 and torch.equal(logits1, logits2)
    for index, ((a, count_a), (b, count_b)) in enumerate(zip(stats1, stats2)):
        assert torch.equal(count_a, count_b) and torch.equal(a, b)
        count = int(count_b[0])
        assert count >= (700 - 32 - 1) // 8
        keys = decoder.cache.layers[index].keys.double()
        blocks = keys[:, :, 1 : 1 + count * 8].reshape(2, keys.shape[1], count, 8, -1).mean(dim=3)
        assert torch.allclose(b[0, :, :, :, :count].transpose(2, 3).double(), blocks, rtol=1e-6, atol=1e-6)


def test_what_it_reads_is_checked_before_decoding_and_followed_within_an_install(monkeypatch):
    """Each case the native step computed wrongly or read freed memory for, in one line before any prefill now: a
    cache shorter than the decoder, a layer norm in bfloat16 or strided, a forward replaced on a class, a layer of
    another shape, a selector it does not serve; and weights replaced between two steps of one install are read."""
    from transformers import StaticCache
    from transformers.models.llama import modeling_llama

    from sparsedecode.compiled.native import check

    cfg = SparseConfig(**SMALL_CFG)
    model = tiny_model("llama")
    short = StaticCache(config=model.config, max_cache_len=128)
    with pytest.raises(SparseDecodeError, match="cache holds 128 positions"):
        CompiledDecoder(model, None, batch=1, max_len=512, backend=NATIVE, cache=short)
    cases = {
        "bfloat16": lambda m: m.model.layers[0].input_layernorm.to(torch.bfloat16),
        "not contiguous": lambda m: setattr(
            m.model.layers[1].post_attention_layernorm, "weight", torch.nn.Parameter(torch.ones(128)[::2])
        ),
        "shape": lambda m: setattr(m.model.layers[1].mlp, "gate_proj", torch.nn.Linear(64, 96, bias=False)),
    }
    for words, change in cases.items():
        changed = tiny_model("llama")
        change(changed)
        with pytest.raises(SparseDecodeError, match=words) as caught:
            CompiledDecoder(changed, cfg, batch=1, max_len=512, backend=NATIVE)
        assert "\n" not in str(caught.value)
    with pytest.raises(SparseDecodeError, match="quest is not one"):
        check(model, SparseConfig(**SMALL_CFG, selector="quest"), "cpu")
    original = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: 2 * original(self, x))
    with pytest.raises(SparseDecodeError, match="LlamaMLP.forward was replaced"):
        CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    monkeypatch.undo()

    ids = _prompt(1, 300)
    native = CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    reference = tiny_model("llama")
    edits = [
        lambda m: setattr(m.model.layers[0].mlp.down_proj, "weight", torch.nn.Parameter(torch.ones(64, 128) / 100)),
        lambda m: setattr(m.model.layers[1].input_layernorm.weight, "data", torch.full((64,), 0.5)),
        lambda m: setattr(m.model.layers[1].post_attention_layernorm, "variance_epsilon", 0.25),
    ]
    with native.installed():
        native.step(native.prefill(ids).argmax(-1))  # the tables built
        for edit in edits:  # between two steps of one install
            edit(model)
            edit(reference)
            got = native.step(native.prefill(ids).argmax(-1))
            _, expected, _ = _run(reference, cfg, ids, "aot_eager", steps=1)
            assert float((got - expected[0]).abs().max()) <= logits_tolerance(got, model, positions=512)


def test_the_embedding_is_read_in_the_c_call_as_the_model_holds_it():
    """The tokens' embedding rows are copied in the C call: an embedding table replaced within an install is read,
    a max_norm set on it (renormalised lookups) is refused at the next step, and a token id outside the table is
    an IndexError, as torch's lookup raises, with nothing decoded."""
    cfg = SparseConfig(**SMALL_CFG)
    model, reference = tiny_model("llama"), tiny_model("llama")
    ids = _prompt(1, 300)
    native = CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    vocab = model.model.embed_tokens.num_embeddings
    with native.installed():
        native.step(native.prefill(ids).argmax(-1))
        table = torch.randn(vocab, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
        for m in (model, reference):
            m.model.embed_tokens.weight.data = table.clone()
        got = native.step(native.prefill(ids).argmax(-1))
        _, expected, _ = _run(reference, cfg, ids, "aot_eager", steps=1)
        assert float((got - expected[0]).abs().max()) <= logits_tolerance(got, model, positions=512)
        position = native.position
        with pytest.raises(IndexError, match="outside the embedding table"):
            native.step(torch.tensor([vocab]))
        assert native.position == position
        model.model.embed_tokens.max_norm = 1.0
        with pytest.raises(SparseDecodeError, match="max_norm"):
            native.step(torch.tensor([3]))


def test_rope_comes_from_the_models_rotary_module_by_table_or_per_step():
    """A RoPE that depends on the position alone is read from a table the model's rotary module made for every
    position (equal to its per-step output; rebuilt when inv_freq is edited in place within an install); a dynamic
    one is the module's own at each step: both decode as the static step does."""
    from sparsedecode.compiled.native import STATIC_ROPE

    cfg = SparseConfig(**SMALL_CFG)
    model = tiny_model("llama")
    native = CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    ids = _prompt(1, 300)
    with native.installed():
        native.step(native.prefill(ids).argmax(-1))
        step = native._compiled
        rotary = model.model.rotary_emb
        assert rotary.rope_type in STATIC_ROPE and step.rope_table is not None
        positions = torch.arange(512).reshape(1, -1)
        for got, expected in zip(step.rope_table, rotary(torch.zeros(1), positions)):
            assert torch.equal(got, expected[0])
        reference = tiny_model("llama")
        for m in (model, reference):
            m.model.rotary_emb.inv_freq.mul_(0.5)  # in place: the same tensor, a new version
        got = native.step(native.prefill(ids).argmax(-1))
        _, expected, _ = _run(reference, cfg, ids, "aot_eager", steps=1)
        assert float((got - expected[0]).abs().max()) <= logits_tolerance(got, model, positions=512)
    dynamic = dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    reference = _run(_model("llama", "float32", max_position_embeddings=256, **dynamic), cfg, ids, "aot_eager", 8)
    model = _model("llama", "float32", max_position_embeddings=256, **dynamic)  # its rotary module keeps a state
    _assert_same(reference, _run(model, cfg, ids, NATIVE, steps=8), model, "float32")
    assert int(model.model.rotary_emb.max_seq_len_cached) == 308  # called at each step, not for a table of 512


def test_a_hook_added_between_installs_is_refused_at_the_next_install():
    model = tiny_model("llama")
    decoder = CompiledDecoder(model, SparseConfig(**SMALL_CFG), batch=1, max_len=512, backend=NATIVE)
    with decoder.installed():
        decoder.prefill(_prompt(1, 200))
    attention = model.config._attn_implementation
    handle = model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: out)
    with pytest.raises(SparseDecodeError, match="hook"):
        with decoder.installed():
            pass
    assert model.config._attn_implementation == attention  # the install undone
    handle.remove()
    with decoder.installed():
        decoder.step(torch.tensor([3]))


def test_a_weight_of_another_shape_than_its_modules_sizes_is_refused():
    """Found by probing: a vocabulary grown by assigning longer ``lm_head`` and embedding weights (torch's forward reads
    a weight's own shape, so the model decodes the new tokens) was addressed by the modules' stale ``out_features`` and
    ``num_embeddings``: the native step's logits kept the old vocabulary and a new token id was an IndexError (a
    shorter weight would have been read past its end). Refused in one line now, at construction and within an
    install."""
    cfg = SparseConfig(**SMALL_CFG)
    for part in ("lm_head", "model.embed_tokens"):
        model = tiny_model("llama")
        module = model.get_submodule(part)
        module.weight = torch.nn.Parameter(torch.cat([module.weight, module.weight[:8]]), requires_grad=False)
        with pytest.raises(SparseDecodeError, match=rf"{part}.weight is \(104, 64\), not the \(96, 64\)") as caught:
            CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
        assert "\n" not in str(caught.value)
    model = tiny_model("llama")
    native = CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    with native.installed():
        token = native.prefill(_prompt(1, 300)).argmax(-1)
        assert native.step(token).shape == (1, 96)
        model.lm_head.weight.data = torch.cat([model.lm_head.weight, model.lm_head.weight[:8]])
        with pytest.raises(SparseDecodeError, match="lm_head.weight is"):
            native.step(token)


def test_a_model_holding_other_layers_than_its_config_is_refused():
    """Found by probing: layers pruned by slicing ``model.model.layers`` with the config's ``num_hidden_layers`` left
    as it was (transformers' forward decodes ``layers[:num_hidden_layers]``) made the C call read its layer table past
    its end (a segmentation fault at the first step); the same list replaced within an install went unseen (the old
    layers decoded). Refused in one line now, at construction and at the next step."""
    cfg = SparseConfig(**SMALL_CFG)
    model = tiny_model("llama", layers=3)
    model.model.layers = model.model.layers[:2]
    with pytest.raises(SparseDecodeError, match="holds 2 decoder layers, not the config's 3") as caught:
        CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    assert "\n" not in str(caught.value)
    model = tiny_model("llama", layers=3)
    native = CompiledDecoder(model, cfg, batch=1, max_len=512, backend=NATIVE)
    with native.installed():
        token = native.prefill(_prompt(1, 300)).argmax(-1)
        native.step(token)
        model.model.layers = model.model.layers[:2]
        with pytest.raises(SparseDecodeError, match="holds 2 decoder layers"):
            native.step(token)

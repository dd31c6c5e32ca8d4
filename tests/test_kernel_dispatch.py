"""Which implementation serves a sparse step (sparsedecode.kernels.dispatch), and what happens where a kernel cannot.

For every assumption the C and the Triton code make, a case that breaks it alone: under ``kernel="auto"`` the step
runs on torch and equals float64 attention over the same support; the insisted-on kernel raises one line naming
the reason. A control case that breaks nothing must be served by the kernel, so the tests fail if dispatch does.
Triton runs on the CPU through its interpreter (conftest sets TRITON_INTERPRET=1); ``auto`` takes Triton on CUDA
only, so its tests let ``auto`` consider Triton here.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_attention_close, prompt, tiny_model
from transformers import DynamicCache

from sparsedecode import SparseConfig, SparseDecodeError, kernels, sparse_decoding
from sparsedecode.kernels import cpu, dispatch
from sparsedecode.kernels.common import largest_offset
from sparsedecode.kernels.reference import attend_blocks
from sparsedecode.kernels.triton import attention as triton_attention
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors import select_blocks
from sparsedecode.selectors.statistics import BlockStatistics


def reference(q, keys, values, blocks, layout, scale):
    """Float64 softmax attention of each query head over its KV head's anchor, blocks and window, position by
    position (independent of support_positions); a block index outside the distant region adds nothing."""
    kv_heads = keys.shape[0]
    group = q.shape[0] // kv_heads
    block = layout.block_size
    rows = []
    for h in range(kv_heads):
        positions = [0]
        for j in blocks[h].tolist():
            if 0 <= j < layout.n_blocks:
                positions += range(1 + j * block, min(1 + (j + 1) * block, layout.distant_end))
        positions += range(layout.distant_end, layout.n)
        index = torch.tensor(positions)
        k, v = keys[h, index].double(), values[h, index].double()
        logits = q[h * group : (h + 1) * group].double() @ k.T * scale
        rows.append(torch.softmax(logits, dim=-1) @ v)
    return torch.cat(rows)


def case(*, d=16, dv=None, block=16, n=300, dtype=torch.float32, value_dtype=None, key_stride=1, value_stride=1):
    """q (8, d), keys (2, n + 3, d), values (2, n + 3, dv) with the requested head-dim strides, and a layout."""
    generator = torch.Generator().manual_seed(d * 1000 + (dv or 0) + block + n)
    dv = dv or d
    keys = torch.randn(2, n + 3, d * key_stride, generator=generator)[..., ::key_stride].to(dtype)
    values = torch.randn(2, n + 3, dv * value_stride, generator=generator)[..., ::value_stride]
    values = values.to(value_dtype or dtype)
    q = (3 * torch.randn(8, d, generator=generator)).to(dtype)
    return q, keys, values, BlockLayout(n=n, window=64, block_size=block)


def step(kernel, q, keys, values, layout, b=3):
    """One block-selector step as sparse_decode_step runs it: mean-pooled selection, then attention."""
    cfg = SparseConfig(support=1 + 64 + layout.block_size * b, block_size=layout.block_size, kernel=kernel)
    scale = q.shape[-1] ** -0.5
    blocks = select_blocks(cfg, BlockStatistics(layout.block_size), q, keys, layout, scale=scale)
    return blocks, attend_blocks(cfg, q, keys, values, blocks, layout, scale), scale


def assert_close_to_reference(q, keys, values, layout, blocks, out, scale):
    expected = reference(q, keys, values, blocks, layout, scale)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert_attention_close(out, expected, q, keys, values, scale)  # float32 round-off of the float64 reference


def assert_refused_under_auto(kernel, q, keys, values, layout, match):
    assert kernels.attention_kernel("auto", q, keys, values, layout) == "torch"
    assert kernels.refusals(q, keys, values, layout)[kernel] is not None
    blocks, out, scale = step("auto", q, keys, values, layout)
    torch_blocks, _, _ = step("torch", q, keys, values, layout)
    assert torch.equal(blocks.sort(dim=-1).values, torch_blocks)
    assert_close_to_reference(q, keys, values, layout, blocks, out, scale)
    with pytest.raises(SparseDecodeError, match=match) as refused:
        step(kernel, q, keys, values, layout)
    assert "\n" not in str(refused.value) and f"kernel={kernel!r}" in str(refused.value)


# ---------------------------------------------------------------------------------------------------- C kernel

C_REFUSALS = {
    "float64": (dict(dtype=torch.float64), "float32, bfloat16 or float16"),
    "float64-values": (dict(value_dtype=torch.float64), "alike"),
    "keys-and-values-differ": (dict(dtype=torch.bfloat16, value_dtype=torch.float32), "alike"),
    "value-dim-smaller": (dict(dv=8), "value head dim"),
    "value-dim-larger": (dict(dv=32), "value head dim"),
    "key-rows-strided": (dict(key_stride=2), "contiguous"),
    "value-rows-strided": (dict(value_stride=3), "contiguous"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_c_kernel_serves_auto_when_every_assumption_holds(dtype):
    q, keys, values, layout = case(dtype=dtype)
    assert kernels.attention_kernel("auto", q, keys, values, layout) == "c"
    assert kernels.selection_kernel("auto", q, keys, layout) == "c"
    blocks, out, scale = step("auto", q, keys, values, layout)
    assert_close_to_reference(q, keys, values, layout, blocks, out, scale)


@pytest.mark.parametrize("name", C_REFUSALS)
def test_c_kernel_refusals(name):
    overrides, match = C_REFUSALS[name]
    q, keys, values, layout = case(**overrides)
    assert_refused_under_auto("c", q, keys, values, layout, match)


def test_c_kernel_refuses_a_cache_off_the_cpu():
    q, keys, values, layout = (t.to("meta") if isinstance(t, torch.Tensor) else t for t in case())
    assert kernels.attention_kernel("auto", q, keys, values, layout) == "torch"
    with pytest.raises(SparseDecodeError, match="CPU"):
        kernels.attention_kernel("c", q, keys, values, layout)


def test_c_kernel_entry_points_refuse_what_they_cannot_read():
    q, keys, values, layout = case(dv=8)
    blocks = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(SparseDecodeError, match="value head dim"):
        cpu.attend_support(q, keys, values, blocks, layout, 0.25)
    q, keys, values, layout = case()
    with pytest.raises(SparseDecodeError, match="one row per KV head"):
        cpu.attend_support(q, keys, values, blocks[:1], layout, 0.25)
    with pytest.raises(SparseDecodeError, match="fewer than"):
        cpu.attend_support(q, keys[:, :100], values, blocks, layout, 0.25)


def test_c_kernel_takes_a_query_that_is_not_contiguous():
    q, keys, values, layout = case()
    q = torch.randn(16, 8).T  # (8, 16), column-major
    assert not q.is_contiguous()
    blocks, out, scale = step("c", q, keys, values, layout)
    assert_close_to_reference(q, keys, values, layout, blocks, out, scale)


def test_c_kernel_reads_nothing_for_a_block_outside_the_distant_region():
    q, keys, values, layout = case(n=400)  # 21 distant blocks, the last one short
    blocks = torch.tensor([[-1, 4, layout.n_blocks - 1], [layout.n_blocks, 2**40, 7]])
    out = cpu.attend_support(q, keys, values, blocks, layout, 0.25)
    assert_close_to_reference(q, keys, values, layout, blocks, out, 0.25)


# ---------------------------------------------------------------------------------------------------- Triton

TRITON_REFUSALS = {
    "head-dim-not-a-power-of-two": (dict(d=24), "head dim"),
    "head-dim-below-16": (dict(d=8), "head dim"),
    "head-dim-above-256": (dict(d=512, n=120), "head dim"),
    "block-not-a-power-of-two": (dict(block=24), "block size"),
    "block-below-16": (dict(block=8), "block size"),
    "tile-too-large": (dict(d=64, block=128, n=600), "KiB"),
    "float64": (dict(dtype=torch.float64), "float32, float16 or bfloat16"),
    "keys-and-values-differ": (dict(dtype=torch.float16, value_dtype=torch.float32), "float32, float16 or bfloat16"),
    "value-dim-smaller": (dict(dv=8), "value head dim"),
    "value-dim-larger": (dict(dv=32), "value head dim"),
    "key-rows-strided": (dict(key_stride=2), "contiguous"),
    "value-rows-strided": (dict(value_stride=2), "contiguous"),
}


@pytest.fixture
def auto_considers_triton(monkeypatch):
    """``auto`` as on a CUDA device: Triton first (here through the interpreter), torch where it cannot serve."""
    pytest.importorskip("triton")
    monkeypatch.setattr(dispatch, "_auto_candidates", lambda keys: ("triton",))


@pytest.mark.triton
def test_triton_serves_auto_when_every_assumption_holds(auto_considers_triton):
    q, keys, values, layout = case()
    assert kernels.attention_kernel("auto", q, keys, values, layout) == "triton"
    assert kernels.selection_kernel("auto", q, keys, layout) == "triton"
    blocks, out, scale = step("auto", q, keys, values, layout)
    assert_close_to_reference(q, keys, values, layout, blocks, out, scale)


@pytest.mark.parametrize("name", TRITON_REFUSALS)
@pytest.mark.triton
def test_triton_refusals(name, auto_considers_triton):
    overrides, match = TRITON_REFUSALS[name]
    q, keys, values, layout = case(**overrides)
    assert_refused_under_auto("triton", q, keys, values, layout, match)


@pytest.mark.triton
def test_triton_refused_where_it_is_not_installed(auto_considers_triton, monkeypatch):
    monkeypatch.setattr(triton_attention, "triton_installed", lambda: False)
    q, keys, values, layout = case()
    assert_refused_under_auto("triton", q, keys, values, layout, "not installed")


def test_triton_refused_where_32_bit_offsets_would_overflow(monkeypatch):
    """A cache whose last element lies 2**31 elements or more from its first (meta tensors: nothing allocated)."""
    monkeypatch.setattr(triton_attention, "environment_refusal", lambda device, block_size: None)
    layout = BlockLayout(n=300, window=64, block_size=16)
    q = torch.empty(8, 128, device="meta")
    small = torch.empty(2, 400, 128, device="meta")
    huge = torch.empty_strided((2, 400, 128), (2**31, 128, 1), device="meta")
    assert largest_offset(huge) == 2**31 + 399 * 128 + 127 and largest_offset(small) < 2**31
    assert triton_attention.refusal(q, small, small, layout) is None
    assert "2**31" in triton_attention.refusal(q, huge, small, layout)
    assert "2**31" in triton_attention.refusal(q, small, huge, layout)


@pytest.mark.triton
def test_triton_reads_nothing_for_a_block_outside_the_distant_region():
    pytest.importorskip("triton")
    q, keys, values, layout = case(n=400)
    blocks = torch.tensor([[-1, 4, layout.n_blocks - 1], [layout.n_blocks, 2**40, 7]])
    out = triton_attention.support_attention(q, keys, values, blocks, layout, 0.25, splits=2)
    assert_close_to_reference(q, keys, values, layout, blocks, out, 0.25)


def test_triton_selection_stays_with_torch_past_its_block_limit(auto_considers_triton, monkeypatch):
    monkeypatch.setattr(triton_attention, "MAX_TRITON_BLOCKS", 4)
    q, keys, values, layout = case()
    assert kernels.selection_kernel("triton", q, keys, layout) == "torch"
    assert kernels.attention_kernel("triton", q, keys, values, layout) == "triton"


# ---------------------------------------------------------------------------------------------------- every kernel


@pytest.mark.parametrize("kernel", ["auto", "torch", "c"])
def test_malformed_inputs_raise_whatever_the_kernel(kernel):
    q, keys, values, layout = case()
    with pytest.raises(SparseDecodeError, match="evenly"):
        kernels.attention_kernel(kernel, q[:7], keys, values, layout)
    with pytest.raises(SparseDecodeError, match="query head dim"):
        kernels.attention_kernel(kernel, q[:, :8], keys, values, layout)
    with pytest.raises(SparseDecodeError, match="fewer than"):
        kernels.attention_kernel(kernel, q, keys, values, BlockLayout(n=1000, window=64, block_size=16))
    with pytest.raises(SparseDecodeError, match="do not match"):
        kernels.attention_kernel(kernel, q, keys, values[:1], layout)


@pytest.mark.parametrize("dv", [8, 32])
def test_torch_path_with_a_value_head_dim_other_than_the_key_head_dim(dv):
    q, keys, values, layout = case(dv=dv, n=400)
    layout_blocks = torch.tensor([[0, 5, layout.n_blocks - 1], [3, 4, 9]])  # a short last block among them
    for blocks in (layout_blocks, layout_blocks[:, :2]):
        out = attend_blocks(SparseConfig(kernel="torch"), q, keys, values, blocks, layout, 0.25)
        assert_close_to_reference(q, keys, values, layout, blocks, out, 0.25)


def tiny_mla_model(*, nope: int, rope: int, dv: int):
    """A 2-layer DeepSeek-V3-style model (no MoE layer): key head dim ``nope + rope``, value head dim ``dv``."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=dv,
        max_position_embeddings=1024,
        attn_implementation="sdpa",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return DeepseekV3ForCausalLM(config).eval().requires_grad_(False)


@pytest.mark.parametrize("shape", [(16, 8, 16), (8, 8, 32)], ids=["dk24-dv16", "dk16-dv32"])
def test_decoding_a_model_whose_values_are_narrower_or_wider_than_its_keys(shape):
    """Every sparse step of an MLA-shaped model equals float64 attention over its support; ``c`` refuses it."""
    nope, rope, dv = shape
    model = tiny_mla_model(nope=nope, rope=rope, dv=dv)
    ids = prompt(150)
    checked = []

    def check(view):
        blocks = view.blocks
        expected = reference(view.query, view.keys, view.values, blocks, view.layout, view.scaling)
        assert view.output.shape == (4, dv) and view.values.shape[-1] == dv != view.keys.shape[-1]
        n = view.layout.n
        assert_attention_close(view.output, expected, view.query, view.keys[:, :n], view.values[:, :n], view.scaling)
        checked.append(view.layer)

    with sparse_decoding(model, SparseConfig(support=97)) as session:
        session.observers.append(check)
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert tokens.shape == (1, 156) and session.sparse_steps == len(checked) == 5 * 2
    with sparse_decoding(model, SparseConfig(support=97, kernel="c")), pytest.raises(SparseDecodeError, match="value"):
        model.generate(ids, max_new_tokens=2, do_sample=False)


def test_short_dense_forward_with_a_value_head_dim_other_than_the_key_head_dim():
    from sparsedecode.session import dense_short_forward

    generator = torch.Generator().manual_seed(11)
    query = torch.randn(1, 8, 3, 16, generator=generator)  # 3 new tokens, 8 query heads
    key, value = torch.randn(1, 2, 40, 16, generator=generator), torch.randn(1, 2, 40, 24, generator=generator)
    out = dense_short_forward(query, key, value, 40, 0.25)
    assert out.shape == (1, 3, 8, 24)
    for head in range(8):
        for t in range(3):
            visible = 40 - 3 + t + 1  # causal: token t sees positions up to its own
            k, v = key[0, head // 4, :visible].double(), value[0, head // 4, :visible].double()
            expected = torch.softmax(query[0, head, t].double() @ k.T * 0.25, dim=-1) @ v
            assert_attention_close(out[0, t, head], expected, query[0, head, t], k, v, 0.25)


# ------------------------------------------------------------------------------------------------ gradients


@pytest.mark.parametrize("first_under_no_grad", [False, True], ids=["grad", "planned-under-no-grad-first"])
def test_a_sparse_step_under_autograd_keeps_its_gradient(first_under_no_grad):
    """A model whose parameters require gradients, decoded with autograd on: ``auto`` hands the step to torch (the C
    and Triton kernels compute no gradient, so their output would be cut from the graph and every attention
    projection's gradient lost without a word), also where the session planned a step of the same tensors under
    ``torch.no_grad`` before; ``kernel="c"`` refuses in one line. Found probing the public API: ``q_proj.weight.grad``
    was None after ``backward`` under ``auto`` and a number under ``torch``."""
    ids = prompt(150)
    grads = {}
    for kernel in ("torch", "auto"):
        model = tiny_model("llama").requires_grad_(True)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :-1], cache=cache, use_cache=True)
        with sparse_decoding(model, SparseConfig(support=33, window=8, block_size=8, kernel=kernel)) as session:
            if first_under_no_grad:
                with torch.no_grad():
                    model(ids[:, -1:], cache=cache, use_cache=True)
                cache.crop(-1)
            logits = model(ids[:, -1:], cache=cache, use_cache=True).logits
        assert session.sparse_steps == (4 if first_under_no_grad else 2)
        logits.sum().backward()
        grads[kernel] = [layer.self_attn.q_proj.weight.grad for layer in model.model.layers]
    assert all(g is not None for g in grads["auto"])
    for auto, reference_grad in zip(grads["auto"], grads["torch"]):
        torch.testing.assert_close(auto, reference_grad)
    model = tiny_model("llama").requires_grad_(True)
    cache = DynamicCache(config=model.config)
    with sparse_decoding(model, SparseConfig(support=33, window=8, block_size=8, kernel="c")):
        model(ids[:, :-1], cache=cache, use_cache=True)
        with pytest.raises(SparseDecodeError, match="no gradient") as refused:
            model(ids[:, -1:], cache=cache, use_cache=True)
    assert "\n" not in str(refused.value)


def test_attention_weights_leave_out_the_positions_valid_masks():
    """``attend_positions(..., weights=True)`` (what H2O's step calls) ignored ``valid``: a masked position was
    attended and paid attention, unlike the same call without weights."""
    from sparsedecode.kernels.reference import attend_positions

    generator = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(*shape, generator=generator) for shape in ((4, 8), (2, 20, 8), (2, 20, 8)))
    index = torch.tensor([[0, 3, 5, 18, 19], [0, 7, 2, 18, 19]])
    valid = torch.tensor([[True, True, False, True, True], [True, False, False, True, True]])
    out, received = attend_positions(q, keys, values, index, 0.3, weights=True, valid=valid)
    assert torch.allclose(out, attend_positions(q, keys, values, index, 0.3, valid=valid), atol=1e-6)
    assert not bool(received[~valid].any()) and torch.allclose(received.sum(dim=1), torch.full((2,), 2.0))

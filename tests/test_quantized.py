"""Quantized weights (sparsedecode.models.quantized, .gguf_weights, .weights): the formats hold GGUF's blocks bit for
bit, a model's linear layers load from a GGUF's own tensors (and refuse another GGUF's), the fused product equals the
de-quantized one, and the exactness oracle holds within the quantized model: a support covering the context decodes
the quantized model's own dense tokens, compiled and not."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import tiny_model
from gguf import GGMLQuantizationType as Q

from sparsedecode import SparseConfig, sparse_decoding
from sparsedecode.decoding.generate import generate
from sparsedecode.errors import SparseDecodeError
from sparsedecode.models.gguf_weights import load_gguf_linears, quantized_layer
from sparsedecode.models.quantized import (
    FUSED_ROWS,
    Int4Linear,
    Int5Linear,
    Int8Linear,
    QuantizedLinear,
    quantize_linears,
    quantized_activations,
    weight_bytes,
)
from sparsedecode.models.weights import apply_weights, check_weights, gguf_types, weights_label

GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


def _reader(tmp_path, tensors: dict[str, tuple[np.ndarray, Q]]):
    """A GGUF file holding ``tensors`` (name: float weights and the type to quantize them to), read back."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)  # as the aliases' GGUFs say
    for name, (weights, kind) in tensors.items():
        data = weights if weights.dtype == np.uint8 else gguf.quants.quantize(weights, kind)  # bytes: as given
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _k_quant_bytes(kind, rows: int, inputs: int) -> np.ndarray:
    """Random blocks of a K-quant (gguf-py cannot quantize to them): any bytes are valid values, the float16 scales
    set to small finite ones."""
    rng = np.random.default_rng(int(kind))
    size, scales = {Q.Q4_K: (144, (0, 2)), Q.Q6_K: (210, (208,))}[kind]
    data = rng.integers(0, 256, (rows, inputs // 256, size), dtype=np.uint8)
    for at in scales:
        d = rng.uniform(1e-3, 1e-2, (rows, inputs // 256)).astype(np.float16)
        data[..., at : at + 2] = d.view(np.uint8).reshape(rows, -1, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K, Q.Q6_K])
def test_a_gguf_tensor_loads_bit_for_bit_and_the_fused_product_equals_the_dequantized(tmp_path, kind):
    inputs = 512 if kind in (Q.Q4_K, Q.Q6_K) else 96
    weights = np.random.default_rng(0).standard_normal((48, inputs)).astype(np.float32)
    if kind in (Q.Q4_K, Q.Q6_K):
        weights = _k_quant_bytes(kind, 48, inputs)
    _, tensors = _reader(tmp_path, {"w": (weights, kind)})
    layer = quantized_layer(tensors["w"])
    assert isinstance(
        layer, Int4Linear if kind in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else Int5Linear if kind == Q.Q5_0 else Int8Linear
    )
    expected = torch.from_numpy(gguf.quants.dequantize(tensors["w"].data, kind).reshape(48, inputs).copy())
    assert torch.equal(layer.dequantized(), expected)  # the GGUF's own values, not an approximation
    wide = kind in (Q.Q4_K, Q.Q6_K)  # scales d * sc: float32, exact
    assert layer.scale.dtype == (torch.float32 if wide else torch.float16)
    x = torch.randn(3, inputs)
    size = float(expected.abs().amax()) * inputs**0.5  # the scale of an output: round-off is relative to it
    assert torch.allclose(layer.fused(x), x @ expected.t(), rtol=1e-5, atol=1e-5 * size)
    # the activations quantized per group of 32 first (as llama.cpp's dot products do)
    step = quantized_activations(x) @ expected.t()
    assert torch.allclose(layer(x), step, rtol=1e-5, atol=1e-5 * size)
    assert torch.allclose(layer.fused(quantized_activations(x)), step, rtol=1e-5, atol=1e-5 * size)
    assert not torch.allclose(step, x @ expected.t(), rtol=1e-5, atol=1e-3 * size)  # which is not the float product
    rows = torch.randn(FUSED_ROWS + 1, inputs)  # a prefill's rows: the same function of the activations
    assert torch.allclose(layer(rows), quantized_activations(rows) @ expected.t(), rtol=1e-5, atol=1e-5 * size)
    assert torch.allclose(layer(rows)[:3], layer(rows[:3]), rtol=1e-5, atol=1e-5 * size)  # whatever the row count


def test_a_q4_0_scale_whose_offset_passes_float16_loads_exactly(tmp_path):
    """Q4_0's offset -8 d leaves float16's range for d above 8188 (as Q5_0's -16 d above 4094): held in float32, the
    GGUF's own finite values, not -inf (which the load's check refused as another model's GGUF)."""
    blocks = np.random.default_rng(0).integers(0, 256, (4, 3, 18), dtype=np.uint8)
    blocks[..., :2] = np.full((4, 3), 10000, np.float16).view(np.uint8).reshape(4, 3, 2)
    _, tensors = _reader(tmp_path, {"w": (blocks.reshape(4, -1), Q.Q4_0)})
    layer = quantized_layer(tensors["w"])
    expected = torch.from_numpy(gguf.quants.dequantize(tensors["w"].data, Q.Q4_0).reshape(4, 96).copy())
    assert expected.isfinite().all()
    assert torch.equal(layer.dequantized(), expected)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_quantizing_float_weights_bounds_the_error_and_shrinks_the_bytes(weights):
    model = tiny_model("llama")
    before = {n: m.weight.clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    float_bytes = weight_bytes(model)
    counts = quantize_linears(model, weights)
    assert counts == {weights: len(before), "float": 0}
    for name, weight in before.items():
        layer = model.get_submodule(name)
        groups = weight.reshape(weight.shape[0], -1, 32)
        spread = (groups.amax(-1) - groups.amin(-1)) if weights == "int4" else groups.abs().amax(-1)
        step = spread / (15 if weights == "int4" else 127)  # one level; rounding to nearest is off by half of it
        # plus the rounding of the stored float16 scale (and minimum) to 11 bits, over at most 128 levels
        low = groups.amin(-1).abs() if weights == "int4" else torch.zeros_like(step)
        slack = (low + 128 * step) * 2.0**-10
        error = (layer.dequantized() - weight).abs().reshape_as(groups)
        assert bool((error <= (step / 2 + slack).unsqueeze(-1) + 1e-7).all())
    assert weight_bytes(model) < float_bytes / (6 if weights == "int4" else 3.5)  # 20 and 34 bytes per 32 weights


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_weights_beyond_the_float16_scales_are_refused_not_decoded_as_nan(weights):
    """int4 keeps each group's minimum in float16, int8 its largest / 127: a weight of -1e5 (int4) or 1e7 (int8)
    made a stored scale or minimum infinite and every output reading the group NaN, silently; a NaN weight likewise.
    Found by checking quantization from float weights against a float64 reference at huge magnitudes."""
    model = tiny_model("llama")
    layer = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        layer.weight[3, 5] = -1e5 if weights == "int4" else 1e7
    with pytest.raises(SparseDecodeError, match=r"model.layers.0.mlp.down_proj: a weight of magnitude 1e\+0[57] "):
        quantize_linears(model, weights)
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear  # the model left as it was
    with torch.no_grad():
        layer.weight[3, 5] = float("nan")
    with pytest.raises(SparseDecodeError, match="down_proj: a NaN weight"):
        quantize_linears(model, weights)
    with torch.no_grad():
        layer.weight[3, 5] = -6e4 if weights == "int4" else 8e6  # within the float16 scales' range: taken, finite
    assert quantize_linears(model, weights) == {weights: 15, "float": 0}
    assert bool(model.model.layers[0].mlp.down_proj.dequantized().isfinite().all())


def _tiny_gguf(tmp_path, model, kinds=(Q.Q4_1, Q.Q8_0)):
    """A GGUF of ``model``'s linear layers (llama.cpp's names and query/key row order), and the model's weights set
    to what transformers' conversion of it gives (the de-quantized values, query and key rows reordered back)."""
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            gguf_name = "output.weight" if leaf == "lm_head" else f"blk.{name.split('.')[2]}.{GGUF_NAMES[leaf]}.weight"
            kind = kinds[1] if leaf in ("lm_head", "down_proj") else kinds[0]
            tensors[gguf_name] = (module.weight.numpy().copy(), kind)
    path, read = _reader(tmp_path, tensors)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            key = "output.weight" if leaf == "lm_head" else f"blk.{name.split('.')[2]}.{GGUF_NAMES[leaf]}.weight"
            values = torch.from_numpy(gguf.quants.dequantize(read[key].data, read[key].tensor_type).copy())
            values = values.reshape(module.weight.shape)
            if leaf in ("q_proj", "k_proj"):  # transformers' reverse of llama.cpp's rotary row order
                h = heads if leaf == "q_proj" else kv_heads
                values = values.reshape(h, -1, 2, values.shape[1]).transpose(1, 2).reshape(values.shape)
            module.weight.copy_(values)
    return path


def test_a_models_linear_layers_load_from_its_gguf_and_refuse_another(tmp_path):
    model = tiny_model("llama")
    path = _tiny_gguf(tmp_path, model)
    dense_before = generate(model, _prompt(), None, 12, mode="dense").tokens
    apply_weights(model, "gguf", path, "tiny.gguf")
    assert weights_label(model) == "gguf Q4_1+Q8_0"
    assert model.sparsedecode_weight_counts == {"Q4_1": 12, "Q8_0": 3, "float": 0}
    assert generate(model, _prompt(), None, 12, mode="dense").tokens == dense_before  # the same model
    other = tiny_model("llama", seed=1)
    with pytest.raises(SparseDecodeError, match="is not the GGUF this model was converted from"):
        load_gguf_linears(other, path)


def test_q5_0_layers_load_as_int5_decode_as_converted_and_export_byte_for_byte(tmp_path):
    """A GGUF of Q5_0 layers (Qwen2.5's attention and MLP): int5 layers (24 bytes per 32 weights where int8 took 34),
    the converted model's dense tokens, and written back (export_gguf) as the source's Q5_0 bytes exactly."""
    from sparsedecode.models.gguf_export import export_gguf

    model = tiny_model("llama")
    path = _tiny_gguf(tmp_path, model, kinds=(Q.Q5_0, Q.Q8_0))
    dense_before = generate(model, _prompt(), None, 12, mode="dense").tokens
    apply_weights(model, "gguf", path, "tiny.gguf")
    assert model.sparsedecode_weight_counts == {"Q5_0": 12, "Q8_0": 3, "float": 0}
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Int5Linear) and layer.stored_bytes() == layer.in_features * layer.out_features * 24 // 32
    assert generate(model, _prompt(), None, 12, mode="dense").tokens == dense_before
    target = tmp_path / "again.gguf"
    assert export_gguf(model, path, target) == {"Q5_0": 12, "Q8_0": 3}
    huge = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32) * 2e5  # -16 d beyond float16
    _, tensors = _reader(tmp_path / "huge", {"w": (huge, Q.Q5_0)})
    wide = quantized_layer(tensors["w"])
    assert wide.scale.dtype == torch.float32 and bool(((16 * wide.scale).abs() > 65504).any())
    expected = gguf.quants.dequantize(tensors["w"].data, Q.Q5_0).reshape(8, 64)
    assert torch.equal(wide.dequantized(), torch.from_numpy(expected.copy()))
    written, original = gguf.GGUFReader(str(target)), gguf.GGUFReader(str(path))
    for ours, theirs in zip(written.tensors, original.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type and np.array_equal(ours.data, theirs.data), ours.name


def _prompt(length: int = 150) -> torch.Tensor:
    return torch.randint(0, 90, (1, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("weights", ["gguf", "gguf Q5_0", "int4", "int8"])
def test_full_support_decodes_the_quantized_models_own_dense_tokens(tmp_path, weights, monkeypatch):
    """The exactness oracle within the quantized model: S covering the context reproduces its dense decoding, in the
    session and in the compiled step (the fused products traced; aot_eager runs them as written). ``gguf``: Q4_1
    and Q8_0 layers; ``gguf Q5_0``: Q5_0 (int5) and Q8_0."""
    from sparsedecode.compiled import decoder as compiled

    monkeypatch.setattr(compiled, "DEFAULT_BACKEND", "aot_eager")
    model = tiny_model("llama")
    if weights.startswith("gguf"):
        kinds = (Q.Q5_0, Q.Q8_0) if weights == "gguf Q5_0" else (Q.Q4_1, Q.Q8_0)
        apply_weights(model, "gguf", _tiny_gguf(tmp_path, model, kinds), "tiny")
    else:
        apply_weights(model, weights, None, "tiny")
    ids, full = _prompt(), SparseConfig(support=193)
    dense = generate(model, ids, None, 16, mode="dense")
    compiled_dense = generate(model, ids, None, 16, mode="dense", compile=True)
    assert generate(model, ids, full, 16, mode="sparse").tokens == dense.tokens
    assert generate(model, ids, full, 16, mode="sparse", compile=True).tokens == compiled_dense.tokens == dense.tokens
    small = SparseConfig(support=97, window=32, block_size=8)
    compiled_sparse = generate(model, ids, small, 16, mode="sparse", compile=True)
    assert compiled_sparse.tokens == generate(model, ids, small, 16, mode="sparse").tokens


@pytest.mark.slow
def test_inductor_fuses_the_quantized_step_and_keeps_the_tokens():
    """inductor (the default backend, not frozen for a quantized model): the eager session's tokens."""
    from sparsedecode.compiled.decoder import decoder_for

    model = tiny_model("llama")
    apply_weights(model, "int4", None, "tiny")
    ids, cfg = _prompt(), SparseConfig(support=97, window=32, block_size=8)
    assert (
        generate(model, ids, cfg, 12, mode="sparse", compile=True).tokens
        == generate(model, ids, cfg, 12, mode="sparse").tokens
    )
    assert not decoder_for(model, cfg, 1, 150 + 12).frozen


def test_weights_choices_are_checked():
    assert check_weights(None, "bfloat16") == ("bfloat16", None)
    assert check_weights("bfloat16", "float32") == ("bfloat16", None)
    assert check_weights("int4", "bfloat16") == ("bfloat16", "int4")
    with pytest.raises(SparseDecodeError, match="disagree"):
        check_weights("bfloat16", "float16")
    with pytest.raises(SparseDecodeError, match="unknown weights"):
        check_weights("q4", "float32")
    with pytest.raises(SparseDecodeError, match="not a built-in alias or a local .gguf"):
        apply_weights(tiny_model("llama"), "gguf", None, "some/folder")
    for other in ("bfloat16", "q4", "int5"):  # a float dtype, a typo, a form only a GGUF's Q5_0 gives
        with pytest.raises(SparseDecodeError, match="weights must be None or one of gguf, int8, int4"):
            apply_weights(tiny_model("llama"), other, None, "tiny")


def test_gguf_weights_for_a_model_without_a_gguf_are_refused_before_it_loads(tiny_model_dir, monkeypatch):
    """``weights="gguf"`` (``--weights gguf``) for a local folder or a hub id was refused only after the model had
    loaded: a hub id was downloaded first. Found by probing bad ``--weights`` input."""
    from sparsedecode.models import catalog

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(catalog, "_load", loads)
    for spec in (str(tiny_model_dir), "some-owner/some-model"):
        with pytest.raises(SparseDecodeError, match="not a built-in alias or a local .gguf"):
            catalog.load_model(spec, weights="gguf")
    with pytest.raises(AssertionError, match="loaded"):  # a .gguf path goes on to the load, which names it if missing
        catalog.load_model("missing.gguf", weights="gguf")


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize(("rows", "outputs"), [(1, 100), (3, 64), (8, 200), (2, 2100)])
def test_the_c_kernel_gives_the_dequantized_product(weights, rows, outputs):
    """csrc/qlinear.h: whole chunks of 32 outputs and a shorter last one, one row or several: the de-quantized weight
    times the de-quantized int8 activations."""
    from sparsedecode.models.quantized import c_kernel, quantize_int4, quantize_int8

    assert c_kernel() is not None  # the C library builds here (the CPU kernel's tests need it too)
    torch.manual_seed(outputs)
    linear = torch.nn.Linear(96, outputs)
    layer = (quantize_int4 if weights == "int4" else quantize_int8)(linear)
    x = torch.randn(rows, 96)
    x[0, 32:64] = 0.0  # a group of zeros
    expected = quantized_activations(x) @ layer.dequantized().t()
    assert torch.allclose(layer.c_product(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.allclose(layer(x), expected + linear.bias, rtol=1e-5, atol=1e-5)  # forward: the C kernel, the bias


@pytest.mark.parametrize("march", ["x86-64", "x86-64-v3"])
def test_the_c_kernel_built_for_older_cpus_gives_the_same_products(tmp_path, march):
    """The library as a CPU without AVX2 (``x86-64``: the portable byte widening, integer float16 conversion) and an
    AVX2-only one (``x86-64-v3``: AVX2, FMA, F16C, no AVX-512) would build it: the same products as the build for this
    CPU, to float32 round-off. x86-64 hosts only (elsewhere those targets do not exist)."""
    import ctypes
    import os
    import platform
    import subprocess

    from sparsedecode.kernels import cpu
    from sparsedecode.kernels.cpu import qlinear
    from sparsedecode.models.quantized import quantize_int4, quantize_int5, quantize_int8

    assert platform.machine() in ("x86_64", "AMD64"), "this check is for x86-64 hosts"
    flags = [f for f in cpu.FLAGS if f != "-march=native"] + [f"-march={march}"]
    half = ["-DSPARSE_STEP_HALF=3"] if march == "x86-64" else []
    target = tmp_path / f"{march}.so"
    command = [os.environ.get("CC") or "cc", *flags, *half, str(cpu.SOURCE), "-o", str(target), "-lm"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    older = ctypes.CDLL(str(target))
    older.q4_linear.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
    older.q8_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
    torch.manual_seed(7)
    linear = torch.nn.Linear(96, 2100, bias=False)  # two spans, the second a chunk of 32 and 20 outputs
    x = torch.randn(2, 96)
    int4, int8, int5, wide32 = quantize_int4(linear), quantize_int8(linear), quantize_int5(linear), torch.float32
    wide4 = Int4Linear(int4.packed, int4.scale.float() * 1.0001, int4.offset.float(), scale_dtype=torch.float32)
    blocks16 = Int8Linear(int8.q, torch.rand(2100, 6) / 100, scale_dtype=torch.float32)  # Q6_K's form
    for layer in (int4, wide4):
        out = torch.empty(2, 2100)
        pointers = (layer.packed, layer.scale, layer.offset, x, out)
        wide = int(layer.scale.dtype == torch.float32)
        assert older.q4_linear(*(t.data_ptr() for t in pointers), 2, 2100, 3, wide, 1) == 0
        expected = qlinear.q4_linear(x, layer.packed, layer.scale, layer.offset)
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
    older.q5_linear.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5
    for layer in (int5, Int5Linear(int5.packed, int5.high, int5.scale.float(), int5.offset.float(), None, "", wide32)):
        out = torch.empty(2, 2100)
        pointers = (layer.packed, layer.high, layer.scale, layer.offset, x, out)
        assert older.q5_linear(*(t.data_ptr() for t in pointers), 2, 2100, 3, int(layer.scale.dtype == wide32), 1) == 0
        assert torch.allclose(out, quantized_activations(x) @ layer.dequantized().t(), rtol=1e-5, atol=1e-5)
    for layer, block in ((int8, 32), (blocks16, 16)):
        out = torch.empty(2, 2100)
        wide = int(layer.scale.dtype == torch.float32)
        pointers = (layer.q, layer.scale, x, out)
        assert older.q8_linear(*(t.data_ptr() for t in pointers), 2, 2100, 3, block, wide, 1) == 0
        assert torch.allclose(out, qlinear.q8_linear(x, layer.q, layer.scale), rtol=1e-5, atol=1e-5)
        assert torch.allclose(out, quantized_activations(x) @ layer.dequantized().t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_non_finite_activation_makes_the_quantized_products_output_nan(weights):
    """As a float product's would: the C kernel and the torch form agree on NaN, not on a wrapped integer."""
    from sparsedecode.models.quantized import quantize_int4, quantize_int8

    layer = (quantize_int4 if weights == "int4" else quantize_int8)(torch.nn.Linear(64, 40, bias=False))
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 64)
        x[1, 40] = bad
        assert torch.isnan(quantized_activations(x)[1, 32:]).all() and not quantized_activations(x)[0].isnan().any()
        out = layer(x)
        assert torch.isnan(out[1]).all() and torch.isfinite(out[0]).all()


def test_the_c_kernel_quantizes_activations_exactly_as_torch_does():
    """csrc/qlinear.h's quantize_rows (eight values at a time with AVX2): an int8 identity layer (q one-hot, scale
    1) outputs each activation as the kernel quantized it, xq * d, which must be torch's numbers bit for bit: ties
    rounded to even, a group of zeros, a signed zero; NaN and infinity making their group NaN."""
    from sparsedecode.models.quantized import c_kernel

    assert c_kernel() is not None
    size = 160
    identity = Int8Linear(torch.eye(size, dtype=torch.int8).reshape(size, size // 32, 32), torch.ones(size, size // 32))
    torch.manual_seed(3)
    x = torch.randn(3, size) * torch.logspace(-3, 3, size)
    x[0, :32] = torch.arange(32) - 15.5
    x[0, 32:64] = torch.cat([torch.tensor([127.0]), torch.arange(31) * 0.5 - 7.5])  # inverse 1: ties at .5
    x[1, :32] = 0.0
    x[1, 5] = -0.0
    expected, out = quantized_activations(x), identity.c_product(x)
    assert torch.equal(out, expected)
    assert torch.equal(out[0, 33:64], torch.round(x[0, 33:64]))  # ties to even: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
    for bad in (float("nan"), float("inf")):  # a row's products all read its NaN group: the whole row is NaN
        x[2, 100] = bad
        assert torch.isnan(identity.c_product(x)[2]).all() and torch.isnan(quantized_activations(x)[2, 96:128]).all()


def test_a_group_of_activations_too_small_for_127_over_its_largest_is_taken_as_zeros():
    """``127 / max |x|`` overflows float32 for a group whose largest magnitude is below ~3.7e-37: torch's form (a
    prefill's product, a step without the C kernel) gave NaN for every output, the C kernel -128 for every value (so
    a layer was two functions of its input). Both take such a group as zeros now. Found probing tiny magnitudes."""
    from sparsedecode.models.quantized import c_kernel, quantize_int4, quantize_int8

    assert c_kernel() is not None
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 40, bias=False)
    x = torch.randn(2, 64)
    x[:, :32] *= 1e-38
    zeros = x.clone()
    zeros[:, :32] = 0.0
    assert torch.equal(quantized_activations(x), quantized_activations(zeros))
    for make in (quantize_int4, quantize_int8):
        layer = make(linear)
        assert torch.equal(layer.c_product(x), layer.c_product(zeros))
        prefill = layer(x.repeat(5, 1))  # more rows than a step: torch's product
        assert bool(prefill.isfinite().all())
        assert torch.allclose(prefill[:2], layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_an_exported_gguf_holds_the_models_own_layers_for_llama_cpp(tmp_path, weights):
    """bench e2e --baseline llama.cpp with --weights int4/int8: the GGUF written holds our layers byte for byte (its
    Q4_1 or Q8_0 tensors load back into the same packed bytes and scales, llama.cpp's query and key row order
    restored), and everything else as the source has it."""
    from sparsedecode.models.gguf_export import export_gguf

    model = tiny_model("llama")
    source = _tiny_gguf(tmp_path, model)
    apply_weights(model, weights, None, "tiny")
    target = tmp_path / "ours.gguf"
    counts = export_gguf(model, source, target)
    assert counts == {("Q4_1" if weights == "int4" else "Q8_0"): 15}
    again = tiny_model("llama")
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (Int4Linear, Int8Linear)):
                again.get_submodule(name).weight.copy_(module.dequantized())
    assert load_gguf_linears(again, target) == {("Q4_1" if weights == "int4" else "Q8_0"): 15, "float": 0}
    for name, module in model.named_modules():
        if isinstance(module, (Int4Linear, Int8Linear)):
            loaded = again.get_submodule(name)
            for buffer in ("packed", "q", "scale", "offset"):
                if hasattr(module, buffer):
                    assert torch.equal(getattr(loaded, buffer), getattr(module, buffer)), (name, buffer)
    written, original = gguf.GGUFReader(str(target)), gguf.GGUFReader(str(source))
    assert written.fields["general.architecture"].contents() == "llama"
    wanted = gguf.LlamaFileType.MOSTLY_Q4_1 if weights == "int4" else gguf.LlamaFileType.MOSTLY_Q8_0
    assert written.fields["general.file_type"].contents() == wanted  # the int8 copy said Q4_1 (found by probing)
    assert [t.name for t in written.tensors] == [t.name for t in original.tensors]
    for ours, theirs in zip(written.tensors, original.tensors, strict=True):  # rows in the source's order (q, k too)
        mine, source_values = (gguf.quants.dequantize(t.data, t.tensor_type) for t in (ours, theirs))
        assert np.linalg.norm(mine - source_values) < 0.2 * np.linalg.norm(source_values), ours.name


def test_an_exported_gguf_of_a_tied_output_keeps_the_embedding_and_writes_an_output(tmp_path):
    from sparsedecode.models.gguf_export import export_gguf

    model = tiny_model("llama")
    weight = model.lm_head.weight.detach().numpy().copy()
    source, tensors = _reader(tmp_path, {"token_embd.weight": (weight, Q.Q8_0)})  # tied: no output.weight
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.from_numpy(gguf.quants.dequantize(tensors["token_embd.weight"].data, Q.Q8_0)))
    apply_weights(model, "int4", None, "tiny")
    target = tmp_path / "ours.gguf"
    assert export_gguf(model, source, target) == {"Q4_1": 1}
    written = {t.name: t for t in gguf.GGUFReader(str(target)).tensors}
    assert np.array_equal(written["token_embd.weight"].data, tensors["token_embd.weight"].data)  # as the source's
    assert written["output.weight"].tensor_type == Q.Q4_1
    assert torch.equal(quantized_layer(written["output.weight"]).packed, model.lm_head.packed)


def test_bench_e2e_gives_llama_cpp_the_gguf_of_the_weights_our_rows_read(tmp_path, monkeypatch):
    """--weights gguf or a float dtype: the alias's own GGUF; int4/int8: a copy holding our layers, written once. The
    bytes llama.cpp reads per token leave out an embedding table that has an output projection beside it."""
    from types import SimpleNamespace

    from sparsedecode.cli import bench_e2e as cli
    from sparsedecode.experiments import baseline
    from sparsedecode.models.weights import gguf_decode_bytes

    model = tiny_model("llama")
    source = _tiny_gguf(tmp_path, model)
    monkeypatch.setattr(baseline, "gguf_of", lambda name: source)
    assert cli._baseline_gguf(SimpleNamespace(model="tiny", weights=None), model, tmp_path) == source
    apply_weights(model, "int8", None, "tiny")
    folder = tmp_path / "scratch"
    folder.mkdir()
    written = cli._baseline_gguf(SimpleNamespace(model="tiny", weights="int8"), model, folder)
    assert written.parent == folder and gguf_types(written) == "gguf Q8_0"
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(written)).tensors)
    assert gguf_decode_bytes(written) == stored  # no embedding table in the tiny file
    table = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    both, _ = _reader(tmp_path / "both", {"token_embd.weight": (table, Q.Q8_0), "output.weight": (table, Q.Q8_0)})
    assert gguf_decode_bytes(both) == 64 * 3 * 34  # the table is looked up, not read
    tied, _ = _reader(tmp_path / "tied", {"token_embd.weight": (table, Q.Q8_0)})
    assert gguf_decode_bytes(tied) == 64 * 3 * 34  # the table is the output projection


def test_the_bytes_llama_cpp_reads_a_token_leave_out_the_gguf_metadata(tmp_path):
    """A GGUF's header and metadata (a tokenizer's vocabulary: megabytes in a real model's file) are no weights a
    step reads: a model decoding a GGUF's blocks as they are stored reads the bytes llama.cpp is counted for.
    (Found checking bench e2e's MB/token: llama.cpp's rows counted SmolLM2's 1.8 MB of tokenizer beside the very
    tensors our --weights gguf rows read, 98.4 MB against 96.6.)"""
    from sparsedecode.models.weights import gguf_decode_bytes

    model = tiny_model("llama")
    source = _tiny_gguf(tmp_path, model)
    path = tmp_path / "with-vocabulary.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"token-{i:06d}" for i in range(20000)])  # about 400 KB of metadata
    for t in gguf.GGUFReader(str(source)).tensors:
        writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    apply_weights(model, "gguf", path, "tiny")
    linears = sum(
        b.numel() * b.element_size() for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers()
    )
    assert path.stat().st_size > linears + 300_000
    assert gguf_decode_bytes(path) == linears  # the tensors of the file, as our layers hold them
    assert weight_bytes(model) > linears  # ours add the float norms, which this file does not hold


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_quantized_batch_of_more_rows_than_a_step_product_takes_decodes_each_row_as_alone(weights):
    """A quantized layer is one function of its activations whatever the number of rows (every product rounds them
    to int8 first): a batch of 10 sequences, whose step has more rows than the C product takes, decodes each
    sequence's tokens as it decodes alone."""
    from test_batch import generate_logits, ragged

    model = tiny_model("llama")
    apply_weights(model, weights, None, "tiny")
    prompts, ids, mask = ragged((150, 120, 90, 140, 100, 130, 110, 95, 145, 125))
    assert ids.shape[0] > FUSED_ROWS
    cfg = SparseConfig(support=97, window=32, block_size=8)
    with sparse_decoding(model, cfg):
        tokens, _ = generate_logits(model, ids, mask, steps=12)
        for i, single in enumerate(prompts):
            alone, _ = generate_logits(model, single, steps=12)
            assert torch.equal(tokens[i], alone[0]), i

"""The quantized products as torch operators (sparsedecode.kernels.cpu.native, csrc/torch_ops.cpp) and split over
threads (csrc/qlinear.h): the C++ kernel serves the operators here and gives the Python implementation's numbers,
refuses what it cannot read in one line, the Python implementation serves where the C++ one cannot be built, and an
int4 product split over threads by ranges of groups gives the one-thread product."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from sparsedecode.models.quantized import (
    Int4Linear,
    Int5Linear,
    Int8Linear,
    c_kernel,
    quantize_int4,
    quantize_int5,
    quantize_int8,
    quantized_activations,
)

INT4 = "sparsedecode_quantized::int4_linear"


@pytest.fixture
def threads():
    """Set torch's thread count for one test, restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _layers(inputs: int, outputs: int) -> list[torch.nn.Module]:
    """An int4, an int5 and an int8 layer of each scale form (float16; float32, and for int8 blocks of 16 as
    Q6_K's)."""
    torch.manual_seed(inputs + outputs)
    linear = torch.nn.Linear(inputs, outputs, bias=False)
    int4, int5, int8 = quantize_int4(linear), quantize_int5(linear), quantize_int8(linear)
    wide4 = Int4Linear(int4.packed, int4.scale.float() * 1.0001, int4.offset.float(), scale_dtype=torch.float32)
    wide5 = Int5Linear(
        int5.packed, int5.high, int5.scale.float() * 1.0001, int5.offset.float(), None, "", torch.float32
    )
    blocks16 = Int8Linear(int8.q, torch.rand(outputs, inputs // 16) / 100, scale_dtype=torch.float32)
    return [int4, wide4, int5, wide5, int8, blocks16]


def _python_product(layer, x):
    from sparsedecode.kernels.cpu import qlinear

    if isinstance(layer, Int4Linear):
        return qlinear.q4_linear(x, layer.packed, layer.scale, layer.offset)
    if isinstance(layer, Int5Linear):
        return qlinear.q5_linear(x, layer.packed, layer.high, layer.scale, layer.offset)
    return qlinear.q8_linear(x, layer.q, layer.scale)


def test_the_cpp_operators_serve_here_with_the_python_implementations_numbers():
    from sparsedecode.kernels.cpu import native

    assert c_kernel() is not None
    assert native.load(c_kernel()), native.BUILD_ERROR  # a C++ compiler and torch's stable headers are here
    for name in (INT4, "sparsedecode_quantized::int5_linear", "sparsedecode_quantized::int8_linear"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"), name
    for layer in _layers(96, 200):
        x = torch.randn(96, 3).t()  # not contiguous: the C++ kernel copies it
        out = layer.c_product(x)
        assert not x.is_contiguous() and out.shape == (3, 200) and out.dtype == torch.float32
        assert torch.equal(out, _python_product(layer, x.contiguous())), layer


def test_the_cpp_operators_refuse_what_they_cannot_read():
    layer = quantize_int4(torch.nn.Linear(64, 32))
    assert c_kernel() is not None
    with pytest.raises(RuntimeError, match="float32 on the CPU"):
        torch.ops.sparsedecode_quantized.int4_linear(torch.ones(1, 64, dtype=torch.float64), layer.packed,
                                                     layer.scale, layer.offset)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"activations \(rows, 64\)"):
        torch.ops.sparsedecode_quantized.int4_linear(torch.ones(1, 32), layer.packed, layer.scale, layer.offset)
    with pytest.raises(RuntimeError, match="float16 or float32"):
        torch.ops.sparsedecode_quantized.int4_linear(torch.ones(1, 64), layer.packed, layer.scale.double(),
                                                     layer.offset)  # fmt: skip


def test_without_a_cpp_compiler_the_python_implementation_serves(tmp_path):
    """A fresh process whose C++ compiler does not exist: the C library still builds, the operators run in Python."""
    script = (
        "import torch\n"
        "from sparsedecode.models.quantized import c_kernel, quantize_int4\n"
        "from sparsedecode.kernels.cpu import native\n"
        "assert c_kernel() is not None\n"
        "assert 'c++-that-is-not-here' in native.BUILD_ERROR, native.BUILD_ERROR\n"
        f"assert not torch._C._dispatch_has_kernel_for_dispatch_key({INT4!r}, 'CPU')\n"
        "layer = quantize_int4(torch.nn.Linear(64, 40, bias=False))\n"
        "x = torch.randn(2, 64)\n"
        "print(float((layer(x) - x @ layer.dequantized().t()).abs().max()))\n"
    )
    env = {**os.environ, "CXX": str(tmp_path / "c++-that-is-not-here")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip()) < 0.1  # the product of int8-rounded activations, served


@pytest.mark.parametrize(("inputs", "outputs"), [(320, 2100), (320, 100), (64, 5000), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 3])
def test_an_int4_product_split_over_threads_gives_the_one_thread_product(threads, inputs, outputs, rows):
    """Weights of 128 KB and more are split by ranges of groups (10 groups in 2, 3 and 5 parts, 2 groups for 3
    threads); smaller ones stay on one thread: every count gives the one-thread sums, added in another order."""
    assert c_kernel() is not None
    layer = quantize_int4(torch.nn.Linear(inputs, outputs, bias=False))
    x = torch.randn(rows, inputs)
    threads(1)
    alone = layer.c_product(x)
    assert torch.allclose(alone, quantized_activations(x) @ layer.dequantized().t(), rtol=1e-5, atol=1e-4)
    for count in (2, 3, 5):
        threads(count)
        assert torch.allclose(layer.c_product(x), alone, rtol=1e-5, atol=1e-4), count


@pytest.mark.parametrize("outputs", [64, 2100])
def test_an_int5_product_at_its_largest_values_is_exact(outputs):
    """Every weight at 31 and every activation at +127 or -127 (the largest 16-bit pair sums the AVX2 loop adds:
    four rows of 2 * 31 * 127 fit in 16 bits, eight would not): the integer sums and their scaling (2^-10, the
    activations' scale 1) are exact, so the outputs equal float64's product of the de-quantized values. Each group
    has a scale of its own (a power of two), so that wrapped sums of two groups cannot cancel; the fifth bits differ
    per output and input (a bit taken from the wrong input or output changes a sum)."""
    assert c_kernel() is not None
    inputs = 128
    values = torch.full((outputs, inputs), 31, dtype=torch.uint8)
    values[1::3] = 15  # outputs whose fifth bits are all 0
    values[2::3] = 15
    values[2::3, ::5] = 16  # and outputs whose fifth bit is set in every fifth input alone
    scale = 2.0 ** -torch.arange(10.0, 14.0).expand(outputs, inputs // 32)
    from sparsedecode.models.quantized import int5_from_values

    layer = int5_from_values(values, scale, -16 * scale)
    signs = torch.where(torch.arange(inputs) % 3 == 0, -1.0, 1.0)  # groups 2 and 3: mixed signs
    signs[:32], signs[32:64] = 1.0, -1.0  # group 0 all +127, group 1 all -127: the largest sums of either sign
    x = 127 * signs.reshape(1, inputs)  # the activations' scale d = 1
    expected = (x.double() @ layer.dequantized().double().t()).float()
    assert torch.equal(layer.c_product(x), expected)
    assert torch.equal(layer.dequantized(), (values.float() - 16) * scale.repeat_interleave(32, 1))


@pytest.mark.parametrize("inputs", [96, 320, 2336])
@pytest.mark.parametrize("wide", [False, True])
def test_an_int8_product_of_any_group_count_gives_the_dequantized_product(inputs, wide):
    """One scale per group, taken eight at a time and 64 groups a pass (3 groups: the tail alone; 10: eight and a
    tail; 73: a whole pass, eight more and a tail), float16 or float32 scales."""
    assert c_kernel() is not None
    torch.manual_seed(inputs)
    layer = quantize_int8(torch.nn.Linear(inputs, 70, bias=False))
    if wide:
        layer = Int8Linear(layer.q, layer.scale.float() * 1.0001, scale_dtype=torch.float32)
    x = torch.randn(2, inputs)
    expected = quantized_activations(x) @ layer.dequantized().t()
    assert torch.allclose(layer.c_product(x), expected, rtol=1e-5, atol=1e-4)


def test_the_python_implementations_refuse_what_the_cpp_operators_refuse():
    """Found by probing: where the C++ operators do not build, the Python ones handed any tensors to C (bfloat16
    activations corrupted the heap, short ones read past them); an offset of another shape was taken."""
    from sparsedecode.errors import SparseDecodeError
    from sparsedecode.kernels.cpu import qlinear

    int4, int8 = quantize_int4(torch.nn.Linear(64, 32)), quantize_int8(torch.nn.Linear(64, 32))
    for x in (torch.ones(1, 64, dtype=torch.bfloat16), torch.ones(1, 32), torch.ones(64)):
        with pytest.raises(SparseDecodeError, match="int4_linear"):
            qlinear.q4_linear(x, int4.packed, int4.scale, int4.offset)
        with pytest.raises(SparseDecodeError, match="int8_linear"):
            qlinear.q8_linear(x, int8.q, int8.scale)
    with pytest.raises(SparseDecodeError, match="int4_linear"):
        qlinear.q4_linear(torch.ones(1, 64), int4.packed, int4.scale, int4.offset[:1])
    with pytest.raises(SparseDecodeError, match="int8_linear"):
        qlinear.q8_linear(torch.ones(1, 64), int8.q, int8.scale[:, :1].contiguous())
    int5 = quantize_int5(torch.nn.Linear(64, 32))
    odd_planes = (int5.high.to(torch.int8), int5.high.transpose(0, 2).contiguous().transpose(0, 2))
    for high in odd_planes:  # the fifth bits checked as the nibbles are: their dtype, contiguous
        with pytest.raises(SparseDecodeError, match="int5_linear"):
            qlinear.q5_linear(torch.ones(1, 64), int5.packed, high, int5.scale, int5.offset)
    with pytest.raises(SparseDecodeError, match="int5_linear"):
        qlinear.q5_linear(torch.ones(1, 64), int5.packed, int5.high, int5.scale, int5.offset[:1])
    assert torch.equal(qlinear.q4_linear(torch.ones(2, 64), int4.packed, int4.scale, int4.offset), int4.c_product(
        torch.ones(2, 64)))  # fmt: skip
    with pytest.raises(SparseDecodeError, match="scales"):
        Int4Linear(int4.packed, int4.scale, int4.offset[:1])
    with pytest.raises(SparseDecodeError, match="groups of 32"):
        quantize_int8(torch.nn.Linear(0, 4))

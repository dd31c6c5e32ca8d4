"""The C kernel's quantized linear layers (``csrc/qlinear.h``): a decode step's few rows, their activations quantized
to int8 per group of 32 (:func:`sparsedecode.models.quantized.quantized_activations`), times an int4, int5 or int8
weight in the layouts of :mod:`sparsedecode.models.quantized`, read as stored (no de-quantized copy), integer sums
per group scaled in float32, split over torch's thread count (int4: by ranges of groups). ``None`` from
:func:`available` where the library could not be built here.

The operators ``sparsedecode_quantized::int4_linear``, ``int5_linear`` and ``int8_linear`` are defined here; their
CPU kernel is the C++ one of :mod:`.native` where that builds (no Python between the caller and the C products), else
the Python functions below."""

from __future__ import annotations

import ctypes

import torch

from ...errors import SparseDecodeError
from . import check_status, library, native
from .functions import c_function

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_Q4_ARGS = [_ptr] * 5 + [_i64] * 5
_Q5_ARGS = [_ptr] * 6 + [_i64] * 5
_Q8_ARGS = [_ptr] * 4 + [_i64] * 6


def available():
    """The built library, or ``None`` where it cannot be built here; at the first call, the C++ operators of
    :mod:`.native` built and loaded beside it where they can be."""
    built = library()
    if built is not None:
        native.load(built)  # at once after the first call
    return built


def _check(what: str, x: torch.Tensor, weights, dtype: torch.dtype, inputs: int, scales) -> None:
    """What the C loop assumes, as the C++ operators check it (:mod:`.native`): ``x (rows, inputs)`` float32,
    contiguous CPU ``weights`` (a tuple: int5's nibbles and fifth bits) of ``dtype``, scales (and offsets) of one
    float dtype with ``scales`` elements."""
    fits = x.dim() == 2 and x.shape[1] == inputs and x.dtype == torch.float32 and x.is_cpu and inputs > 0
    for weight in weights:
        fits = fits and weight.is_cpu and weight.is_contiguous() and weight.dtype == dtype
    weight = weights[0]
    for tensor, count in scales:
        fits = fits and tensor.is_cpu and tensor.is_contiguous() and tensor.numel() == count
        fits = fits and tensor.dtype == scales[0][0].dtype and tensor.dtype in (torch.float16, torch.float32)
    if not fits:
        raise SparseDecodeError(
            f"{what}: activations (rows, {inputs}) float32 and contiguous CPU weights, scales float16 or float32 of "
            f"the weight's groups; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )


def q4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``x (rows, K)`` float32 (quantized per group of 32 here) times the int4 weight ``packed (K/32, 16, N)`` uint8,
    ``scale``, ``offset (K/32, N)`` float16 or float32: ``(rows, N)`` float32."""
    if packed.dim() != 3 or packed.shape[1] != 16:
        raise SparseDecodeError(f"int4_linear: packed (K/32, 16, N), got {tuple(packed.shape)}")
    groups, _, n = packed.shape
    _check("int4_linear", x, (packed,), torch.uint8, groups * 32, [(scale, groups * n), (offset, groups * n)])
    x = x.contiguous()
    out = x.new_empty(x.shape[0], n)
    status = c_function("q4_linear", _Q4_ARGS)(
        packed.data_ptr(), scale.data_ptr(), offset.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], n, groups,
        int(scale.dtype == torch.float32), torch.get_num_threads(),
    )  # fmt: skip
    check_status(status)
    return out


def q5_linear(
    x: torch.Tensor, packed: torch.Tensor, high: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """``x (rows, K)`` float32 (quantized per group of 32 here) times the int5 weight ``packed (K/32, 16, N)`` and
    ``high (K/32, 4, N)`` uint8, ``scale``, ``offset (K/32, N)`` float16 or float32: ``(rows, N)`` float32."""
    if packed.dim() != 3 or packed.shape[1] != 16 or high.shape != (packed.shape[0], 4, packed.shape[2]):
        raise SparseDecodeError(
            f"int5_linear: packed (K/32, 16, N) and high (K/32, 4, N), got {tuple(packed.shape)}, {tuple(high.shape)}"
        )
    groups, _, n = packed.shape
    _check("int5_linear", x, (packed, high), torch.uint8, groups * 32, [(scale, groups * n), (offset, groups * n)])
    x = x.contiguous()
    out = x.new_empty(x.shape[0], n)
    status = c_function("q5_linear", _Q5_ARGS)(
        packed.data_ptr(), high.data_ptr(), scale.data_ptr(), offset.data_ptr(), x.data_ptr(), out.data_ptr(),
        x.shape[0], n, groups, int(scale.dtype == torch.float32), torch.get_num_threads(),
    )  # fmt: skip
    check_status(status)
    return out


def q8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x (rows, K)`` float32 (quantized per group of 32 here) times the int8 weight ``q (N, K/32, 32)``,
    ``scale (N, K/block)`` float16 or float32, ``block`` 32 or 16: ``(rows, N)`` float32."""
    if q.dim() != 3 or q.shape[2] != 32 or scale.dim() != 2 or scale.shape[1] not in (q.shape[1], 2 * q.shape[1]):
        raise SparseDecodeError(
            f"int8_linear: q (N, K/32, 32) and scale (N, K/32 or K/16), got {tuple(q.shape)} and {tuple(scale.shape)}"
        )
    n, groups, _ = q.shape
    _check("int8_linear", x, (q,), torch.int8, groups * 32, [(scale, n * scale.shape[1])])
    x = x.contiguous()
    out = x.new_empty(x.shape[0], n)
    q8 = c_function("q8_linear", _Q8_ARGS)
    block, wide = groups * 32 // scale.shape[1], int(scale.dtype == torch.float32)
    status = q8(q.data_ptr(), scale.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], n, groups, block, wide,
                torch.get_num_threads())  # fmt: skip
    check_status(status)
    return out


# torch.library's schema API (as sparsedecode.compiled.op): one custom op per product, opaque to the compiler; here,
# imported once, so a module that uses them may be imported again
_OPS = torch.library.Library("sparsedecode_quantized", "DEF")
_OPS.define("int4_linear(Tensor x, Tensor packed, Tensor scale, Tensor offset) -> Tensor")
_OPS.define("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor")
_OPS.define("int5_linear(Tensor x, Tensor packed, Tensor high, Tensor scale, Tensor offset) -> Tensor")
_OPS.impl("int4_linear", q4_linear, "CompositeExplicitAutograd")
_OPS.impl("int8_linear", q8_linear, "CompositeExplicitAutograd")
_OPS.impl("int5_linear", q5_linear, "CompositeExplicitAutograd")
torch.library.register_fake(
    "sparsedecode_quantized::int4_linear", lambda x, packed, s, o: x.new_empty(x.shape[0], packed.shape[2]), lib=_OPS
)
torch.library.register_fake(
    "sparsedecode_quantized::int8_linear", lambda x, q, s: x.new_empty(x.shape[0], q.shape[0]), lib=_OPS
)
torch.library.register_fake(
    "sparsedecode_quantized::int5_linear",
    lambda x, packed, high, s, o: x.new_empty(x.shape[0], packed.shape[2]),
    lib=_OPS,
)

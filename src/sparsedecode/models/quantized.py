"""Weight-only quantized linear layers for the CPU: a decode step reads 4-bit or 8-bit weights, not float ones.

Three formats, all in groups of :data:`GROUP` = 32 consecutive inputs of one output (GGUF's block), scales stored in
float16 as GGUF stores them (so an int4 or int8 layer holds exactly the bytes of its GGUF blocks: 20 per 32 weights
for int4, 34 for int8; int5 24 against Q5_0's 22), or in float32 where a GGUF K-quant's scales are products
(:data:`SCALE_DTYPES`); activations in float32 (quantized to int8 for every product, below):

- :class:`Int4Linear`: ``w = q * scale + offset`` with ``q`` in 0..15, two per byte as GGUF packs them (byte ``j`` of
  a group holds input ``j`` in its low nibble and input ``j + 16`` in its high one), the bytes stored group by group
  with the outputs innermost (``(K / 32, 16, N)``), one scale and offset per group and output. GGUF's Q4_1
  (``q * d + m``) maps exactly (``scale = d``, ``offset = m``), Q4_0 (``(q - 8) * d``) too (``offset = -8 d``), and
  Q4_K (``d sc q - dmin m`` per sub-block of 32) with float32 ``scale = d sc`` and ``offset = -dmin m``.
  From float weights (:data:`METHODS` ``int4``): each group's minimum and maximum, ``scale = (max - min) / 15``,
  ``offset = min`` (both rounded to float16), ``q`` rounded to nearest (Q4_1's own method).
- :class:`Int8Linear`: ``w = q * scale``, ``q`` in -127..127 stored ``(N, K / 32, 32)``, one scale per block of
  32 (or 16) inputs and output. GGUF's Q8_0 (``q * d``) maps exactly, and Q6_K (``d sc (q - 32)`` per sub-block
  of 16) with blocks of 16 and float32 ``scale = d sc``. From float weights:
  ``scale = max |w| / 127`` per group, ``q`` rounded to nearest (Q8_0's own method).
- :class:`Int5Linear`: Int4Linear's nibbles and a plane of fifth bits, ``w = (nibble + 16 bit) * scale + offset``;
  GGUF's Q5_0 (``(q - 16) * d``) maps exactly (``scale = d``, ``offset = -16 d``).

Every product first quantizes the activations as llama.cpp does for its dot products (:func:`quantized_activations`:
int8 per group of 32, the group's ``max |x| / 127`` as scale), so that the layer is one function whatever the number
of rows (a prefill, a decode step, a batch). A decode step's few rows (:data:`FUSED_ROWS`) then sum a group's
products in integers: in the C kernel (``csrc/qlinear.h``) where it builds, else, in a compiled step, tensor
operations that inductor fuses into one loop over the packed bytes (each weight converted to float32 in registers,
never stored), else the de-quantized weight times the de-quantized activations. More rows (a prefill) multiply the
de-quantized activations by the de-quantized weight as ``F.linear`` does. All are the same product to float32
round-off.

torch's own CPU operations were measured against the earlier float32 form of the C loop (each nibble converted to
float, float activations) in the compiled step of SmolLM2's shapes, one thread, on the AMX Intel Xeon of
docs/benchmarks.md: ``torch._weight_int4pack_mm_for_cpu`` (which maps these formats exactly, as Q4_1 does: its
de-quantization is ``(q - 8) * scale + zero``) took 1,370 us for a 1536 x 576 layer against 81 us for that loop
(float32 ``F.linear`` 190 us), and ``torch._weight_int8pack_mm`` (one scale per output, so not Q8_0's) 513 us against
92 us; on the 49,152 x 576 vocabulary projection 45.6 ms and 22.4 ms against 2.6 ms (int4) and 3.0 ms (int8; float32
7.6 ms). The integer loop of today is faster still (docs/compiled.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import env
from ..errors import SparseDecodeError

GROUP = 32
"""Inputs per group (one scale, and for int4 one offset, per group and output): GGUF's block size."""
FUSED_ROWS = 8
"""A product of at most this many rows (a decode step) runs as one loop over the packed weight (the C kernel, else
in a compiled step inductor's fused loop); more rows (a prefill) de-quantize the weight and multiply."""
C_KERNEL = env.flag("SPARSEDECODE_QUANTIZED_C", True)
"""A decode step's quantized products run in the C kernel (``csrc/qlinear.h``, one custom op per layer, compiled
or not) where it builds; ``SPARSEDECODE_QUANTIZED_C=0``: inductor's fused loop in a compiled step, the de-quantized
product in eager ones."""


def c_kernel():
    """The C library serving the quantized products (its custom ops ``sparsedecode_quantized::int4_linear`` and
    ``int8_linear`` registered), or ``None`` where it cannot be built here."""
    from ..kernels.cpu.qlinear import available

    return available()


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """``x (rows, K)`` float32 as every quantized product reads it: per group of :data:`GROUP` inputs,
    ``d = max |x| / 127`` and ``round(x * (127 / max |x|))`` (to nearest, ties to even; 0 for a group of zeros, and
    for one whose ``127 / max |x|`` overflows float32: ``max |x|`` below about 3.7e-37) times ``d``; NaN for a group
    holding a NaN or an infinity. The C kernel computes the same numbers."""
    groups = x.reshape(x.shape[0], -1, GROUP)
    top = groups.abs().amax(-1, keepdim=True)
    finite = top <= torch.finfo(torch.float32).max
    inverse = 127.0 / top  # infinite for a group of zeros or of values that small
    inverse = torch.where(finite & (inverse <= torch.finfo(torch.float32).max), inverse, torch.zeros_like(top))
    scale = torch.where(finite, top / 127.0, torch.full_like(top, float("nan")))
    return (torch.round(groups * inverse) * scale).reshape(x.shape)


SCALE_DTYPES = (torch.float16, torch.float32)
"""How a layer may store its scales: float16 (GGUF's Q4_0, Q4_1, Q8_0, Q5_0 and the methods of :data:`METHODS`), or
float32 (GGUF's Q4_K and Q6_K, whose scale is a float16 times a small integer: exact in float32, not in float16)."""


def _check_scale_dtype(dtype: torch.dtype) -> None:
    if dtype not in SCALE_DTYPES:
        raise SparseDecodeError(f"quantized scales are stored as float16 or float32, not {dtype}")


METHODS = {
    "int4": "group-32 min-max, round to nearest (q in 0..15, w = q * scale + min; Q4_1's method)",
    "int8": "group-32 absmax, round to nearest (q in -127..127, w = q * scale; Q8_0's method)",
}
"""How ``int4`` and ``int8`` weights are made from float ones."""


class QuantizedLinear(torch.nn.Module):
    """A linear layer whose weight is held in a quantized format (a subclass says which); ``bias`` float32 or None.
    ``source`` names where the weight came from (a GGUF tensor type, or the method of :data:`METHODS`)."""

    format = "quantized"

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, source: str):
        super().__init__()
        if in_features < GROUP or in_features % GROUP:
            raise SparseDecodeError(f"a quantized linear layer needs inputs in groups of {GROUP}, got {in_features}")
        self.in_features, self.out_features, self.source = in_features, out_features, source
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        flat = x.reshape(rows, self.in_features).float()
        few = rows <= FUSED_ROWS  # a decode step's rows; more: a prefill's
        if few and x.device.type == "cpu" and C_KERNEL and c_kernel() is not None:
            out = self.c_product(flat)  # quantizes the activations itself
        elif few and torch.compiler.is_compiling():
            out = self.fused(quantized_activations(flat))
        else:
            out = F.linear(quantized_activations(flat), self.dequantized())
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def fused(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def c_product(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:  # pragma: no cover - every subclass has its own
        raise NotImplementedError

    def stored_bytes(self) -> int:
        """Bytes of the weight as stored (what a decode step reads), the bias included."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format} from {self.source}"


class Int4Linear(QuantizedLinear):
    """``w[n, 32 g + j] = nibble * scale[g, n] + offset[g, n]`` (module docstring); ``packed (K/32, 16, N)`` uint8,
    ``scale`` and ``offset (K/32, N)`` stored as ``scale_dtype`` (:data:`SCALE_DTYPES`)."""

    format = "int4"

    def __init__(self, packed, scale, offset, bias=None, source: str = "int4", scale_dtype=torch.float16):
        groups, half, outputs = packed.shape
        super().__init__(groups * GROUP, outputs, bias, source)
        if half != GROUP // 2 or packed.dtype != torch.uint8 or not scale.shape == offset.shape == (groups, outputs):
            raise SparseDecodeError(f"Int4Linear: packed (K/32, 16, N) uint8 and scales (K/32, N), got {packed.shape}")
        _check_scale_dtype(scale_dtype)
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("scale", scale.to(scale_dtype).contiguous())
        self.register_buffer("offset", offset.to(scale_dtype).contiguous())

    def c_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.sparsedecode_quantized.int4_linear(x, self.packed, self.scale, self.offset)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.packed.shape[0]
        xg = x.reshape(-1, groups, GROUP, 1)
        low, high = (self.packed & 15).float(), (self.packed >> 4).float()
        dots = (low * xg[:, :, : GROUP // 2] + high * xg[:, :, GROUP // 2 :]).sum(-2)  # (rows, groups, N)
        return (dots * self.scale.float() + self.offset.float() * xg.sum(-2)).sum(-2)

    def dequantized(self) -> torch.Tensor:
        nibbles = torch.cat([self.packed & 15, self.packed >> 4], dim=1).float()  # (groups, 32, N)
        weight = nibbles * self.scale.float().unsqueeze(1) + self.offset.float().unsqueeze(1)
        return weight.reshape(self.in_features, self.out_features).t()


class Int8Linear(QuantizedLinear):
    """``w[n, 32 g + j] = q[n, g, j] * scale[n, (32 g + j) // block]`` (module docstring); ``q (N, K/32, 32)`` int8,
    ``scale (N, K/block)`` stored as ``scale_dtype`` (:data:`SCALE_DTYPES`), ``block`` 32 or 16 (from the shapes)."""

    format = "int8"

    def __init__(self, q, scale, bias=None, source: str = "int8", scale_dtype=torch.float16):
        outputs, groups, size = q.shape
        super().__init__(groups * GROUP, outputs, bias, source)
        blocks = scale.shape[1] if scale.dim() == 2 else 0
        if size != GROUP or q.dtype != torch.int8 or scale.shape[0] != outputs or blocks not in (groups, 2 * groups):
            raise SparseDecodeError(
                f"Int8Linear: q (N, K/32, 32) int8 and scales (N, K/32) or (N, K/16), got {tuple(q.shape)} and "
                f"{tuple(scale.shape)}"
            )
        _check_scale_dtype(scale_dtype)
        self.block = self.in_features // blocks
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale.to(scale_dtype).contiguous())

    def c_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.sparsedecode_quantized.int8_linear(x, self.q, self.scale)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.scale.shape[1]
        xb = x.reshape(-1, 1, blocks, self.block)
        q = self.q.reshape(self.out_features, blocks, self.block)
        return ((q.float() * xb).sum(-1) * self.scale.float()).sum(-1)

    def dequantized(self) -> torch.Tensor:
        q = self.q.reshape(self.out_features, -1, self.block).float()
        return (q * self.scale.float().unsqueeze(-1)).reshape(self.out_features, self.in_features)


class Int5Linear(QuantizedLinear):
    """:class:`Int4Linear`'s layout with a fifth bit per weight: ``w[n, 32 g + j] = (nibble + 16 bit) * scale[g, n] +
    offset[g, n]``; ``packed`` as Int4Linear's, the bits in ``high (K/32, 4, N)`` uint8 (byte ``b`` holds in bit ``i``
    the fifth bit of input ``4 b + i``, in bit ``4 + i`` that of input ``16 + 4 b + i``; ``csrc/qlinear4.h``). GGUF's
    Q5_0 (``(q - 16) * d``, 5-bit ``q``) maps exactly: ``scale = d``, ``offset = -16 d`` (24 bytes per 32 weights
    against Q5_0's 22, where int8 took 34)."""

    format = "int5"

    def __init__(self, packed, high, scale, offset, bias=None, source: str = "int5", scale_dtype=torch.float16):
        groups, half, outputs = packed.shape
        super().__init__(groups * GROUP, outputs, bias, source)
        fits = half == GROUP // 2 and packed.dtype == high.dtype == torch.uint8
        if not fits or high.shape != (groups, 4, outputs) or not scale.shape == offset.shape == (groups, outputs):
            raise SparseDecodeError(
                f"Int5Linear: packed (K/32, 16, N) and high (K/32, 4, N) uint8, scales (K/32, N); got "
                f"{tuple(packed.shape)}, {tuple(high.shape)} and {tuple(scale.shape)}"
            )
        _check_scale_dtype(scale_dtype)
        self.register_buffer("packed", packed.contiguous())
        self.register_buffer("high", high.contiguous())
        self.register_buffer("scale", scale.to(scale_dtype).contiguous())
        self.register_buffer("offset", offset.to(scale_dtype).contiguous())

    def values(self) -> torch.Tensor:
        """The 5-bit values (0..31) ``(K/32, 32, N)`` uint8."""
        groups, _, outputs = self.packed.shape
        shifts = torch.arange(8, dtype=torch.uint8, device=self.high.device).reshape(1, 1, 8, 1)
        bits = (self.high.unsqueeze(2) >> shifts) & 1  # (groups, 4, 8, N): bit i of byte b
        fifth = torch.cat([bits[:, :, :4].reshape(groups, 16, outputs), bits[:, :, 4:].reshape(groups, 16, outputs)], 1)
        return torch.cat([self.packed & 15, self.packed >> 4], dim=1) | (fifth << 4)

    def c_product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.sparsedecode_quantized.int5_linear(x, self.packed, self.high, self.scale, self.offset)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        xg = x.reshape(-1, self.packed.shape[0], GROUP, 1)
        dots = (self.values().float() * xg).sum(-2)  # (rows, groups, N)
        return (dots * self.scale.float() + self.offset.float() * xg.sum(-2)).sum(-2)

    def dequantized(self) -> torch.Tensor:
        weight = self.values().float() * self.scale.float().unsqueeze(1) + self.offset.float().unsqueeze(1)
        return weight.reshape(self.in_features, self.out_features).t()


def int5_from_values(
    values: torch.Tensor, scale, offset, bias=None, source: str = "int5", scale_dtype=torch.float16
) -> Int5Linear:
    """An :class:`Int5Linear` from ``values (N, K)`` (0..31) and per-group ``scale``, ``offset (N, K/32)``."""
    outputs, inputs = values.shape
    groups = values.to(torch.uint8).reshape(outputs, inputs // GROUP, GROUP)
    nibbles = groups & 15
    packed = nibbles[..., : GROUP // 2] | (nibbles[..., GROUP // 2 :] << 4)  # (N, groups, 16)
    fifth = (groups >> 4).reshape(outputs, inputs // GROUP, 2, 4, 4).to(torch.int32)  # (N, groups, half, byte, bit)
    weights = (1 << torch.arange(8, dtype=torch.int32)).reshape(2, 1, 4)
    high = (fifth * weights).sum((-3, -1)).to(torch.uint8)  # (N, groups, 4)
    return Int5Linear(packed.permute(1, 2, 0), high.permute(1, 2, 0), scale.t(), offset.t(), bias, source, scale_dtype)


def quantize_int5(linear: torch.nn.Linear) -> Int5Linear:
    """``linear`` as :class:`Int5Linear` by int4's method with 32 levels (min-max, round to nearest): the format's
    own test layers (GGUF's Q5_0 is what a model loads it from)."""
    values, scale, low = _min_max(linear, 31)
    return int5_from_values(values, scale, low, linear.bias, "int5 min-max, 32 levels")


def _min_max(linear: torch.nn.Linear, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear``'s weight as values ``(N, K)`` in 0..top by each group's minimum and maximum, rounded to nearest,
    with ``scale = (max - min) / top`` and the minimum ``(N, K/32)``, both rounded to float16."""
    weight = linear.weight.detach().float()
    groups = weight.reshape(weight.shape[0], -1, GROUP)
    low, high = groups.amin(-1).half().float(), groups.amax(-1)
    scale = ((high - low) / top).half().float()
    _check_half(weight, scale, low)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = ((groups - low.unsqueeze(-1)) / safe.unsqueeze(-1)).round().clamp(0, top)
    return values.reshape(weight.shape), scale, low


def _check_half(weight: torch.Tensor, *stored: torch.Tensor) -> None:
    """Refuse float weights whose groups' float16 scales or minimums (``stored``) are not finite: a weight beyond
    float16's range (a minimum past 65504, an int8 group's largest past 127 times that), NaN or infinite, which would
    make every output reading the group NaN."""
    if not all(bool(t.isfinite().all()) for t in stored):
        largest = float(weight.abs().amax())
        what = "a NaN weight" if largest != largest else f"a weight of magnitude {largest:.4g}"
        raise SparseDecodeError(
            f"{what} does not fit the float16 scales (and int4's minimums) of its group, at most 65504 in magnitude: "
            "keep this model's float weights"
        )


def int4_from_nibbles(
    nibbles: torch.Tensor, scale, offset, bias=None, source: str = "int4", scale_dtype=torch.float16
) -> Int4Linear:
    """An :class:`Int4Linear` from ``nibbles (N, K)`` (0..15) and per-group ``scale``, ``offset (N, K/32)``."""
    outputs, inputs = nibbles.shape
    groups = nibbles.to(torch.uint8).reshape(outputs, inputs // GROUP, GROUP)
    packed = groups[..., : GROUP // 2] | (groups[..., GROUP // 2 :] << 4)  # (N, groups, 16), GGUF's byte order
    return Int4Linear(packed.permute(1, 2, 0), scale.t(), offset.t(), bias, source, scale_dtype)


def quantize_int4(linear: torch.nn.Linear) -> Int4Linear:
    """``linear`` as :class:`Int4Linear` by :data:`METHODS` ``int4``."""
    nibbles, scale, low = _min_max(linear, 15)
    return int4_from_nibbles(nibbles, scale, low, linear.bias, "int4 " + METHODS["int4"])


def quantize_int8(linear: torch.nn.Linear) -> Int8Linear:
    """``linear`` as :class:`Int8Linear` by :data:`METHODS` ``int8``."""
    weight = linear.weight.detach().float()
    groups = weight.reshape(weight.shape[0], -1, GROUP)
    scale = (groups.abs().amax(-1) / 127).half().float()
    _check_half(weight, scale)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (groups / safe.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return Int8Linear(q, scale, linear.bias, "int8 " + METHODS["int8"])


def linear_modules(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The model's ``nn.Linear`` layers by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put ``module`` where ``model``'s submodule ``name`` was."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize_linears(model: torch.nn.Module, weights: str) -> dict[str, int]:
    """Every linear layer of ``model`` whose inputs come in groups of 32, quantized in place by ``weights``
    (``int4`` or ``int8``, :data:`METHODS`; ``int5`` by :func:`quantize_int5`); returns how many layers each format
    took (``float`` for those left)."""
    make = {"int4": quantize_int4, "int5": quantize_int5, "int8": quantize_int8}[weights]
    linears = linear_modules(model)
    made = {}  # every layer made before any is replaced: a refused one leaves the model as it was
    for name, linear in linears.items():
        if linear.in_features >= GROUP and linear.in_features % GROUP == 0:
            try:
                made[name] = make(linear)
            except SparseDecodeError as error:
                raise SparseDecodeError(f"weights {weights!r}: {name}: {error}") from None
    for name, layer in made.items():
        replace_module(model, name, layer)
    return {weights: len(made), "float": len(linears) - len(made)}


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` holds quantized weights."""
    return any(isinstance(m, QuantizedLinear) for m in model.modules())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter and quantized weight once (a tied embedding counted once,
    as the output projection), but an embedding table no linear layer shares (a token reads one row of it)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    shared = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    tensors = {id(p): p for p in model.parameters() if id(p) not in embeddings or id(p) in shared}
    tensors.update({id(b): b for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers()})
    return sum(t.numel() * t.element_size() for t in tensors.values())

"""A model's linear layers loaded from the quantized tensors of the GGUF it was converted from, not de-quantized: Q4_0,
Q4_1 and Q4_K as :class:`~.quantized.Int4Linear`, Q5_0 as :class:`~.quantized.Int5Linear`, Q8_0 and Q6_K as
:class:`~.quantized.Int8Linear`, each giving the GGUF's own values exactly (:mod:`.quantized`: Q4_0, Q4_1 and Q8_0
byte for byte; Q5_0 with its fifth bits in a plane of their own and -16 d as the offset; the K-quants with their
scales multiplied out in float32). Tensors of other types (F32, F16, Q5_1, the other K-quants) keep the float weights
the conversion made of them, which are the GGUF's own values.

Every layer taken is checked against the converted model's weight it replaces: its de-quantized values must equal
those (rounded to the model's dtype) element for element, so a wrong name, row order or byte layout is refused
instead of decoding another model. llama.cpp stores Llama's query and key rows in another order (for its rotary
embedding); the check finds which of the two orders the converted weight has.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from ..errors import SparseDecodeError
from .quantized import (
    GROUP,
    Int4Linear,
    Int5Linear,
    Int8Linear,
    int4_from_nibbles,
    int5_from_values,
    linear_modules,
    replace_module,
)

SUPER = 256
"""Weights per K-quant super-block."""

_BLOCKS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
           "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
           "ffn_down": "mlp.down_proj"}  # fmt: skip
_LAYER = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
MAPPED = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K", "Q8_0")
"""GGUF tensor types loaded as they are; the others stay float."""


def module_name(tensor: str, tied: bool) -> str | None:
    """The transformers module a GGUF tensor is the weight of (Llama and Qwen2 names), or ``None``: ``output`` is
    ``lm_head``, and so is ``token_embd`` where the output projection is tied to the embedding."""
    match = _LAYER.match(tensor)
    if match and match.group(2) in _BLOCKS:
        return f"model.layers.{match.group(1)}.{_BLOCKS[match.group(2)]}"
    if tensor == "output.weight" or (tied and tensor == "token_embd.weight"):
        return "lm_head"
    return None


def _blocks(tensor, size: int) -> np.ndarray:
    """A quantized GGUF tensor's bytes as ``(rows, blocks, size)``: blocks of ``size`` bytes (32 weights each, 256
    for a K-quant)."""
    data = np.asarray(tensor.data, dtype=np.uint8)
    rows = int(np.prod(tensor.shape[1:]))
    return data.reshape(rows, -1, size)


def _half(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, as float32 ``(rows, groups)``."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32))


def quantized_layer(tensor, bias: torch.Tensor | None = None):
    """A GGUF tensor of a type in :data:`MAPPED` as the quantized linear layer holding it exactly."""
    kind = tensor.tensor_type.name
    if kind in _K_QUANTS:
        return _K_QUANTS[kind](tensor, bias)
    if kind == "Q5_0":  # d, 32 high bits, 16 bytes of low nibbles (Q4_0's order): (q - 16) * d
        blocks = _blocks(tensor, 6 + GROUP // 2)
        high = (np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32) >> np.arange(GROUP, dtype=np.uint32)) & 1
        qs = blocks[..., 6:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1) | (high.astype(np.uint8) << 4)  # (N, groups, 32)
        d = _half(blocks, 0)
        wide = bool((16 * d).abs().max() > 65504)  # -16 d beyond float16: both in float32
        values = torch.from_numpy(q.reshape(q.shape[0], -1))
        return int5_from_values(values, d, -16 * d, bias, "GGUF Q5_0", torch.float32 if wide else torch.float16)
    if kind == "Q8_0":
        blocks = _blocks(tensor, 2 + GROUP)
        q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
        return Int8Linear(q, _half(blocks, 0), bias, source="GGUF Q8_0")
    if kind in ("Q4_0", "Q4_1"):
        head = 2 if kind == "Q4_0" else 4
        blocks = _blocks(tensor, head + GROUP // 2)
        d = _half(blocks, 0)
        offset = -8 * d if kind == "Q4_0" else _half(blocks, 2)
        wide = bool(offset.abs().max() > 65504)  # Q4_0's -8 d beyond float16: both in float32
        packed = torch.from_numpy(np.ascontiguousarray(blocks[..., head:]))  # (N, groups, 16)
        low, high = packed & 15, packed >> 4
        nibbles = torch.cat([low, high], dim=-1).reshape(packed.shape[0], -1)
        scale_dtype = torch.float32 if wide else torch.float16
        return int4_from_nibbles(nibbles, d, offset, bias, f"GGUF {kind}", scale_dtype)
    raise SparseDecodeError(f"GGUF tensor {tensor.name} is {kind}; loaded as it is: {', '.join(MAPPED)}")


def _q4_k(tensor, bias):
    """Q4_K: per super-block d, dmin, twelve bytes of 6-bit scales and minimums (``sc``, ``m`` for eight sub-blocks
    of 32; gguf's own unpacking), and 128 bytes, each 32 of them holding two sub-blocks (low nibbles, then high):
    ``d sc q - dmin m``."""
    from gguf.quants import Q4_K

    blocks = _blocks(tensor, 4 + 12 + SUPER // 2)
    rows, supers = blocks.shape[:2]
    flat = blocks.reshape(rows * supers, -1)
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(flat[:, 4:16]))
    d = np.ascontiguousarray(flat[:, 0:2]).view(np.float16).astype(np.float32)
    dmin = np.ascontiguousarray(flat[:, 2:4]).view(np.float16).astype(np.float32)
    qs = flat[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    nibbles = torch.from_numpy((qs & 15).reshape(rows, supers * SUPER))
    scale = torch.from_numpy((d * sc.astype(np.float32)).reshape(rows, -1))
    offset = -torch.from_numpy((dmin * m.astype(np.float32)).reshape(rows, -1))
    return int4_from_nibbles(nibbles, scale, offset, bias, "GGUF Q4_K", torch.float32)


def _q6_k(tensor, bias):
    """Q6_K: per super-block 128 bytes of low nibbles, 64 of high bit pairs, sixteen int8 scales (sub-blocks of 16)
    and d: ``d sc (q - 32)``, q in 0..63."""
    blocks = _blocks(tensor, SUPER // 2 + SUPER // 4 + SUPER // 16 + 2)
    rows, supers = blocks.shape[:2]
    flat = blocks.reshape(rows * supers, -1)
    low = (flat[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    pairs = flat[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (low.reshape(-1, 8, 32) | ((pairs & 3).reshape(-1, 8, 32) << 4)).astype(np.int8) - 32
    sc = np.ascontiguousarray(flat[:, 192:208]).view(np.int8).astype(np.float32)
    d = np.ascontiguousarray(flat[:, 208:210]).view(np.float16).astype(np.float32)
    scale = torch.from_numpy((d * sc).reshape(rows, -1))
    q = torch.from_numpy(q.reshape(rows, -1, GROUP))
    return Int8Linear(q, scale, bias, source="GGUF Q6_K", scale_dtype=torch.float32)


_K_QUANTS = {"Q4_K": _q4_k, "Q6_K": _q6_k}


def llama_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a llama.cpp query or key weight of ``heads`` heads (its reverse permute)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _reordered(layer, rows: torch.Tensor):
    """``layer`` with its output rows taken in the order ``rows``."""
    if isinstance(layer, Int4Linear):
        packed, scale, offset = layer.packed[..., rows], layer.scale[:, rows], layer.offset[:, rows]
        return Int4Linear(packed, scale, offset, layer.bias, layer.source, scale.dtype)
    if isinstance(layer, Int5Linear):
        packed, high, scale, offset = layer.packed[..., rows], layer.high[..., rows], layer.scale, layer.offset
        return Int5Linear(packed, high, scale[:, rows], offset[:, rows], layer.bias, layer.source, scale.dtype)
    return Int8Linear(layer.q[rows], layer.scale[rows], layer.bias, layer.source, layer.scale.dtype)


def _matching(layer, weight: torch.Tensor, heads: tuple[int, ...]):
    """``layer``, its rows reordered as llama.cpp's query and key rows are where that is what ``weight`` holds, if its
    de-quantized values equal ``weight`` exactly; else ``None``."""
    if torch.equal(layer.dequantized().to(weight.dtype), weight):
        return layer
    for h in dict.fromkeys(heads):
        if layer.out_features % (2 * h) == 0:
            candidate = _reordered(layer, llama_rows(layer.out_features, h))
            if torch.equal(candidate.dequantized().to(weight.dtype), weight):
                return candidate
    return None


def load_gguf_linears(model: torch.nn.Module, path: Path) -> dict[str, int]:
    """Replace ``model``'s linear layers by the GGUF's quantized tensors they were converted from (module docstring);
    returns how many layers each GGUF type gave (``float`` counts the linear layers left as they were)."""
    from gguf import GGUFReader

    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    tensors = GGUFReader(str(path)).tensors
    tied = "output.weight" not in {t.name for t in tensors}  # llama.cpp's output is then the embedding
    linears = linear_modules(model)
    counts: dict[str, int] = {}
    for tensor in tensors:
        name = module_name(tensor.name, tied)
        if name not in linears or tensor.tensor_type.name not in MAPPED:
            continue
        linear = linears.pop(name)
        layer = _matching(quantized_layer(tensor, linear.bias), linear.weight.detach(), (heads, kv_heads))
        if layer is None:
            raise SparseDecodeError(
                f"GGUF tensor {tensor.name} ({tensor.tensor_type.name}) does not hold the weights of {name} as the "
                f"converted model has them: {path} is not the GGUF this model was converted from"
            )
        replace_module(model, name, layer)
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    counts["float"] = len(linears)
    return counts

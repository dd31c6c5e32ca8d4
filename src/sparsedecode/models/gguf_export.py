"""A GGUF holding a model's own quantized linear layers (``--weights int4`` or ``int8``), so that llama.cpp decodes
the weights our rows decode (``bench e2e --baseline llama.cpp``).

The GGUF the model was converted from is copied, its metadata and every other tensor as they are, and each linear
layer's tensor is replaced by the layer's own blocks: an int4 layer with float16 scales is Q4_1 byte for byte
(``d = scale``, ``m = offset``, the same nibbles in the same byte order), an int8 layer in blocks of 32 with float16
scales is Q8_0 (``d = scale``, the same bytes). Rows are written in the order the source holds them (llama.cpp's
query and key row order where its converter used one), found by comparing the layer's values with the source
tensor's. Where the source ties the output projection to the embedding (no ``output.weight``), the layer is written
as an ``output.weight`` of its own and the embedding stays the source's, as ours does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import SparseDecodeError
from .gguf_weights import llama_rows, module_name
from .quantized import Int4Linear, Int5Linear, Int8Linear, QuantizedLinear


def export_gguf(model: torch.nn.Module, source: Path, target: Path) -> dict[str, int]:
    """Write ``target``: ``source`` with ``model``'s quantized linear layers in place of its tensors (module
    docstring); returns how many tensors each GGUF type took from the model."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

    reader = GGUFReader(str(source))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    layers = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    text = model.config.get_text_config(decoder=True)
    heads = (text.num_attention_heads, getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    writer = GGUFWriter(str(target), reader.fields["general.architecture"].contents())
    kinds = {type(m) for m in layers.values()}  # the file's type: what its layers now are (the source's otherwise)
    file_type = {Int4Linear: LlamaFileType.MOSTLY_Q4_1, Int8Linear: LlamaFileType.MOSTLY_Q8_0}.get(
        next(iter(kinds)) if len(kinds) == 1 else None
    )
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer's own
        kind = field.types[0]
        inner = field.types[-1] if kind == GGUFValueType.ARRAY else None
        value = int(file_type) if field.name == "general.file_type" and file_type is not None else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=inner)
    counts: dict[str, int] = {}

    def put(name: str, layer, like) -> None:
        data, kind = _blocks(layer, _source_values(like), heads)
        _add(writer, name, data, kind)
        counts[kind.name] = counts.get(kind.name, 0) + 1

    for tensor in reader.tensors:
        layer = layers.get(module_name(tensor.name, tied=False))  # the embedding is never replaced
        if layer is None:
            _add(writer, tensor.name, tensor.data, tensor.tensor_type)
        else:
            put(tensor.name, layer, tensor)
    if tied and "lm_head" in layers:
        put("output.weight", layers["lm_head"], next(t for t in reader.tensors if t.name == "token_embd.weight"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def _add(writer, name: str, data: np.ndarray, kind) -> None:
    from gguf import GGMLQuantizationType as Q

    if kind in (Q.F32, Q.F16):
        writer.add_tensor(name, data)
    else:  # bytes: their shape in bytes, the type given
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


def _source_values(tensor) -> torch.Tensor:
    """A GGUF tensor's values as float32 ``(rows, columns)`` (gguf's own de-quantization)."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(values).reshape(values.shape[0], -1).astype(np.float32))


def _blocks(layer: QuantizedLinear, source: torch.Tensor, heads: tuple[int, ...]):
    """``layer`` as GGUF blocks ``(rows, bytes)`` uint8 and their type, rows in ``source``'s order."""
    from gguf import GGMLQuantizationType as Q

    rows = _source_order(layer.dequantized(), source, heads)
    if isinstance(layer, Int4Linear) and layer.scale.dtype == torch.float16:
        scale, offset = _bytes(layer.scale.t()), _bytes(layer.offset.t())
        packed = layer.packed.permute(2, 0, 1).contiguous().numpy()  # (N, groups, 16)
        data, kind = np.concatenate([scale, offset, packed], axis=-1), Q.Q4_1
    elif (
        isinstance(layer, Int5Linear)
        and layer.scale.dtype == torch.float16
        and torch.equal(layer.offset, -16 * layer.scale)
    ):  # Q5_0: d, the 32 fifth bits (bit j: input j), the low nibbles in Q4_0's order
        values = layer.values().permute(2, 0, 1).to(torch.int64)  # (N, groups, 32)
        bits = ((values >> 4) << torch.arange(32)).sum(-1).numpy().astype("<u4")  # (N, groups), in 0 .. 2^32 - 1
        fifth = bits.view(np.uint8).reshape(*bits.shape, 4)
        packed = layer.packed.permute(2, 0, 1).contiguous().numpy()
        data, kind = np.concatenate([_bytes(layer.scale.t()), fifth, packed], axis=-1), Q.Q5_0
    elif isinstance(layer, Int8Linear) and layer.block == 32 and layer.scale.dtype == torch.float16:
        data, kind = np.concatenate([_bytes(layer.scale), layer.q.numpy().view(np.uint8)], axis=-1), Q.Q8_0
    else:
        raise SparseDecodeError(f"{layer.source} ({layer.format}) has no GGUF type of the same bytes to be written as")
    return np.ascontiguousarray(data[rows.numpy()].reshape(data.shape[0], -1)), kind


def _bytes(halves: torch.Tensor) -> np.ndarray:
    """float16 ``(N, groups)`` as their bytes ``(N, groups, 2)``."""
    return halves.contiguous().numpy().view(np.uint8).reshape(*halves.shape, 2)


def _source_order(values: torch.Tensor, source: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
    """The rows of ``values`` (transformers' order) in the order ``source`` holds them: as they are, or llama.cpp's
    query and key order for one of ``heads``, whichever is nearest ``source``."""
    if values.shape != source.shape:
        raise SparseDecodeError(f"a layer of {tuple(values.shape)} cannot replace a tensor of {tuple(source.shape)}")
    count = values.shape[0]
    orders = [torch.arange(count)]
    orders += [torch.argsort(llama_rows(count, h)) for h in dict.fromkeys(heads) if count % (2 * h) == 0]
    return min(orders, key=lambda rows: float((values[rows] - source).square().mean()))

"""Which weights a model decodes with (``load_model(..., weights=...)``, ``--weights``): float ones in a dtype, the
GGUF's own quantized tensors, or int4 / int8 made from the float weights (:mod:`.quantized`, :mod:`.gguf_weights`).

The choice is recorded on the model as ``model.sparsedecode_weights`` (a short label: ``float32``, ``bfloat16``,
``float16``, ``gguf Q4_1+Q8_0``, ``int4``, ``int8``), which benchmark rows and result files carry.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SparseDecodeError

if TYPE_CHECKING:  # torch is not imported by the command line's --help, which lists WEIGHTS
    import torch

FLOAT_WEIGHTS = ("float32", "bfloat16", "float16")
QUANTIZED_WEIGHTS = ("gguf", "int8", "int4")
WEIGHTS = FLOAT_WEIGHTS + QUANTIZED_WEIGHTS
"""What ``weights`` may name: a float dtype (the same as ``dtype``), or a quantized form: ``gguf`` (the linear layers
from the model's GGUF as they are stored: Q4_0, Q4_1 and Q4_K as int4, Q5_0 as int5, Q8_0 and Q6_K as int8, other
types float), ``int4`` or ``int8`` (quantized from the float weights, :data:`~.quantized.METHODS`)."""


def check_weights(weights: str | None, dtype: str | torch.dtype) -> tuple[str | torch.dtype, str | None]:
    """``(dtype, quantized form or None)`` for a ``weights`` choice: a float name sets the dtype (and must agree with
    a ``dtype`` other than the default float32); a quantized form keeps ``dtype`` for the activations and the
    layers it leaves float."""
    if weights is None:
        return dtype, None
    if weights not in WEIGHTS:
        raise SparseDecodeError(f"unknown weights {weights!r}; choose one of: {', '.join(WEIGHTS)}")
    if weights in FLOAT_WEIGHTS:
        named = str(dtype).removeprefix("torch.")
        if named not in ("float32", weights):
            raise SparseDecodeError(f"weights {weights!r} and dtype {named!r} disagree: give one of them")
        return weights, None
    return dtype, weights


def check_gguf_source(weights: str | None, gguf: Path | None, spec: str) -> None:
    """Refuse ``weights="gguf"`` for a model ``spec`` that was not converted from a GGUF (``gguf`` is ``None``):
    :func:`~.catalog.load_model` asks before it loads the model, so the refusal costs no load (a hub download)."""
    if weights == "gguf" and gguf is None:
        raise SparseDecodeError(
            f"weights 'gguf' reads the GGUF a model was converted from; {spec!r} is not a built-in alias or a "
            "local .gguf file (choose int4 or int8 to quantize its float weights)"
        )


def apply_weights(model: torch.nn.Module, weights: str | None, gguf: Path | None, spec: str) -> None:
    """Turn ``model``'s linear layers into ``weights`` (a quantized form, or ``None`` for none) and record the label
    (module docstring); ``gguf``: the GGUF file ``spec`` was converted from, if any (``weights="gguf"`` needs it)."""
    from .quantized import quantize_linears

    if weights is None:
        model.sparsedecode_weights = str(next(model.parameters()).dtype).removeprefix("torch.")
        return
    if weights not in QUANTIZED_WEIGHTS:
        raise SparseDecodeError(
            f"weights must be None or one of {', '.join(QUANTIZED_WEIGHTS)} (a float one is the model's dtype); "
            f"got {weights!r}"
        )
    check_gguf_source(weights, gguf, spec)
    if weights == "gguf":
        from .gguf_weights import MAPPED, load_gguf_linears

        counts = load_gguf_linears(model, gguf)
        kinds = [kind for kind in counts if kind != "float" and counts[kind]]
        if not kinds:
            raise SparseDecodeError(
                f"{gguf.name} holds no linear weights of a type loaded as it is ({', '.join(MAPPED)})"
            )
        label = "gguf " + "+".join(sorted(kinds))
    else:
        counts = quantize_linears(model, weights)
        if not counts[weights]:  # it would decode with float weights under the quantized name
            raise SparseDecodeError(
                f"weights {weights!r}: none of {spec}'s {counts['float']} linear layers takes them (a layer's inputs "
                "must come in groups of 32)"
            )
        label = weights
    model.sparsedecode_weights = label + (f" ({counts['float']} linear layers float)" if counts["float"] else "")
    model.sparsedecode_weight_counts = counts


def weights_label(model: torch.nn.Module) -> str:
    """The weights ``model`` decodes with, as recorded by :func:`apply_weights` (else its parameters' dtype)."""
    label = getattr(model, "sparsedecode_weights", None)
    return label if label is not None else str(next(model.parameters()).dtype).removeprefix("torch.")


def gguf_types(path: Path) -> str:
    """``gguf`` and the types of a GGUF's two-dimensional tensors, the label :func:`apply_weights` gives a model whose
    linear layers it loaded (how llama.cpp's rows name the weights they read)."""
    from gguf import GGUFReader

    kinds = {t.tensor_type.name for t in GGUFReader(str(path)).tensors if len(t.shape) == 2}
    return "gguf " + "+".join(sorted(kinds))


def gguf_decode_bytes(path: Path) -> int:
    """Bytes llama.cpp reads per token of a GGUF's weights: every tensor as stored, less the embedding table where an
    output projection of its own exists (then a token reads one row of it; tied, the table is the output projection).
    The file's header and metadata (the tokenizer's vocabulary and merges: 1.8 MB in SmolLM2's, 5.9 MB in
    Qwen2.5-Coder-0.5B's) are not weights and no step reads them."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    embedding = tensors.get("token_embd.weight")
    untied = "output.weight" in tensors and embedding is not None
    return sum(int(t.n_bytes) for t in tensors.values()) - (int(embedding.n_bytes) if untied else 0)


SAMPLED_VALUES = 4096
"""Values of each tensor :func:`weights_sha256` reads (evenly spaced; all of a smaller one)."""


def weights_sha256(model: torch.nn.Module) -> str:
    """A fingerprint of what ``model`` computes with: sha256 over its state's names, dtypes, shapes and
    :data:`SAMPLED_VALUES` evenly spaced values of each tensor (a second or two even for a large model). Results
    folders record it, so that a resumed or merged run refuses rows of other weights under the same model name (a
    checkpoint folder replaced in place); two checkpoints differing only between the sampled values would pass."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        step = max(flat.numel() // SAMPLED_VALUES, 1)
        sample = flat[::step][:SAMPLED_VALUES].cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}:".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.hexdigest()

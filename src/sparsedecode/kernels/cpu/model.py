"""The C kernel's native decode step (``csrc/model.h``): a Llama-shaped model's whole decode step in one call. Here
the names of its tables' fields, in the C enums' order (checked against the built library's sizes at first use),
and the call; :mod:`sparsedecode.compiled.native` builds the tables from a model and says which models it serves."""

from __future__ import annotations

import ctypes
import struct

from ...errors import SparseDecodeError
from . import NEEDS_STATISTICS, check_status
from .functions import c_function

LINEAR_FIELDS = ("kind", "out", "in", "weight", "scale", "offset", "bias", "block", "scale32", "high")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYER_FIELDS = (
    "norm1", "eps1", "norm2", "eps2", "key", "key_sb", "key_sh", "key_sn", "value", "value_sb", "value_sh", "value_sn",
    "sparse", "table", "window", "block", "reuse", "every", "split", "count", "step", "last", "tally", "support",
    "means",
)  # fmt: skip
"""A layer's fields, then its :data:`LINEARS` of :data:`LINEAR_FIELDS` each."""
MODEL_FIELDS = ("layers", "batch", "hidden", "heads", "kv", "d", "inter", "scale", "norm", "eps", "embed", "vocab")
"""The model's fields, then the vocabulary projection's :data:`LINEAR_FIELDS`."""
KINDS = {"float32": 0, "int4": 4, "int8": 8}
"""A linear layer's ``kind`` field by its weight format (int5: int4's, with the address of its fifth bits in
``high``, 0 for int4)."""

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_STEP_ARGS = [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr]
BAD_TOKEN = 4
"""``model_step``'s status for a token id outside the embedding table."""


def float_bits(value: float) -> int:
    """The bits of ``value`` as a float32, as an integer field."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def check_layout() -> None:
    """Refuse a built library whose tables differ from the fields named here (sources out of step)."""
    sizes = (ctypes.c_int64 * 3)()
    c_function("model_layout", [_ptr])(sizes)
    mine = (len(MODEL_FIELDS) + len(LINEAR_FIELDS), len(LAYER_FIELDS) + len(LINEARS) * len(LINEAR_FIELDS))
    if (tuple(sizes)[:2], sizes[2]) != (mine, len(LINEAR_FIELDS)):
        raise SparseDecodeError(f"the native step's tables have {tuple(sizes)} fields in the built kernel, not {mine}")


def work_floats(model_table: int) -> int:
    """Floats of the work buffer the step needs (``model_work_floats``)."""
    function = c_function("model_work_floats", [_ptr])
    function.restype = ctypes.c_int64
    return int(function(model_table))


def step(model_table: int, layer_table: int, tokens: int, work: int, cos: int, sin: int, n: int, first: int,
         resumed: int, threads: int, logits: int, stopped: int) -> int:  # fmt: skip
    """``model_step`` (addresses as integers): 0, or :data:`NEEDS_STATISTICS` (the layer written at ``stopped``);
    any other status raised (:data:`BAD_TOKEN` as torch's embedding raises it)."""
    status = c_function("model_step", _STEP_ARGS)(
        model_table, layer_table, tokens, work, cos, sin, n, first, resumed, threads, logits, stopped
    )
    if status == BAD_TOKEN:
        raise IndexError("the native decode step: a token id outside the embedding table")
    if status != NEEDS_STATISTICS:
        check_status(status)
    return status

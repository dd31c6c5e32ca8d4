"""sparsedecode: sparse decoding for Hugging Face causal LMs, measured against dense decoding.

Library layer only: nothing here imports the CLI, reports, plotting or ``datasets``.
"""

from .attention import SparseSession, sparse_decoding
from .compare import CompareResult, DenseReference, compare, dense_reference
from .config import SparseConfig
from .errors import SparseDecodeError
from .models import DEFAULT_MODEL, list_models, load_model
from .selectors import select_support

__all__ = [
    "DEFAULT_MODEL",
    "CompareResult",
    "DenseReference",
    "SparseConfig",
    "SparseDecodeError",
    "SparseSession",
    "compare",
    "dense_reference",
    "list_models",
    "load_model",
    "select_support",
    "sparse_decoding",
]

__version__ = "0.1.0"

"""Old name of :mod:`sparsedecode.kernels.triton_attention` (the Triton path), kept so existing imports keep working.

The name is bound to that very module.
"""

import sys

from .kernels import triton_attention

sys.modules[__name__] = triton_attention

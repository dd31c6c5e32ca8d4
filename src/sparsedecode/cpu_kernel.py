"""Old name of :mod:`sparsedecode.kernels.cpu` (the C kernel), kept so existing imports keep working.

The name is bound to that very module, so its state (the built library, ``BUILD_ERROR``) is shared.
"""

import sys

from .kernels import cpu

sys.modules[__name__] = cpu

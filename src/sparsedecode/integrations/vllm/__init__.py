"""Sparse decoding inside vLLM: the plug-in (:func:`register`, the ``vllm.general_plugins`` entry point) and its
attention backend (:mod:`.backend`), configured by a spec (:mod:`.spec`), reading vLLM's paged cache
(:mod:`.pages`) with the library's selection (:mod:`.step`). docs/vllm.md says how to install and serve.

Nothing here imports vLLM until vLLM calls :func:`register` in its own processes.
"""

from __future__ import annotations

import os
import sys

BACKEND = "sparsedecode.integrations.vllm.backend.SparseCPUBackend"


def register() -> None:
    """vLLM's plug-in hook, run in each of its processes: vLLM's CPU platform always picks its CPU backend (it ignores
    ``--attention-backend``), so that backend is replaced by :class:`~.backend.SparseCPUBackend`, which is vLLM's own
    unless a spec is given; ``CUSTOM`` names it too. A spec in the environment that cannot be served ends the process
    here, in one line."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ...errors import SparseDecodeError
    from .spec import ENV, config_from_spec

    if os.environ.get(ENV):
        try:
            config_from_spec(os.environ[ENV])
        except SparseDecodeError as error:
            print(f"sparsedecode: {error}", file=sys.stderr)
            raise SystemExit(2) from None
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)

"""StreamingLLM's attention sinks plus a recent window (Xiao et al., "Efficient Streaming Language Models with
Attention Sinks", arXiv 2309.17453), ported from ``mit-han-lab/streaming-llm`` at commit
``2e5042606d69933d88fbf909bd77907456b9b4dd``, file ``streaming_llm/kv_cache.py``, class ``StartRecentKVCache``
(``__call__``, lines 40-64).

After every forward, a cache of more than ``start_size + recent_size`` positions keeps its first ``start_size`` and
its last ``recent_size`` (``examples/eval_long_ppl.py`` calls it after each token). The next token attends to those
plus itself, so at a decode step with ``N`` positions (the current token included) every head, whatever the grouping,
reads everything while ``N - 1 <= start_size + recent_size``, else ``[0, start_size)`` and
``[N - 1 - recent_size, N)``. Selection reads nothing. Defaults: ``start_size = 4, recent_size = 512`` in the class,
``1`` and ``255`` in ``streaming_llm/utils.py``'s arguments, ``4`` and ``2000`` in ``examples/run_streaming_llama.py``
(the paper's four sinks). Two things the port leaves out: the chat demo's ``evict_for_space`` evicts only before
each prompt, leaving room for the prompt and ``max_gen_len`` tokens, so the window grows during a reply; and
``enable_streaming_llm`` re-applies RoPE at positions *within the cache* (``pos_shift``), which changes the keys,
not which positions are read.

Our layout: ``streaming`` is ``start_size = 1, recent_size = S - 2``; ``sink-streaming`` with ``sinks`` is
``start_size = sinks, recent_size = S - sinks - 1``, which it reproduces only while ``sinks <= S - W`` (it ranks
sinks among the ``S - 1 - W`` distant positions).
"""

from __future__ import annotations

import torch


def streaming_supports(n: int, heads: int, *, start_size: int = 4, recent_size: int = 512) -> list[torch.Tensor]:
    """The positions each of ``heads`` query heads attends to at a decode step of ``n`` positions (see the module)."""
    if n - 1 <= start_size + recent_size:
        index = torch.arange(n)
    else:
        index = torch.cat([torch.arange(start_size), torch.arange(n - 1 - recent_size, n)])
    return [index for _ in range(heads)]

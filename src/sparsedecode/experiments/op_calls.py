"""The two halves of one sparse decode-attention call that ``bench op`` times apart (:func:`.bench_operator.bench_op`):
selecting the support and attending over it, for every kind of selector, each as decoding runs it.

* token-level selectors: the positions (:func:`~sparsedecode.selectors.select_positions`), then attention over them;
* adaptive block selectors (a ``budget()``, such as ``block-top-p``): the blocks and the budget's count of them
  (:func:`~sparsedecode.selectors.choose_blocks` on torch's operations, the only ones that serve a budget), then
  attention over the kept blocks' positions, the dropped ones masked, as the session's step attends;
* block selectors with a fixed budget: the blocks, then the attention kernel ``kernel`` over them.
"""

from __future__ import annotations

from functools import partial

from ..kernels import cpu as cpu_kernel
from ..kernels.reference import attend_blocks_on
from ..kernels.triton import attention as triton_attention
from ..selectors import choose_blocks, select_blocks, select_positions
from ..selectors.select import step_layout, support_of
from ..session import attend_positions, attend_support


def op_calls(cfg, layer, layout, scale: float, kernel: str, history=None) -> tuple:
    """``(select, attend)``: callables of one layer's selection and attention at context ``layout.n`` (``layer``
    an ``OpLayer`` of synthetic query, keys, values and block statistics; ``history`` H2O's, where it reads one)."""
    q, k, v = layer.query[0, :, 0], layer.keys[0], layer.values[0]
    if cfg.token_level:
        select = partial(select_positions, cfg, q, k, layout, scale=scale, accumulated=history)
        return select, partial(attend_positions, q, k, v, select(), scale)
    if cfg.selector.adaptive:
        step = step_layout(cfg, layout, scale)
        select = partial(choose_blocks, cfg.selector, cfg.blocks, layer.centroids, q, k, step, "torch")
        index, valid = support_of(select(), step)
        return select, partial(attend_positions, q, k, v, index, scale, valid=valid)
    select = partial(select_blocks, cfg, layer.centroids, q, k, layout, scale=scale)
    blocks = select()
    if blocks.shape[0] != k.shape[0]:  # a support per query head: the kernel once per member of a KV group
        chosen = kernel if kernel in ("c", "triton") else "torch"  # bench op times "auto" as torch's operations
        return select, partial(attend_blocks_on, chosen, q, k, v, blocks, layout, scale)
    attention = {"triton": triton_attention.support_attention, "c": cpu_kernel.attend_support}.get(
        kernel, attend_support
    )
    return select, partial(attention, q, k, v, blocks, layout, scale)

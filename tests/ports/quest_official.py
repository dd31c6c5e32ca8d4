"""Quest's page selection (Tang et al., "Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference",
arXiv 2406.10774), ported from ``mit-han-lab/Quest`` at commit ``01c1623bf9395009520874e989e29f683203b357``.

The official repository holds two decode rules, both ported here:

* :func:`quest_eval_supports`: ``evaluation/quest_attention.py``, functions ``forward`` and
  ``local_heavy_hitter_mask``, the code behind every accuracy result (passkey, LongBench, PG19; scripts
  ``scripts/passkey.sh``, ``longbench.sh``, ``ppl_eval.sh``: ``--chunk_size 16``, ``--token_budget`` 512 to 4096).
  Keys and values are ``repeat_kv``-ed to the query heads first, so **every query head scores and picks its own
  pages**, also under GQA. Pages are ``[j * B, (j + 1) * B)`` from position 0; the last page may be short (its bound
  comes from its real keys, the padding holding ``finfo.min``). A page's score is
  ``sum_i |q_i| * max_{k in page} sign(q_i) k_i`` with ``sign(q_i) = +1 if q_i > 0 else -1`` (lines 146-184), i.e.
  ``sum_i max(q_i min_i, q_i max_i)``, the largest logit a key of the page could reach (unscaled: ranking only).
  It keeps ``min(max(3, T' // B), n_pages)`` pages with ``T' = min(N, token_budget)`` (lines 55-57, 206): at least
  three pages, and when ``N < token_budget`` still ``N // B`` of ``ceil(N / B)`` pages, so one page is dropped
  unless ``B`` divides ``N``. **Nothing is forced**: neither position 0 nor the last page (which holds the current
  token) is kept unless its bound ranks it. Ties: ``torch.topk`` (unspecified; here the lowest page first).
  Layers with ``layer_id < 2`` and the prefill run dense (line 84). ``layer_id`` is assigned counting down from a
  global 32 over the modules in reverse order (lines 243-266), so it equals the layer index only for 32-layer
  models (all their evaluated models); on a model of ``L`` layers layer ``i`` gets ``i + 32 - L``.
* :func:`quest_kernel_supports`: the efficiency implementation (``quest/models/QuestAttention.py`` ``forward``
  lines 124-157, ``quest/utils/controller.py`` ``InferenceController.begin_forward``/``need_estimate``,
  ``quest/utils/__init__.py`` ``decode_estimate``, ``quest/models/llama.py`` lines 427-439 and 536-538). Its page
  budget ``token_budget // B`` *includes the last page*, which is always read and never scored; the other pages are
  ranked by the same bound (per-page min/max metadata) and the best ``budget - 1`` kept; with at most ``budget``
  pages everything is read. Layers 0 and 1 get an unlimited budget (``_quest_skip_layer = 2``). It is multi-head
  only (``begin_forward`` passes ``num_heads`` as both query and KV heads), so this port requires ``G = 1``.

:func:`quest_on_our_layout` is the mapping onto this project's layout that a faithful selector must reproduce: the
same per-query-head bound over *our* blocks ``[1 + j B, 1 + (j + 1) B)`` cut at the window's start ``N - W``, the
anchor (position 0) and the window ``[N - W, N)`` always kept, the best ``b = (S - 1 - W) // B`` blocks per query
head. Differences from the official layouts, which no parameter choice removes: our blocks start at position 1
(Quest's at 0, so every page boundary is shifted by one), our anchor and window are forced (Quest forces nothing in
its evaluation code and forces only the last page in its kernels), and our budget counts positions ``S = 1 + W + bB``
(Quest's counts pages, at least three). Quest's page size ``B`` is our block size; its ``token_budget`` compares
with our ``S``.
"""

from __future__ import annotations

import torch

from .common import group_size, per_query_head, top_indices


def page_bounds(queries: torch.Tensor, keys: torch.Tensor, first: int, size: int, end: int) -> torch.Tensor:
    """Quest's bound of every page ``[first + j size, min(first + (j + 1) size, end))`` for every query head:
    ``(H, P)`` float32, ``sum_i |q_i| * max_{k in page} sign(q_i) k_i`` with ``sign(0) = -1`` as the official code."""
    group = group_size(queries, keys)
    span = end - first
    if span <= 0:
        return torch.zeros(queries.shape[0], 0)
    pages = -(-span // size)
    sign = torch.where(queries.float() > 0, 1.0, -1.0)  # (H, d)
    flipped = per_query_head(keys, group)[:, first:end].float() * sign.unsqueeze(1)  # (H, span, d)
    padded = torch.nn.functional.pad(flipped, (0, 0, 0, pages * size - span), value=float("-inf"))
    page_max = padded.view(queries.shape[0], pages, size, -1).amax(dim=2)  # (H, P, d), finite: no page is empty
    return torch.einsum("hd,hpd->hp", queries.float() * sign, page_max)


def _positions(pages: torch.Tensor, first: int, size: int, end: int) -> torch.Tensor:
    offsets = torch.arange(size)
    index = (first + pages.unsqueeze(-1) * size + offsets).flatten()
    return index[index < end]


def quest_eval_supports(
    queries: torch.Tensor, keys: torch.Tensor, *, page_size: int = 16, token_budget: int = 1024
) -> list[torch.Tensor]:
    """What ``evaluation/quest_attention.py`` ``forward`` attends to at one decode step, per query head (see the
    module). ``token_budget <= 0`` is refused: the official code then masks every position (line 215)."""
    if token_budget <= 0 or page_size < 1:
        raise ValueError(f"token_budget and page_size must be positive, got {token_budget}, {page_size}")
    n = keys.shape[1]
    scores = page_bounds(queries, keys, 0, page_size, n)
    count = min(max(3, min(n, token_budget) // page_size), scores.shape[1])
    chosen = top_indices(scores, count)
    return [_positions(row, 0, page_size, n) for row in chosen]


def quest_kernel_supports(
    queries: torch.Tensor, keys: torch.Tensor, *, page_size: int = 16, token_budget: int = 1024
) -> list[torch.Tensor]:
    """What Quest's kernels (``quest/``) read at one decode step, per head (multi-head attention only; see the
    module): the last page always, and the best ``token_budget // B - 1`` of the other pages."""
    if group_size(queries, keys) != 1:
        raise ValueError("Quest's kernels serve multi-head attention only (num_qo_heads == num_kv_heads)")
    n = keys.shape[1]
    pages = -(-n // page_size)
    if pages < 2:
        raise ValueError("Quest's kernels assert at least two pages at a decode step (controller.py line 99)")
    budget = min(token_budget // page_size, pages)
    if pages <= budget:
        return [torch.arange(n) for _ in range(queries.shape[0])]
    scores = page_bounds(queries, keys, 0, page_size, (pages - 1) * page_size)  # the last page is not scored
    chosen = top_indices(scores, budget - 1)
    last = torch.arange((pages - 1) * page_size, n)
    return [torch.cat([_positions(row, 0, page_size, n), last]) for row in chosen]


def quest_on_our_layout(
    queries: torch.Tensor, keys: torch.Tensor, *, support: int, window: int = 64, block_size: int = 16
) -> list[torch.Tensor]:
    """Quest's per-query-head bound on this project's layout (see the module): anchor, the best
    ``b = (S - 1 - W) // B`` of our blocks for each query head, and the window; every position when
    ``N <= 1 + W + b B``."""
    n = keys.shape[1]
    blocks = (support - 1 - window) // block_size
    if n <= 1 + window + blocks * block_size:
        return [torch.arange(n) for _ in range(queries.shape[0])]
    end = n - window
    chosen = top_indices(page_bounds(queries, keys, 1, block_size, end), blocks)
    anchor, recent = torch.zeros(1, dtype=torch.long), torch.arange(end, n)
    return [torch.cat([anchor, _positions(row, 1, block_size, end), recent]) for row in chosen]

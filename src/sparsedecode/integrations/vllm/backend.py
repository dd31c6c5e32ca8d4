"""The attention backend vLLM's CPU workers run when the plug-in is installed (:func:`~sparsedecode.integrations.vllm.
register`): vLLM's own CPU backend, with the decode rows that the configuration makes sparse taken out of its kernel
call and given to :func:`~.step.sparse_rows` over the same pages. Imports vLLM: only vLLM's processes import it.

Per layer call (one forward of a continuous batch, prefills, chunks and decodes mixed):

1. the pages' block statistics of every chunk the forward wrote are recomputed (:class:`~.pages.PageStatistics`);
2. the rows are split: a row decodes sparsely when it is one token of a request past its prompt whose context is
   longer than the layer's effective support; every other row (prefill chunks, short contexts, dense layers) goes to
   vLLM's own kernel in one call, with the metadata of those rows alone, so a support covering every position leaves
   vLLM's dense decoding as it was, to the bit;
3. the sparse rows select and attend over their supports, gathered through their block tables.

Without a spec (:mod:`.spec`) the backend is vLLM's, unchanged. With one, the cache is kept in the layout of vLLM's
``vec`` instruction sets (keys transposed per page), which :mod:`.pages` reads; on a CPU with AMX that also serves the
dense prefill (vLLM would have used AMX tiles for bfloat16). A start-up check writes probe keys through vLLM's own
cache writer and reads them back, so a vLLM that lays its pages out otherwise is refused, not misread.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from ...config import SparseConfig, check_layer_indices
from ...errors import SparseDecodeError
from .pages import PagedCache, check_page_size
from .spec import configured
from .step import sparse_rows, statistics_for

READABLE = ("vec", "vec16")
"""vLLM's CPU instruction sets whose page layout :mod:`.pages` reads."""


def _config(layers: int | None) -> SparseConfig | None:
    return configured(get_current_vllm_config().additional_config, layers=layers)


def check_layout(isa: str, dtype: torch.dtype) -> None:
    """Write probe keys and values through vLLM's cache writer for ``isa`` and read them back as :mod:`.pages` does;
    one line if they differ."""
    pages, kv_heads, page, d = 2, 2, 32, 32
    cache = torch.zeros(pages, kv_heads, page, 2 * d, dtype=dtype)
    halves = cache.view(pages, kv_heads, 2 * page, d).chunk(2, dim=2)
    keys = torch.arange(40 * kv_heads * d, dtype=torch.float32).view(40, kv_heads, d).remainder(251).to(dtype)
    slots = torch.arange(40) + 5
    ops.cpu_attn_reshape_and_cache(keys, -keys, halves[0], halves[1], slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")  # fmt: skip
    view = PagedCache.of(cache)
    table = torch.arange(pages, dtype=torch.int32)
    heads = torch.arange(kv_heads)
    read_k, read_v = view.gather(table, slots.expand(kv_heads, -1), heads)
    if not (torch.equal(read_k, keys.transpose(0, 1)) and torch.equal(read_v, -keys.transpose(0, 1))):
        raise SparseDecodeError(
            f"this vLLM lays out its CPU pages for instruction set {isa!r} otherwise than sparsedecode reads them: "
            "the sparse backend would misread keys (see docs/vllm.md for the vLLM versions it was checked with)"
        )


class SparseMetadataBuilder(CPUAttentionMetadataBuilder):
    """vLLM's builder, with the readable page layout where a spec is given, and the rows still prefilling noted."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        config = configured(vllm_config.additional_config)
        if config is not None:  # refused at start-up, not at the first request's forward
            check_page_size(self.block_size, config.block_size)
        max_len = vllm_config.model_config.max_model_len
        if self.isa in READABLE or not any(ever_sparse(config, name, max_len) for name in layer_names):
            return  # no layer of these ever decodes sparsely: vLLM's own layout, AMX included (dense to the bit)
        if self.isa != "amx":
            raise SparseDecodeError(
                f"vLLM chose instruction set {self.isa!r} for its CPU attention, whose pages sparsedecode cannot read"
            )
        self.isa = "vec"  # AMX packs bfloat16 keys in tiles; vec keeps them transposed per page
        self._set_isa_to_layers(layer_names)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        meta = super().build(common_prefix_len, common_attn_metadata, fast_build)
        meta.prefilling = getattr(common_attn_metadata, "is_prefilling", None)
        return meta


@dataclass
class Split:
    """One forward's rows for one effective support: the sparse ones (request indices, their query tokens) and the
    metadata of the others for vLLM's kernel (``None`` where there are none)."""

    sparse: torch.Tensor
    sparse_tokens: torch.Tensor
    dense_tokens: torch.Tensor | None
    dense: object | None


def split_rows(meta, support: int, impl, isa: str) -> Split:
    """The rows of ``meta`` that decode sparsely under an effective ``support`` (kept on ``meta``: one split per
    support and forward)."""
    splits = vars(meta).setdefault("sparse_splits", {})
    if support in splits:
        return splits[support]
    starts = meta.query_start_loc[: meta.seq_lens.shape[0] + 1].long()
    lengths = starts[1:] - starts[:-1]
    sparse = (lengths == 1) & (meta.seq_lens.long() > support)
    prefilling = getattr(meta, "prefilling", None)
    if prefilling is not None:
        sparse &= ~prefilling.to(sparse.device)
    rows = sparse.nonzero().flatten()
    dense_rows = (~sparse).nonzero().flatten()
    dense_tokens, dense = None, None
    if rows.numel() and dense_rows.numel():
        dense_tokens = torch.cat([torch.arange(int(starts[r]), int(starts[r + 1])) for r in dense_rows.tolist()])
        dense = dense_metadata(meta, dense_rows, lengths[dense_rows], dense_tokens, impl, isa)
    splits[support] = Split(rows, starts[rows], dense_tokens, dense)
    return splits[support]


def dense_metadata(meta, rows, lengths, tokens, impl, isa: str):
    """vLLM's metadata of ``rows`` alone (their tokens ``tokens``, contiguous after the split)."""
    starts = torch.zeros(rows.numel() + 1, dtype=meta.query_start_loc.dtype)
    starts[1:] = lengths.cumsum(0)
    seq_lens = meta.seq_lens[rows]
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=rows.numel(), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size,
        seq_lens=seq_lens, dtype=impl.model_dtype, query_start_loc=starts, causal=meta.causal,
        sliding_window_size=-1, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype,
    )  # fmt: skip
    return replace(meta, num_actual_tokens=tokens.numel(), max_query_len=int(lengths.max()), query_start_loc=starts,
                   max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=meta.block_table[rows],
                   slot_mapping=meta.slot_mapping[tokens], scheduler_metadata=scheduler)  # fmt: skip


def layer_sparse(config: SparseConfig | None, index: int, max_len: int) -> SparseConfig | None:
    """Layer ``index``'s configuration, ``None`` where it always decodes dense: no spec, a layer in ``dense_layers``,
    or an effective support that covers the longest sequence the engine takes (``max_len``; no row is ever longer)."""
    if config is None or index in config.dense_layers:
        return None
    cfg = config.for_layer(index)
    return None if cfg.effective_support >= max_len else cfg


def ever_sparse(config: SparseConfig | None, name: str, max_len: int) -> bool:
    """Whether vLLM layer ``name`` may decode sparsely (one whose number cannot be told may)."""
    number = _layer_number(name)
    return config is not None and (number is None or layer_sparse(config, number, max_len) is not None)


def _layer_number(name: str) -> int | None:
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return None if found is None else int(found.group(1))


def layer_index(name: str) -> int:
    """The layer number in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    number = _layer_number(name)
    if number is None:
        raise SparseDecodeError(f"cannot tell the layer number of vLLM attention layer {name!r}")
    return number


class SparseAttentionImpl(CPUAttentionBackendImpl):
    """vLLM's CPU attention with sparse decode rows (see the module)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        layers = getattr(get_current_vllm_config().model_config.hf_text_config, "num_hidden_layers", None)
        layers = layers if isinstance(layers, int) else None
        self.config = _config(layers) if self.attn_type == AttentionType.DECODER else None
        self.model_dtype = get_current_vllm_config().model_config.dtype
        self.max_len = get_current_vllm_config().model_config.max_model_len
        self.paged: dict[int, tuple] = {}
        if self.config is None:
            return
        refused = {
            "a sliding window": self.sliding_window != -1,
            "ALiBi": self.alibi_slopes is not None,
            "a logit soft cap": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            f"a {self.kv_cache_dtype} KV cache": self.kv_cache_dtype != "auto",
            "KV sharing across layers": self.kv_sharing_target_layer_name is not None,
        }
        for what, present in refused.items():
            if present:
                raise SparseDecodeError(f"the sparse vLLM backend does not serve attention with {what}")
        if layers is not None:  # layers the spec names that the model lacks: refused at start-up
            check_layer_indices(self.config, layers)
        speculative = get_current_vllm_config().speculative_config is not None
        if speculative and (layers is None or any(self.layer_config(i) for i in range(layers))):
            raise SparseDecodeError(
                "the sparse vLLM backend does not serve speculative decoding: a verification step attends several "
                "tokens of a request at once, which go to vLLM's dense kernel, so the tokens would be neither sparse "
                "nor dense decoding's; leave out the speculative config"
            )

    def layer_config(self, index: int) -> SparseConfig | None:
        """Layer ``index``'s configuration, ``None`` for a layer that always decodes dense (:func:`layer_sparse`)."""
        return layer_sparse(self.config, index, self.max_len)

    def pages(self, kv_cache: torch.Tensor, cfg: SparseConfig, isa: str):
        """The layer's cache as :mod:`.pages` reads it and its page statistics (made at the first forward over it)."""
        key = kv_cache.data_ptr()
        if key not in self.paged:
            check_layout(isa, kv_cache.dtype)
            cache = PagedCache.of(kv_cache)
            self.paged = {key: (cache, statistics_for(cfg, cache))}
        return self.paged[key]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):  # fmt: skip
        index = None if self.config is None or attn_metadata is None else layer_index(layer.layer_name)
        cfg = None if index is None else self.layer_config(index)
        if cfg is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)  # fmt: skip
        tokens = attn_metadata.num_actual_tokens
        cache, stats = self.pages(kv_cache, cfg, layer.isa)
        if stats is not None:
            stats.refresh(attn_metadata.slot_mapping[:tokens])
        split = split_rows(attn_metadata, cfg.effective_support, self, layer.isa)
        if split.sparse.numel() == 0:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        out = output[:tokens].view(tokens, self.num_heads, -1)
        if split.dense is not None:
            part = torch.empty_like(out[split.dense_tokens])
            super().forward(layer, query[split.dense_tokens].contiguous(), key, value, kv_cache, split.dense, part)
            out[split.dense_tokens] = part
        rows = split.sparse
        result = sparse_rows(cfg, cache, stats, query[split.sparse_tokens], attn_metadata.block_table[rows],
                             attn_metadata.seq_lens[rows].tolist(), layer=index, scale=self.scale)  # fmt: skip
        out[split.sparse_tokens] = result.to(out.dtype)
        return output


class SparseCPUBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend, decoding sparsely where a sparsedecode spec is given."""

    @staticmethod
    def get_impl_cls():
        return SparseAttentionImpl

    @staticmethod
    def get_builder_cls():
        return SparseMetadataBuilder

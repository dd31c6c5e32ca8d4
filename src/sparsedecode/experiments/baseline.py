"""``bench e2e --baseline llama.cpp``: llama.cpp's dense decoding of the GGUF a model alias came from, the same prompt
token ids, the same thread count, in the same run as our modes; and what each mode must read per token.

llama.cpp comes from the optional extra ``llamacpp`` (llama-cpp-python, built from its source distribution; see
docs/setup.md for the flags), in an engine process of its own (:mod:`.llama_engine`), imported only when the baseline
is asked for. Token ids are handed to it as they are: the alias's tokenizer is the GGUF's own vocabulary, so both
engines see one sequence.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import SparseDecodeError
from .llama_engine import LlamaCpp, llama_class


def check_baseline(model_name: str) -> None:
    """Before any work: ``model_name`` is an alias with a GGUF source, and llama-cpp-python is installed."""
    from ..models.aliases import ALIASES

    if model_name not in ALIASES:
        raise SparseDecodeError(
            f"--baseline llama.cpp decodes the GGUF a built-in alias came from; {model_name!r} is not one "
            f"(aliases: {', '.join(sorted(ALIASES))})"
        )
    llama_class()


def gguf_of(model_name: str) -> Path:
    """The GGUF file the alias ``model_name`` was converted from (fetched and checked like the alias itself)."""
    from ..models.aliases import ALIASES
    from ..models.store import ensure_gguf

    return ensure_gguf(ALIASES[model_name])


def attention_bytes(config, n: int, support: int | None, element: int, block_size: int = 16) -> int:
    """Bytes attention reads per token at ``n`` positions: every key and value (``support=None``: dense), or the
    support's keys and values plus the float32 block centroids selection scores (one per ``block_size`` keys)."""
    from .bench_measures import kv_cache_bytes

    if support is None or n <= support:
        return kv_cache_bytes(config, 1, n, element)
    centroids = kv_cache_bytes(config, 1, n // block_size, 4) // 2  # keys only: one float32 mean per block
    return kv_cache_bytes(config, 1, support, element) + centroids


LLAMA_CPP = "llama.cpp"
LLAMA_CPP_FLASH = "llama.cpp, flash attention"


def baseline_modes(
    engines: dict[str, LlamaCpp], prompt_ids: torch.Tensor, tokens: int, prefills: dict, progress=None, first=None
) -> dict:
    """``bench_e2e`` modes for llama.cpp engines (``{cache label: engine}``): each a function ``(stage) ->
    (decode seconds, tokens)``; every run's prefill seconds go to ``prefills[label]``; ``progress(stage, done,
    total)`` hears when each run (llama.cpp's prefill and tokens) begins and ends. The tokens are those after the
    prefill's, as our modes give them; where llama.cpp's prefill chose another token than ours (``first``), none
    (no token of its run is then the same as ours)."""
    prompt = [int(t) for t in prompt_ids.reshape(-1).tolist()]

    def run(label: str, stage: str):
        stage = f"{stage}, prefill and decode"
        if progress:
            progress(stage, 0, tokens)
        prefill_s, decode_s, out = engines[label].decode(prompt, tokens)
        if progress:
            progress(stage, tokens, tokens)
        prefills.setdefault(label, []).append(prefill_s)
        return decode_s, out[1:] if first is None or out[0] == first else []

    return {("dense", label, None, None): (lambda stage, label=label: run(label, stage)) for label in engines}


def step_attention_bytes(config, n: int, supports: list[int | None], element: int, block_size: int = 16) -> int:
    """:func:`attention_bytes` of a step whose layers attend as ``supports`` says, one entry per layer (``None``: the
    layer attends densely), as :meth:`~sparsedecode.config.SparseConfig.supports_by_layer` gives them."""
    layers = len(supports)
    return sum(attention_bytes(config, n, s, element, block_size) // layers for s in supports)


def annotate(
    rows: list,
    model: torch.nn.Module,
    engines: dict[str, LlamaCpp],
    prefills: dict,
    bandwidth_gbs: float,
    configs: dict | None = None,
):
    """Each row's ratio to llama.cpp's faster dense mode (``vs_llama_cpp``: its decode seconds over the row's), the
    bytes a token reads (weights + attention at the run's mean context) and the bound that puts on tokens/s;
    llama.cpp's rows get their own prefill time and their GGUF's weight types (``weights``). ``configs``: each
    support's :class:`~sparsedecode.config.SparseConfig`, whose dense layers and per-layer supports a sparse row's
    attention reads follow (without it, every layer reads the row's support)."""
    import statistics

    from ..models.catalog import attention_shape
    from ..models.quantized import weight_bytes
    from ..models.weights import gguf_decode_bytes, gguf_types

    reference = min((r for r in rows if r.cache in engines), key=lambda r: r.decode_s, default=None)  # its faster
    element = next(model.parameters()).element_size()
    weights = weight_bytes(model)
    for row in rows:
        n = row.context + row.tokens // 2
        if row.cache in engines:
            row.prefill_s = statistics.median(prefills[row.cache])
            row.weights = gguf_types(engines[row.cache].path)
            read = gguf_decode_bytes(engines[row.cache].path) + attention_bytes(model.config, n, None, 2)
        elif row.mode == "sparse" and (configs or {}).get(row.support) is not None:
            cfg = configs[row.support]
            layers = cfg.supports_by_layer(attention_shape(model.config)[3])
            read = weights + step_attention_bytes(model.config, n, layers, element, cfg.block_size)
        else:
            read = weights + attention_bytes(model.config, n, row.support if row.mode == "sparse" else None, element)
        row.bytes_per_token_mb = read / 1e6
        row.bound_tokens_per_s = bandwidth_gbs * 1e9 / read
        if reference is not None:
            row.vs_llama_cpp = reference.decode_s / row.decode_s

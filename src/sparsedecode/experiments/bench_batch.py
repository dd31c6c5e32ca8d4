"""``bench e2e --batch`` (issue #12): aggregate decode throughput per batch size, dense vs sparse, side by side in one
process: each prompt prefilled alone, batches decoded from stacked copies of their caches, every batch's tokens
checked against each prompt's own batch-1 run; the memory check that refuses a batch before any prefill."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import numbers
import statistics
import time
from dataclasses import dataclass

import torch

from ..config import SparseConfig
from ..decoding.loop import Progress, decode_tokens, prefill
from ..errors import SparseDecodeError
from ..memory import available_memory_bytes
from ..models.weights import weights_label
from ..session import prefill_history, sparse_decoding
from ..session.kv_cache import GrowingCache, crop_cache, crop_rewinds
from .bench_end_to_end import compiled_decode
from .bench_measures import current_peak_rss_mb, kv_cache_bytes, reset_peak_rss


def check_batches_fit(model: torch.nn.Module, batches: tuple[int, ...], context: int, tokens: int) -> int:
    """Refuse, before any prefill, batches whose KV caches would not fit in the memory available now.

    The run holds one batch-1 cache per prompt (``max(batches)`` of them) and, while a batch runs, the batch's
    stacked copy: the estimate is twice ``max(batches)`` caches of ``context + tokens`` positions (plus the
    in-place cache's growth slack). Returns the estimate in bytes.
    """
    parameter = next(model.parameters())
    element = parameter.element_size()
    largest = max(batches)
    one = kv_cache_bytes(model.config, 1, context + tokens + 1, element)
    needed = 2 * largest * one + largest * kv_cache_bytes(model.config, 1, 256, element)
    available = available_memory_bytes(str(parameter.device) if parameter.is_cuda else "cpu")
    if available is not None and needed > 0.9 * available:
        raise SparseDecodeError(
            f"bench e2e: batch {largest} at context {context} needs about {needed / 2**30:.1f} GiB of KV cache "
            f"({largest} prompts x {one / 2**20:.0f} MiB, held twice: alone and stacked), more than the "
            f"{available / 2**30:.1f} GiB available now: use smaller batches or a shorter context"
        )
    return needed


@dataclass
class BatchRow:
    """One (batch size, mode) of :func:`bench_e2e_batch`."""

    model: str
    mode: str
    context: int
    support: int | None
    batch: int
    tokens: int
    decode_s: float
    step_ms: float
    aggregate_tokens_per_s: float
    speedup_vs_dense_same_batch: float
    speedup_vs_best_dense: float
    peak_rss_mb: float
    kv_cache_mb: float
    tokens_equal_to_batch1: bool
    kernel: str | None
    runs: int
    cache: str = "growing"
    """``growing``: the session's step on an in-place cache; ``static, compiled``: the compiled step."""
    compile_s: float | None = None
    dtype: str = "float32"
    """The model's dtype in this row."""
    weights: str | None = None
    """The weights this row decodes with (:func:`~sparsedecode.models.weights.weights_label`)."""
    compile_backend: str | None = None
    """A compiled row's backend (``inductor``; ``aot_eager`` captures without generating code: no speed to report)."""


def over_best_dense(rows: list[BatchRow]) -> list[BatchRow]:
    """``rows`` with "vs best dense" over all their dense rows of the same context (one run's, or several runs'
    together: another dtype's dense rows beside them)."""
    best: dict[int, float] = {}
    for r in rows:
        if r.mode == "dense":
            best[r.context] = max(best.get(r.context, 0.0), r.aggregate_tokens_per_s)
    return [dataclasses.replace(r, speedup_vs_best_dense=r.aggregate_tokens_per_s / best[r.context]) for r in rows]


def _stack_caches(model: torch.nn.Module, caches: list[GrowingCache]) -> GrowingCache:
    """One batched in-place cache holding ``caches`` (each batch 1, equal lengths) as its rows."""
    stacked = GrowingCache(config=model.config)
    for index in range(len(caches[0].layers)):
        keys = torch.cat([c.layers[index].keys for c in caches])
        values = torch.cat([c.layers[index].values for c in caches])
        stacked.layers[index].update(keys, values)
    return stacked


def bench_e2e_batch(
    model: torch.nn.Module,
    name: str,
    prompts: list[torch.Tensor],
    batches: tuple[int, ...],
    supports: tuple[int, ...] = (193,),
    *,
    tokens: int = 64,
    kernel: str = "auto",
    repeats: int = 2,
    progress: Progress | None = None,
    selector: str = "mean-pooled",
    compile: bool = False,
) -> list[BatchRow]:
    """Aggregate decode throughput per batch size, dense vs sparse, side by side in one process.

    ``prompts`` are ``max(batches)`` prompts of one length (``(1, P)`` each). Each is prefilled alone once (dense;
    prefill is not what is measured) into an in-place cache; a batch of ``b`` decodes the first ``b`` prompts
    together from a stacked copy of their caches. Per batch size every mode (dense, then sparse per support) runs
    ``repeats`` times, in order and then reversed, and reports the median decode time of ``tokens`` greedy tokens
    for the whole batch: aggregate tokens/s is ``b * tokens / decode_s``, the step latency ``decode_s / tokens``.
    ``tokens_equal_to_batch1``: in every repeat, every sequence's tokens equal its own batch-1 run in the same mode
    (each prompt is run alone, in every mode, for that). Peak RSS is measured per batch size (the kernel's
    high-water mark is reset before it, where Linux allows). ``compile`` adds every mode with the decode step compiled
    (:mod:`sparsedecode.compiled.decoder`, ``cache`` "static, compiled"), its rows and compile seconds beside the
    others'; "vs dense same batch" and "vs best dense" then divide by the faster dense mode.
    """
    context = _check_batch_args(model, prompts, batches, repeats, tokens)
    modes: list[tuple[str, int | None]] = [("dense", None)] + [("sparse", s) for s in supports]

    def config_of(mode) -> SparseConfig | None:
        return None if mode[0] == "dense" else SparseConfig(support=mode[1], kernel=kernel, selector=selector)

    if compile:  # before any prefill
        from ..compiled.decoder import check_compilable

        for mode in modes:
            check_compilable(model, config_of(mode), "bench e2e --batch --compile")
    prompts = prompts[: max(batches)]
    caches, firsts = _prefill_each(model, prompts, progress)
    uses_history = SparseConfig(selector=selector).selector.uses_history  # h2o: each prompt's history, untimed
    histories = [prefill_history(model, ids) for ids in prompts] if uses_history else None

    def context_for(mode, cache, rows: list[int]):
        cfg = config_of(mode)
        if cfg is None:
            return contextlib.nullcontext()
        return _session(model, cfg, cache, None if histories is None else [histories[i] for i in rows])

    alone = _alone(model, modes, caches, firsts, context, tokens, context_for, progress)
    measured: dict[tuple, dict] = {}
    device = prompts[0].device
    for b in sorted(batches):
        measured.update(
            _measure_batch(
                model, b, modes, caches, firsts, alone, context, tokens, repeats, context_for, progress, device
            )
        )
    if compile:
        measured.update(_compiled_batches(model, caches, firsts, batches, modes, config_of, tokens, repeats, progress))
    return over_best_dense(_batch_rows(model, name, measured, context, tokens, kernel, repeats))


def _check_batch_args(model: torch.nn.Module, prompts: list[torch.Tensor], batches, repeats, tokens: int) -> int:
    """What :func:`bench_e2e_batch` refuses before any prefill; returns the prompts' length."""
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise SparseDecodeError(f"bench e2e: repeats must be an integer >= 1 (got {repeats!r})")
    if not batches or any(not isinstance(b, int) or b < 1 for b in batches):
        raise SparseDecodeError(f"bench e2e: batch sizes must be integers >= 1 (got {batches!r})")
    if len(prompts) < max(batches) or len({int(p.shape[1]) for p in prompts}) != 1:
        raise SparseDecodeError(f"bench e2e: needs {max(batches)} prompts of one length")
    context = int(prompts[0].shape[1])
    check_batches_fit(model, batches, context, tokens)
    if not crop_rewinds(GrowingCache(config=model.config)):  # before any prefill
        raise SparseDecodeError(
            "bench e2e --batch: this model has sliding-window or recurrent cache layers, which cannot be stacked "
            "into a batch here; time it at batch 1 (without --batch)"
        )
    return context


@contextlib.contextmanager
def _session(model, cfg: SparseConfig, cache, histories):
    """A sparse session over ``cache`` (its rows the prompts of ``histories``, unpadded), handed each prompt's H2O
    history where the selector ranks by it (:meth:`~sparsedecode.session.SparseSession.adopt_batch_history`)."""
    with sparse_decoding(model, cfg) as session:
        if histories is not None:
            session.adopt_batch_history(cache, histories, [0] * len(histories))
        yield session


def _prefill_each(model, prompts: list[torch.Tensor], progress) -> tuple[list[GrowingCache], list[int]]:
    """Each prompt prefilled alone (dense) into an in-place cache: the caches and each prompt's first token."""
    caches, firsts = [], []
    for number, ids in enumerate(prompts, start=1):
        cache = GrowingCache(config=model.config)
        _, logits = prefill(model, ids, cache=cache)
        caches.append(cache)
        firsts.append(int(logits.argmax()))
        if progress:
            progress("prefill (each prompt alone)", number, len(prompts))
    return caches, firsts


def _alone(model, modes, caches, firsts, context: int, tokens: int, context_for, progress) -> dict[tuple, list]:
    """Every prompt decoded alone in every mode: the tokens each batch must reproduce."""
    alone: dict[tuple, list[list[int]]] = {}
    for mode in modes:  # every prompt alone, every mode: what the batches must reproduce
        outs = []
        for i, cache in enumerate(caches):
            with context_for(mode, cache, [i]):
                (out,), _ = decode_tokens(
                    model, cache, [firsts[i]], tokens, progress=progress, stage=f"{mode[0]} alone", nll=False
                )
            crop_cache(cache, context)
            outs.append(out)
        alone[mode] = outs
    return alone


def _measure_batch(
    model, b: int, modes, caches, firsts, alone, context: int, tokens: int, repeats: int, context_for, progress, device
) -> dict[tuple, dict]:
    """Batch ``b``'s measurements per mode (keys ``(b, kind, support, "growing")``): the median decode seconds of
    ``repeats`` runs (modes in order, then reversed), whether every sequence equals its batch-1 run, and peak RSS."""
    gc.collect()
    reset_peak_rss()
    stacked = caches[0] if b == 1 else _stack_caches(model, caches[:b])
    mask = torch.ones(b, context, dtype=torch.long, device=device)
    times: dict[tuple, list[float]] = {mode: [] for mode in modes}
    outputs: dict[tuple, list[list[list[int]]]] = {mode: [] for mode in modes}  # every repeat's, each checked
    for repeat in range(repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            stage = f"batch {b}, {mode[0]}" + (f" S={mode[1]}" if mode[1] else "") + f" ({repeat + 1}/{repeats})"
            begun = time.perf_counter()
            with context_for(mode, stacked, list(range(b))):
                padded = None if b == 1 else mask  # batch 1 runs as one prompt does
                outs, _ = decode_tokens(
                    model, stacked, firsts[:b], tokens, mask=padded, progress=progress, stage=stage, nll=False
                )
            times[mode].append(time.perf_counter() - begun)
            crop_cache(stacked, context)
            outputs[mode].append(outs)
    rss = current_peak_rss_mb()
    measured = {}
    for mode in modes:
        equal = _equal_to_alone(outputs[mode], alone[mode], b)
        measured[(b, *mode, "growing")] = dict(decode_s=statistics.median(times[mode]), equal=equal, rss=rss)
    return measured


def _equal_to_alone(runs: list[list[list[int]]], alone: list[list[int]], b: int) -> bool:
    """Whether every repeat of a batch of ``b`` decoded each sequence's tokens of its batch-1 run (``alone``)."""
    return all(run[i] == alone[i] for run in runs for i in range(b))


def _batch_rows(model, name: str, measured: dict, context: int, tokens: int, kernel: str, repeats: int):
    """One :class:`BatchRow` per measurement, "vs dense same batch" over the faster dense mode of its batch size
    ("vs best dense" is left to :func:`over_best_dense`)."""
    dense_s = {}  # the faster dense mode's time per batch size
    for (b, kind, _, _), m in measured.items():
        if kind == "dense":
            dense_s[b] = min(dense_s.get(b, m["decode_s"]), m["decode_s"])
    weight = next(model.parameters())
    element, dtype = weight.element_size(), str(weight.dtype).removeprefix("torch.")
    rows = []
    for (b, kind, support, cache), m in measured.items():
        aggregate = b * tokens / m["decode_s"]
        rows.append(
            BatchRow(
                name,
                kind,
                context,
                support,
                b,
                tokens,
                m["decode_s"],
                1000 * m["decode_s"] / tokens,
                aggregate,
                aggregate / (b * tokens / dense_s[b]),
                0.0,  # vs best dense: over_best_dense, below
                m["rss"],
                kv_cache_bytes(model.config, b, context + tokens, element) / 2**20,
                m["equal"],
                None if kind == "dense" else kernel,
                repeats,
                cache,
                m.get("compile_s"),
                dtype,
                weights_label(model),
                m.get("compile_backend"),
            )
        )
    return rows


def _compiled_batches(model, caches, firsts, batches, modes, config_of, tokens, repeats, progress) -> dict:
    """:func:`bench_e2e_batch`'s compiled modes, measured like the others (each prompt alone at batch 1 first, then
    every batch size, each mode ``repeats`` times in order and reversed), from copies of the same prefilled caches."""
    from ..compiled.decoder import decoder_for

    context = int(caches[0].get_seq_length())

    def decoded(decoder, heads: list[int], stage: str) -> tuple[float, list[list[int]]]:
        return compiled_decode(model, decoder, context, heads, tokens, progress, stage)

    def loaded(mode, b: int, rows: list):
        decoder = decoder_for(model, config_of(mode), b, context + tokens + 1)
        with decoder.installed():
            decoder.load(rows, context)
            decoder.warm_up(torch.tensor(firsts[: len(rows)]))
        return decoder

    alone = {}
    for mode in modes:  # every prompt alone: what the batches must reproduce
        alone[mode] = []
        for cache, first in zip(caches, firsts):
            _, (out,) = decoded(loaded(mode, 1, [cache]), [first], f"{mode[0]} alone, compiled")
            alone[mode].append(out)
    measured = {}
    for b in sorted(batches):
        gc.collect()
        reset_peak_rss()
        decoders = {mode: loaded(mode, b, caches[:b]) for mode in modes}
        times: dict[tuple, list[float]] = {mode: [] for mode in modes}
        outputs: dict[tuple, list] = {mode: [] for mode in modes}
        for repeat in range(repeats):
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                stage = f"batch {b}, {mode[0]} compiled" + (f" S={mode[1]}" if mode[1] else "")
                seconds, outs = decoded(decoders[mode], firsts[:b], f"{stage} ({repeat + 1}/{repeats})")
                times[mode].append(seconds)
                outputs[mode].append(outs)
        rss = current_peak_rss_mb()
        for mode in modes:
            equal = _equal_to_alone(outputs[mode], alone[mode], b)
            median = statistics.median(times[mode])
            compile_s = decoders[mode].compile_s
            measured[(b, *mode, "static, compiled")] = dict(
                decode_s=median, equal=equal, rss=rss, compile_s=compile_s, compile_backend=decoders[mode].backend
            )
    return measured

"""``bench e2e``: a real model, real prefill, then greedy decoding dense vs sparse (and lossless, compiled, and
llama.cpp's dense decoding as a baseline) in the same process, every mode from the same prefilled KV cache. Every time
is a median over repeated runs, the modes taken in turn so that a drift of the machine moves them alike."""

from __future__ import annotations

import numbers
import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch

from ..config import SparseConfig
from ..decoding.generate import lossless_decode
from ..decoding.loop import Progress, decode_tokens, prefill
from ..errors import SparseDecodeError
from ..models.weights import weights_label
from ..session import prefill_history, sparse_decoding
from ..session.kv_cache import crop_cache, growing_copy
from .bench_measures import peak_rss_mb, read_bandwidth_gbs
from .bench_vllm import leading_equal


@dataclass
class E2ERow:
    model: str
    mode: str
    cache: str
    context: int
    support: int | None
    tokens: int
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    speedup_vs_best_dense: float
    peak_rss_mb: float
    tokens_equal_to_dense: int
    draft_tokens: int | None = None
    acceptance_rate: float | None = None
    mean_accepted: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    kernel: str | None = None
    runs: int = 1  # timed runs of this mode; decode_s (and draft_s, verify_s) are their medians
    compile_s: float | None = None  # compiled modes: the first step's time, compiling included (not in decode_s)
    vs_llama_cpp: float | None = None  # with a llama.cpp baseline: its dense decode seconds over this row's
    bytes_per_token_mb: float | None = None  # with a baseline: weights + attention reads per token (MB)
    bound_tokens_per_s: float | None = None  # with a baseline: read bandwidth / bytes per token
    weights: str | None = None  # the weights the row decodes with (models.weights: "float32", "gguf Q4_1+Q8_0", ...)
    compile_backend: str | None = None  # compiled and native rows: the decoder's backend (inductor, aot_eager, native)


def bench_e2e(
    model: torch.nn.Module,
    name: str,
    prompt_ids: torch.Tensor,
    supports: tuple[int, ...] = (193,),
    *,
    tokens: int = 64,
    lossless: tuple[int, ...] = (),
    adaptive: bool = False,
    kernel: str = "auto",
    repeats: int = 2,
    progress: Progress | None = None,
    selector: str = "mean-pooled",
    compile: bool = False,
    native: bool = False,
    baseline: dict | None = None,
    dense_layers: tuple[int, ...] = (),
    layer_supports: tuple[tuple[int, int], ...] = (),
) -> list[E2ERow]:
    """Dense prefill once, then ``tokens`` greedy tokens per mode from the same prefilled KV cache.

    Modes: dense on transformers' ``DynamicCache`` (concatenates every step), dense on :class:`GrowingCache`
    (appends in place), sparse on ``GrowingCache`` per support, and (``lossless`` lists draft lengths k)
    self-speculative decoding per support and k. Every mode runs ``repeats`` times and reports the median of its
    runs: the modes run in order, then in reverse order, and so on, so a drift of a shared machine moves every
    mode's median alike instead of favouring one mode. ``speedup_vs_best_dense`` divides by the fastest dense mode.
    Peak RSS is the process peak so far. ``kernel`` is the sparse attention kernel (``SparseConfig.kernel``;
    ``auto`` = the C kernel on the CPU (float32, bfloat16, float16), Triton on CUDA, else torch). ``compile`` adds
    dense and each sparse mode over a static cache with the decode step compiled (:mod:`sparsedecode.compiled.decoder`),
    their compile time in ``compile_s``; ``native`` the same modes with the native step (one C call a step,
    :mod:`sparsedecode.compiled.native`), cache ``static, native``. ``baseline`` (``{label: LlamaCpp}``,
    :mod:`.baseline`) adds llama.cpp's dense decoding of the same token ids, timed in the same rotation, and every
    row's ratio to it and bytes per token.
    ``dense_layers``, ``layer_supports``: the per-layer part of every sparse mode's configuration.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise SparseDecodeError(f"bench e2e: repeats must be an integer >= 1 (got {repeats!r})")
    config = partial(
        SparseConfig, kernel=kernel, selector=selector, dense_layers=dense_layers, layer_supports=layer_supports
    )
    backends = {"static, compiled": None} if compile else {}  # cache label: the decoders' backend
    backends.update({"static, native": "native"} if native else {})
    if backends:  # before the prefill
        _check_static(model, [None, *(config(support=s) for s in supports)], native)
    started = time.perf_counter()
    dynamic, logits = prefill(model, prompt_ids, progress=progress)
    prefill_s = time.perf_counter() - started
    growing = growing_copy(dynamic, model.config)
    first = int(logits.argmax())
    context = int(prompt_ids.shape[1])
    modes = _eager_modes(
        model, dynamic, growing, prompt_ids, first, tokens, supports, lossless, adaptive, config, progress
    )
    compile_s = {}
    if backends:
        cfgs = {None: None, **{s: config(support=s) for s in supports}}
        compiled, compile_s = _compiled_modes(
            model, prompt_ids, first, cfgs, tokens, progress, lossless, adaptive, backends
        )
        for label in backends:
            modes.update({("dense" if s is None else "sparse", label, s, None): compiled[label, s] for s in cfgs})
            modes.update({("lossless", label, s, k): compiled[label, s, k] for s in supports for k in lossless})
    prefills: dict = {}
    if baseline:
        from .baseline import baseline_modes

        modes.update(baseline_modes(baseline, prompt_ids, tokens, prefills, progress, first))
    bandwidth = read_bandwidth_gbs() if baseline else 0.0  # the best of a read before the timed runs and one after:
    runs = _rotate(modes, repeats)  # a shared machine's neighbours lower either (a bound is the quiet machine's)
    rss = peak_rss_mb()
    rows = _e2e_rows(name, runs, context, tokens, prefill_s, rss, kernel, compile_s, baseline, backends)
    for row in rows:
        row.weights = weights_label(model)  # llama.cpp's rows get their GGUF's in annotate
    if baseline:
        from .baseline import annotate

        configs = {s: config(support=s) for s in supports}  # dense layers and per-layer supports: their own reads
        annotate(rows, model, baseline, prefills, max(bandwidth, read_bandwidth_gbs()), configs)
    return rows


def _check_static(model, cfgs: list, native: bool) -> None:
    """Refuse, before the prefill, a configuration the compiled (and with ``native``, the native) step cannot run."""
    from ..compiled.decoder import check_compilable
    from ..compiled.native import check as check_native

    for cfg in cfgs:
        check_compilable(model, cfg, "bench e2e --native" if native else "bench e2e --compile")
        if native:
            check_native(model, cfg, next(model.parameters()).device)


def _eager_modes(
    model, dynamic, growing, prompt_ids, first, tokens, supports, lossless, adaptive, config, progress
) -> dict:
    """:func:`bench_e2e`'s modes on transformers' caches, each a function ``(stage) -> (seconds, tokens)`` (the
    lossless ones return a :class:`~sparsedecode.decoding.generate.Generation`) under its key ``(kind, cache,
    support, draft length)``: dense on the ``dynamic`` and the ``growing`` cache, sparse per support, lossless per
    support and draft length; each crops its cache back to the prompt's positions after it. A selector ranking by
    the attention positions received (``h2o``) is handed the prompt's history, recorded here by one more dense
    prefill (:func:`~sparsedecode.session.prefill_history`, not timed), as ``compare`` and ``generate`` hand it."""
    context = int(prompt_ids.shape[1])
    uses_history = bool(supports) and config(support=supports[0]).selector.uses_history
    history = prefill_history(model, prompt_ids) if uses_history else None

    def timed(cache, stage: str) -> tuple[float, list[int]]:
        begun = time.perf_counter()
        (out,), _ = decode_tokens(model, cache, [first], tokens, progress=progress, stage=stage, nll=False)
        elapsed = time.perf_counter() - begun
        crop_cache(cache, context)
        return elapsed, out

    def sparse(support: int, stage: str) -> tuple[float, list[int]]:
        with sparse_decoding(model, config(support=support)) as session:
            if history is not None:
                session.adopt_history(growing, history)
            return timed(growing, stage)

    def speculative(support: int, k: int, stage: str):
        generation = lossless_decode(
            model,
            growing,
            context,
            first,
            config(support=support),
            tokens + 1,
            draft_tokens=k,
            adaptive=adaptive,
            progress=progress,
            history=history,
        )
        crop_cache(growing, context)
        return generation

    modes = {
        ("dense", "dynamic", None, None): partial(timed, dynamic),
        ("dense", "growing", None, None): partial(timed, growing),
    }
    modes.update({("sparse", "growing", support, None): partial(sparse, support) for support in supports})
    modes.update({("lossless", "growing", s, k): partial(speculative, s, k) for s in supports for k in lossless})
    return modes


def _rotate(modes: dict, repeats: int) -> dict[tuple, list]:
    """Every mode's results of ``repeats`` runs: the modes in order, then in reverse order, and so on."""
    runs: dict[tuple, list] = {mode: [] for mode in modes}
    order = list(modes)
    for repeat in range(repeats):
        for mode in order if repeat % 2 == 0 else order[::-1]:
            kind, cache, support, k = mode
            label = {"dense": f"dense, {cache}", "sparse": f"sparse S={support}, {cache}"}.get(
                kind, f"lossless S={support} k={k}, {cache}"
            )
            runs[mode].append(modes[mode](f"{label} (run {repeat + 1}/{repeats})"))
    return runs


def _e2e_rows(name, runs, context, tokens, prefill_s, rss, kernel, compile_s, baseline, backends) -> list[E2ERow]:
    """One row per mode from its runs: median seconds, the speedup over our fastest dense mode, and the tokens
    equal to dense's (on the dynamic cache) before the first that differs; a compiled row its backend (``backends``:
    by cache label, ``None`` the compile backend's default)."""
    from ..compiled import decoder as compiled_decoder

    def seconds(result) -> float:
        return result[0] if isinstance(result, tuple) else result.decode_s

    median_s = {mode: statistics.median(seconds(r) for r in results) for mode, results in runs.items()}
    # our fastest dense mode (compiled dense too); llama.cpp's rows say their own ratio (vs_llama_cpp)
    best = min(seconds for mode, seconds in median_s.items() if mode[0] == "dense" and mode[1] not in (baseline or {}))
    dense_tokens = runs[("dense", "dynamic", None, None)][0][1]

    rows = []
    for mode, results in runs.items():
        kind, cache, support, k = mode
        decode_s = median_s[mode]
        extra = {"kernel": None if kind == "dense" else kernel, "runs": len(results)}
        if (cache, support) in compile_s:
            extra["compile_s"] = compile_s[cache, support]
            extra["compile_backend"] = backends.get(cache) or compiled_decoder.DEFAULT_BACKEND
        if kind == "lossless":
            g = results[0]  # greedy and deterministic: every run drafts and accepts the same
            out = g.tokens[1:]
            extra.update(
                draft_tokens=k,
                acceptance_rate=g.acceptance_rate,
                mean_accepted=g.mean_accepted,
                draft_s=statistics.median(r.draft_s for r in results),
                verify_s=statistics.median(r.verify_s for r in results),
            )
        else:
            out = results[0][1]
        rows.append(
            E2ERow(
                name,
                kind,
                cache,
                context,
                support,
                tokens,
                prefill_s,
                decode_s,
                tokens / decode_s,
                best / decode_s,
                rss,
                leading_equal(out, dense_tokens),
                **extra,
            )
        )
    return rows


def compiled_decode(model, decoder, context: int, heads: list[int], tokens: int, progress, stage: str):
    """Seconds and tokens of ``tokens`` greedy steps of a compiled ``decoder`` after ``heads`` (a first token per
    row), from the prompt of ``context`` positions in its cache (a warm-up's step left the state one step on)."""
    with decoder.installed():
        decoder.resume(context)
        begun = time.perf_counter()
        outs, _ = decode_tokens(
            model, None, heads, tokens, progress=progress, stage=stage, step_fn=decoder.step, nll=False
        )
        return time.perf_counter() - begun, outs


def _compiled_modes(
    model, prompt_ids, first: int, cfgs: dict, tokens: int, progress, lossless=(), adaptive=False, backends=None
):
    """:func:`bench_e2e`'s compiled modes: for each of ``backends`` (``{cache label: backend}``, default the compile
    backend's ``static, compiled``) and each ``cfgs`` entry (a name and its config, ``None`` = dense), under
    ``(label, name)`` a function ``timed(stage) -> (seconds, tokens)`` decoding ``tokens`` greedy tokens after
    ``first``, every mode from one prefill of ``prompt_ids (1, P)`` into one shared cache; under ``(label, name, k)``
    for each sparse entry and draft length in ``lossless``, the lossless loop drafting with it (a
    :class:`~sparsedecode.decoding.generate.Generation`); and each mode's compile seconds by ``(label, name)``
    (measured here, before any timed run). The configs were checked compilable before."""
    from ..compiled.decoder import decoder_for
    from ..decoding.generate import Generation
    from ..decoding.lossless import MAX_DRAFT_TOKENS, StaticDrafter, lossless_loop

    context = int(prompt_ids.shape[1])
    backends = backends or {"static, compiled": None}
    decoders = {
        (label, name): decoder_for(model, cfg, 1, context + tokens + 1, backend)
        for label, backend in backends.items()
        for name, cfg in cfgs.items()
    }
    prefilled = next(iter(decoders.values()))  # every decoder of one size shares its cache
    with prefilled.installed():
        prefilled.prefill(prompt_ids, progress=progress)
    compile_s = {}
    for name, decoder in decoders.items():
        with decoder.installed():
            decoder.resume(context)
            compile_s[name] = decoder.warm_up(torch.tensor([first]))

    def timed(decoder, stage):
        seconds, (out,) = compiled_decode(model, decoder, context, [first], tokens, progress, stage)
        return seconds, out

    def speculative(decoder, k: int, stage: str):
        with decoder.installed():
            decoder.resume(context)
            return lossless_loop(
                StaticDrafter(decoder), Generation("lossless", [first], 0.0, 0.0), tokens + 1, draft_tokens=k,
                adaptive=adaptive, max_draft_tokens=MAX_DRAFT_TOKENS, progress=progress, eos_token_id=None, stage=stage,
            )  # fmt: skip

    functions = {key: partial(timed, decoder) for key, decoder in decoders.items()}
    sparse = [key for key in decoders if key[1] is not None]
    functions.update({(*key, k): partial(speculative, decoders[key], k) for key in sparse for k in lossless})
    return functions, compile_s

"""``sparsedecode bench e2e --batch``: aggregate decoding throughput of batches of prompts, dense vs sparse, with
``--dense-dtype`` dense decoding in a second dtype beside it."""

from __future__ import annotations

import argparse

from rich.table import Table

from ..errors import SparseDecodeError
from .bench_results import recorded_model, selector_record, write_result
from .display import console, progress_bars
from .loading import load

__all__ = ["bench_e2e_batch"]


def bench_e2e_batch(args, clock: dict) -> int:
    """``bench e2e --batch``: check that every batch fits and the corpus holds its prompts, time each batch size in
    every mode (and dense in ``--dense-dtype``), print the table and write ``--json``."""
    from dataclasses import asdict

    from ..experiments.bench import over_best_dense

    model, tokenizer = load(args)
    _check_batches(args, model, tokenizer)
    rows = _run_batches(args, model, tokenizer)
    rows = over_best_dense(rows)  # over both dtypes' dense rows where --dense-dtype added some
    _print_batches(args, rows)
    if args.json:
        selector = selector_record(args.selector)
        write_result(args.json, clock, model=model, selector=selector, rows=[asdict(r) for r in rows])
    return 0


def _check_batches(args, model, tokenizer) -> None:
    """Refuse, before any prefill, a context that does not fit the model, a batch that does not fit in memory, and a
    corpus that holds too few prompts for the largest batch from ``--prompt-index``."""
    from ..experiments.bench import check_batches_fit
    from ..experiments.corpus import check_context_fits, prompt_count

    check_context_fits(model, args.context, args.tokens)
    largest = max(args.batch)
    for context in args.context:
        check_batches_fit(model, tuple(args.batch), context, args.tokens)  # before any prefill
        available = prompt_count(tokenizer, args.corpus, context, args.tokens)
        if args.prompt_index + largest > available:
            raise SparseDecodeError(
                f"corpus {args.corpus} holds {available} prompts of {context} tokens; batch {largest} from prompt "
                f"{args.prompt_index} needs {args.prompt_index + largest}"
            )


def _run_batches(args, model, tokenizer) -> list:
    """The rows of every batch size and context in ``--dtype`` (dense and sparse), then in ``--dense-dtype`` (dense
    only, that model loaded when its turn comes)."""
    from ..experiments.bench import bench_e2e_batch as measure_batches
    from ..experiments.corpus import prompt_ids
    from ..models.weights import FLOAT_WEIGHTS

    largest = max(args.batch)
    rows = []
    runs = [(args.dtype, tuple(args.support))] + ([(args.dense_dtype, ())] if args.dense_dtype else [])
    # a float --weights was the dtype (load set args.dtype to it): the --dense-dtype model is that dtype's floats
    dense = {"weights": None} if getattr(args, "weights", None) in FLOAT_WEIGHTS else {}
    for dtype, supports in runs:  # --dense-dtype: dense only, after every --dtype run, loaded when its turn comes
        run_model = (
            model if dtype == args.dtype else load(argparse.Namespace(**{**vars(args), "dtype": dtype, **dense}))[0]
        )
        for context in args.context:
            prompts = [
                prompt_ids(tokenizer, args.corpus, context, args.prompt_index + i, args.tokens) for i in range(largest)
            ]
            with progress_bars(piped_lines=True) as progress:
                rows.extend(
                    measure_batches(
                        run_model,
                        recorded_model(args.model),
                        prompts,
                        tuple(args.batch),
                        supports,
                        tokens=args.tokens,
                        repeats=args.repeats,
                        progress=progress,
                        selector=args.selector,
                        compile=args.compile,
                    )
                )
    return rows


def _print_batches(args, rows) -> None:
    """The table of batched rows and what its columns mean."""
    dtypes = args.dtype + (f" (dense also {args.dense_dtype})" if args.dense_dtype else "")
    weights = getattr(args, "weights", None)
    if weights is not None:  # quantized layers: the dtype is the activations' and the KV cache's
        dtypes = f"{weights} weights, {dtypes} activations"
    table = Table(title=f"batched decoding, {args.model} {dtypes} on cpu: {args.tokens} greedy tokens per sequence")
    for name in (
        "dtype",
        "context",
        "batch",
        "mode",
        "S",
        "KV cache",
        "step ms",
        "aggregate tok/s",
        "vs dense same batch",
        "vs best dense",
        "KV cache MB",
        "peak RSS MB",
        "= batch 1",
        "compile s",
    ):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(
            r.dtype,
            str(r.context),
            str(r.batch),
            r.mode,
            str(r.support or "-"),
            r.cache,
            f"{r.step_ms:.1f}",
            f"{r.aggregate_tokens_per_s:.2f}",
            f"{r.speedup_vs_dense_same_batch:.2f}x",
            f"{r.speedup_vs_best_dense:.2f}x",
            f"{r.kv_cache_mb:.0f}",
            f"{r.peak_rss_mb:.0f}",
            "yes" if r.tokens_equal_to_batch1 else "[red]no[/]",
            "-" if r.compile_s is None else f"{r.compile_s:.1f}",
        )
    console.print(table)
    console.print(
        f"[dim]every mode runs {args.repeats} times per batch size (in order, then reversed), medians; 'vs best dense' "
        "divides by the best dense aggregate over the batch sizes (and dense modes and dtypes) measured; '= batch 1': "
        "every sequence's tokens equal its own batch-1 run in the same mode; peak RSS per batch size.[/]"
    )

"""``sparsedecode bench e2e``: a real model's prefill, then greedy decoding dense vs sparse (and lossless, and
llama.cpp with ``--baseline``) in the same process; with ``--batch`` the batched benchmark of :mod:`.bench_batch`."""

from __future__ import annotations

import tempfile
from pathlib import Path

from rich.table import Table

from ..errors import SparseDecodeError
from .arguments import file_arg, int_list, selector_arg
from .bench_batch import bench_e2e_batch
from .bench_results import recorded_model, selector_record, start_clock, write_result
from .conditions import plain_layers
from .display import console, progress_bars
from .loading import check_one_support_per_budget, check_prompt_source, check_whole_blocks, load
from .outputs import check_output_file, inputs_of
from .parser import (
    DRAFT_TOKENS,
    DTYPES,
    add_dense_layers_arg,
    add_model_args,
    add_weights_arg,
    check_adaptive_draft,
    layer_budget,
)

__all__ = ["add_e2e_parser", "cmd_bench_e2e"]


def add_e2e_parser(benches) -> None:
    """``bench e2e`` and its options, under the ``bench`` group's subparsers ``benches``."""
    e2e = benches.add_parser(
        "e2e",
        help="real model: prefill, then greedy decoding dense vs sparse, same process",
        description="Prefill one real prompt once, then decode greedily from the same cache: dense on transformers' "
        "DynamicCache and on the in-place GrowingCache, sparse (and lossless) on GrowingCache; every mode "
        "--repeats times, medians. With --batch, aggregate throughput of batches of prompts.",
        epilog="examples:\n"
        "  sparsedecode bench e2e --context 2048 --support 193 --tokens 16 --repeats 1 --compile\n"
        "  sparsedecode bench e2e --context 2048 --tokens 16 --batch 1,4 --json e2e-batch.json",
    )
    add_model_args(e2e)
    add_weights_arg(e2e)
    e2e.add_argument("--corpus", default="python-docs")
    e2e.add_argument("--context", type=int_list, default=[8192], help="prompt length(s) (plus --tokens must fit)")
    e2e.add_argument("--support", type=int_list, default=[193])
    e2e.add_argument("--selector", type=selector_arg, default="mean-pooled")
    add_dense_layers_arg(e2e)
    e2e.add_argument("--tokens", type=int, default=64)
    e2e.add_argument("--prompt-index", type=int, default=0)
    e2e.add_argument(
        "--json",
        type=file_arg,
        help="write {machine, run, rows} to this JSON file (run: started_utc, wall_s; default: not written)",
    )
    e2e.add_argument(
        "--mode",
        default="standard",
        choices=("standard", "lossless"),
        help="lossless adds self-speculative rows (sparse drafts, dense verification) beside dense and sparse",
    )
    e2e.add_argument(
        "--draft-tokens",
        type=int_list,
        default=None,
        help=f"draft length(s) k for --mode lossless (default {DRAFT_TOKENS})",
    )
    e2e.add_argument("--adaptive", action="store_true", help="adapt k from the acceptance (lossless)")
    e2e.add_argument(
        "--repeats", type=int, default=2, help="timed runs of every mode (in order, then reversed); medians reported"
    )
    e2e.add_argument(
        "--batch",
        type=int_list,
        default=None,
        help="batch sizes, e.g. 1,4,8: aggregate throughput per batch (prompts --prompt-index onwards; "
        "default: none, one prompt per mode)",
    )
    e2e.add_argument(
        "--baseline",
        default="none",
        choices=("none", "llama.cpp"),
        help="llama.cpp: also decode the alias's GGUF with llama.cpp (dense; with and without flash attention), the "
        "same token ids and threads, timed in the same rotation; adds each row's ratio to it and bytes per token "
        "(needs the llamacpp extra). With --weights gguf both engines read that GGUF's blocks; with --weights "
        "int4/int8 llama.cpp reads a copy of it holding our layers' blocks (as Q4_1/Q8_0), written for the run",
    )
    e2e.add_argument(
        "--dense-dtype",
        default=None,
        choices=DTYPES,
        help="with --batch: also time dense decoding with the model in this dtype (a second copy, after the --dtype "
        "runs, the same prompts) and take 'vs best dense' over both dtypes' dense rows (default: --dtype only)",
    )
    e2e.add_argument(
        "--compile",
        action="store_true",
        help="add dense and sparse modes over a static cache with the decode step compiled (torch.compile, "
        "fullgraph; compile seconds reported; with --batch, for every batch size; with --mode lossless, lossless "
        "rows drafting with the compiled step; default: off)",
    )
    e2e.add_argument(
        "--native",
        action="store_true",
        help="add those modes with the native step: a Llama, Qwen2 or Mistral model's whole decode step in one C "
        "call (cache 'static, native'; one prompt; default: off)",
    )
    e2e.set_defaults(handler=cmd_bench_e2e)


def cmd_bench_e2e(args) -> int:
    """Check the arguments before the model loads, then hand ``--batch`` to :func:`bench_e2e_batch` or decode one
    prompt per context in every mode, print the table and write ``--json``."""
    from dataclasses import asdict

    clock = start_clock()
    _check_e2e_args(args)
    if args.batch is not None:
        return bench_e2e_batch(args, clock)
    if args.baseline != "none":
        from ..experiments import baseline

        baseline.check_baseline(args.model)  # before any work
    model, tokenizer = load(args)
    from ..experiments.bench import bench_e2e
    from ..experiments.corpus import check_context_fits, prompt_ids

    check_context_fits(model, args.context, args.tokens)
    rows = []
    scratch = tempfile.TemporaryDirectory(prefix="sparsedecode-gguf-")  # a GGUF of our own layers, for llama.cpp
    for context in args.context:
        ids = prompt_ids(tokenizer, args.corpus, context, args.prompt_index, args.tokens)
        engines = None
        if args.baseline != "none":
            engines = _llama_engines(_baseline_gguf(args, model, Path(scratch.name)), context + args.tokens + 1)
        with progress_bars(piped_lines=True) as progress:
            rows.extend(
                bench_e2e(
                    model,
                    recorded_model(args.model),
                    ids,
                    tuple(args.support),
                    tokens=args.tokens,
                    progress=progress,
                    lossless=tuple(args.draft_tokens) if args.mode == "lossless" else (),
                    adaptive=args.adaptive,
                    repeats=args.repeats,
                    selector=args.selector,
                    compile=args.compile,
                    native=args.native,
                    baseline=engines,
                    **layer_budget(args),
                )
            )
        for engine in (engines or {}).values():
            engine.close()  # llama.cpp's processes (models and caches) end before the next context
    scratch.cleanup()
    _print_e2e(args, rows)
    if args.json:
        layers = {name: plain_layers(value) for name, value in layer_budget(args).items() if value}
        selector = selector_record(args.selector)
        write_result(args.json, clock, model=model, selector=selector, **layers, rows=[asdict(r) for r in rows])
    return 0


def _check_e2e_args(args) -> None:
    """Refuse what the arguments alone show to be wrong, in the order a user meets it, before any model loads; sets
    ``args.draft_tokens`` to its default where it was not given."""
    from ..config import SparseConfig

    check_output_file(args.json, "--json", inputs=inputs_of(args))
    if args.tokens < 2:
        raise SparseDecodeError(f"--tokens must be >= 2 (got {args.tokens}): token 0 comes from the dense prefill")
    if args.mode != "lossless" and (args.draft_tokens is not None or args.adaptive):
        raise SparseDecodeError("--draft-tokens and --adaptive apply to --mode lossless only")
    args.draft_tokens = args.draft_tokens or [DRAFT_TOKENS]
    if args.mode == "lossless" and (min(args.draft_tokens) < 1 or max(args.draft_tokens) > args.tokens - 1):
        raise SparseDecodeError(
            f"--draft-tokens values must be between 1 and --tokens - 1 = {args.tokens - 1} (got {args.draft_tokens})"
        )
    check_adaptive_draft(args.draft_tokens, args.adaptive)
    if args.repeats < 1:
        raise SparseDecodeError(f"--repeats must be >= 1 (got {args.repeats})")
    budget = layer_budget(args)  # its per-layer supports are whole blocks too, as --support is
    check_whole_blocks([SparseConfig(support=s, selector=args.selector, **budget) for s in args.support])
    check_one_support_per_budget(args)
    check_prompt_source(args)
    if args.compile:  # the backend (SPARSEDECODE_COMPILE_BACKEND) and switches, before the model loads
        from ..compiled.decoder import check_backend

        check_backend()
    if args.dense_dtype is not None:
        from ..models.weights import FLOAT_WEIGHTS

        weights = getattr(args, "weights", None)  # a float --weights is the dtype the model decodes in
        named, dtype = ("--weights", weights) if weights in FLOAT_WEIGHTS else ("--dtype", args.dtype)
        if args.batch is None or args.dense_dtype == dtype:
            raise SparseDecodeError(
                "--dense-dtype compares batched dense decoding in another dtype: give --batch and a dtype other than "
                f"{named} {dtype}"
            )
    if args.batch is not None:
        if min(args.batch) < 1:
            raise SparseDecodeError("--batch values must be >= 1")
        if args.baseline != "none" or args.native:
            raise SparseDecodeError(
                f"{'--baseline' if args.baseline != 'none' else '--native'} runs batch 1 only: drop --batch"
            )
        if any(layer_budget(args).values()):
            raise SparseDecodeError("--dense-layers, --layer-supports and --budget run batch 1 only here: drop --batch")
        if args.mode == "lossless":
            raise SparseDecodeError(
                "--mode lossless runs batch 1 only (per-sequence acceptance and rollback are not implemented): "
                "drop --batch"
            )


def _baseline_gguf(args, model, folder: Path) -> Path:
    """The GGUF llama.cpp decodes: the alias's own, or with ``--weights int4``/``int8`` one holding our layers'
    blocks (written once into ``folder``), so that both engines decode the same weights."""
    from ..experiments import baseline

    source = baseline.gguf_of(args.model)
    if getattr(args, "weights", None) not in ("int4", "int8"):
        return source
    target = folder / f"{args.model}-{args.weights}.gguf"
    if not target.exists():
        from ..models.gguf_export import export_gguf

        counts = export_gguf(model, source, target)
        made = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items()))
        console.print(f"[dim]llama.cpp decodes {source.name} with our {args.weights} layers written in ({made})[/]")
    return target


def _llama_engines(path, context: int) -> dict:
    """llama.cpp with and without flash attention, on torch's thread count (ours)."""
    import torch

    from ..experiments.baseline import LLAMA_CPP, LLAMA_CPP_FLASH
    from ..experiments.llama_engine import LlamaCpp

    threads = torch.get_num_threads()
    return {
        LLAMA_CPP: LlamaCpp(path, context, threads),
        LLAMA_CPP_FLASH: LlamaCpp(path, context, threads, flash_attn=True),
    }


def _print_e2e(args, rows) -> None:
    """The table of ``bench e2e`` rows (llama.cpp's columns with ``--baseline``)."""
    baseline = args.baseline != "none"
    weights = baseline or getattr(args, "weights", None) is not None
    table = Table(
        title=f"end to end, {args.model} {args.dtype} on cpu: {args.tokens} greedy tokens after a dense prefill"
    )
    names = ["context", "mode", "KV cache"] + (["weights"] if weights else [])
    names += ["S", "k", "accepted", "prefill s", "decode tok/s", "vs best dense"]
    names += ["vs llama.cpp", "MB/token", "bound tok/s"] if baseline else []
    for name in (*names, "same tokens", "compile s", "peak RSS MB"):
        table.add_column(name, justify="right")
    for r in rows:
        cells = [str(r.context), r.mode, r.cache] + ([r.weights or "-"] if weights else [])
        cells += [
            str(r.support or "-"),
            str(r.draft_tokens or "-"),
            f"{100 * r.acceptance_rate:.0f}%" if r.acceptance_rate is not None else "-",
            f"{r.prefill_s:.1f}",
            f"{r.decode_tokens_per_s:.2f}",
            f"{r.speedup_vs_best_dense:.2f}x",
        ]
        if baseline:
            cells += [f"{r.vs_llama_cpp:.2f}x", f"{r.bytes_per_token_mb:.0f}", f"{r.bound_tokens_per_s:.0f}"]
        cells += [
            f"{r.tokens_equal_to_dense}/{r.tokens}",
            "-" if r.compile_s is None else f"{r.compile_s:.1f}",
            f"{r.peak_rss_mb:.0f}",
        ]
        table.add_row(*cells)
    console.print(table)
    console.print(
        f"[dim]every mode runs {args.repeats} times (in order, then reversed) and reports the median; 'same tokens' = "
        "leading tokens equal to dense greedy output, of the --tokens decoded after the prefill's; peak RSS is the "
        "process peak so far"
        + (
            "; vs llama.cpp = the faster llama.cpp mode's decode time over the row's; MB/token = weights + attention "
            "reads at the mean context, bound = read bandwidth (the better of a read before the timed runs and one "
            "after) / MB per token; the engines decode the same model only where their weights match (--weights gguf, "
            "int4, int8).[/]"
            if baseline
            else ".[/]"
        )
    )

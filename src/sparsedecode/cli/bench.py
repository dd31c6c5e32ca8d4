"""``sparsedecode bench op | e2e``: one decode-attention call, and real-model decoding, dense vs sparse."""

from __future__ import annotations

import argparse
import re
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.table import Table

from ..errors import SparseDecodeError
from .arguments import at_least_one, file_arg, int_list, positive_seconds, selector_arg
from .conditions import environment
from .display import console, progress_bars
from .loading import check_prompt_source, check_whole_blocks, load, quiet_transformers
from .outputs import check_output_file, inputs_of, write_json
from .parser import DRAFT_TOKENS, DTYPES, Parser, add_model_args


def recorded_model(spec: str) -> str:
    """The model as a result file records it: an alias or hub id as given, a local folder or file by its name only,
    so a committed file names no absolute path of the machine it ran on."""
    path = Path(spec).expanduser()
    return path.name if path.exists() else spec


# From :mod:`sparsedecode.experiments.bench` (which imports torch), spelled out so that building the parser does
# not; a test keeps them equal.
SHAPES = ("llama3-8b", "qwen2-0.5b", "smollm2-135m")
DEFAULT_CONTEXTS = (2048, 8192, 32768, 131072)
DEFAULT_SUPPORTS = (97, 193, 769)


def _clock() -> dict:
    """When the command started (UTC, to the second) and its monotonic start, for :func:`_write_result`."""
    return {"started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"), "t0": time.monotonic()}


def _selector_record(spec: str) -> dict:
    """The selector of a bench result: its spec, parameters and, for a file, its sha256."""
    from ..selectors import resolve_selector

    return resolve_selector(spec).record()


def _write_result(path, clock: dict, **fields) -> None:
    """Write a bench result file: the machine, the run itself (when it started and how long the whole command took,
    model loading and prefills included; the rows' timings are medians of what is measured, not this), then
    ``fields``."""
    run = {"started_utc": clock["started_utc"], "wall_s": round(time.monotonic() - clock["t0"], 1)}
    write_json(path, {"machine": environment(), "run": run, **fields})
    console.print(f"wrote {path}")


def _device(text: str) -> str:
    """``--device``: cpu, cuda or cuda:i (whether CUDA is there is asked later, with torch)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:i], got {text!r}")
    return text


def add_parsers(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: op (one decode-attention call), e2e (real model decoding)")
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=Parser)
    op = benches.add_parser(
        "op",
        help="one decode-attention call: torch SDPA dense vs sparse select + attend",
        description="Time one decode-attention call on synthetic keys and values of a model's shape: torch SDPA "
        "over all N positions against the sparse step (selection, attention), with the bytes it must read and "
        "the read bandwidth measured in the same run.",
        epilog="examples:\n"
        "  sparsedecode bench op --context 2048,32768 --support 193 --budget 0.2\n"
        "  sparsedecode bench op --shape llama3-8b --layers 1 --json op-warm.json",
    )
    op.add_argument(
        "--shape", default="qwen2-0.5b", choices=sorted(SHAPES), help="model shape: heads, head dim, layer count"
    )
    op.add_argument(
        "--context", type=int_list, default=list(DEFAULT_CONTEXTS), help="cached positions N, comma-separated"
    )
    op.add_argument("--support", type=int_list, default=list(DEFAULT_SUPPORTS))
    op.add_argument("--dtype", default="float32", choices=DTYPES, help="keys, values and queries dtype")
    op.add_argument("--selector", type=selector_arg, default="mean-pooled")
    op.add_argument(
        "--budget", type=positive_seconds, default=0.6, help="seconds of calls per timing, > 0 (at least 10 calls)"
    )
    op.add_argument(
        "--layers",
        type=at_least_one,
        help="distinct per-layer caches the calls cycle through (default: the shape's layer count, so each call "
        "reads from memory as in a decode step: cold); 1 = one layer over and over (warm)",
    )
    op.add_argument(
        "--device",
        default="cpu",
        type=_device,
        metavar="cpu|cuda[:i]",
        help="cpu, or cuda[:i]: device-event timings, and the Triton kernel beside torch's gather + SDPA",
    )
    op.add_argument(
        "--json",
        type=file_arg,
        help="write {machine, run, bandwidth_gbs, rows} to this JSON file (run: started_utc, wall_s; "
        "default: not written)",
    )
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
    e2e.add_argument("--corpus", default="python-docs")
    e2e.add_argument(
        "--context", type=int_list, default=[8192], help="prompt length(s) in tokens (plus --tokens must fit the model)"
    )
    e2e.add_argument("--support", type=int_list, default=[193])
    e2e.add_argument("--selector", type=selector_arg, default="mean-pooled")
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
        "(needs the llamacpp extra)",
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
    op.set_defaults(handler=cmd_bench_op)
    e2e.set_defaults(handler=cmd_bench_e2e)


def cmd_bench_op(args) -> int:
    from ..config import SparseConfig

    clock = _clock()
    check_whole_blocks([SparseConfig(support=s, selector=args.selector) for s in args.support])
    check_output_file(args.json, "--json", inputs=inputs_of(args))
    quiet_transformers()
    import torch

    from ..experiments.bench import bench_op, check_op_args, op_rows_as_dicts

    dtype = getattr(torch, args.dtype)
    check_op_args(
        args.shape,
        tuple(args.context),
        tuple(args.support),
        selector=args.selector,
        budget_s=args.budget,
        layers=args.layers,
        dtype=dtype,
        device=args.device,
    )
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SparseDecodeError(f"--device {args.device}: torch sees no CUDA device here")
        where = f"{torch.cuda.get_device_name(args.device)}, torch SDPA dense (its own backend choice)"
    elif args.device == "cpu":
        where = f"cpu, {torch.get_num_threads()} threads"
    else:
        raise SparseDecodeError(f"--device must be cpu or cuda[:i] (got {args.device!r})")
    console.print(
        f"bench op: shape {args.shape}, {args.dtype}, {where}; medians over repeated calls, dense and sparse "
        "measured side by side in this process"
    )
    with progress_bars() as progress:
        rows, bandwidth = bench_op(
            args.shape,
            tuple(args.context),
            tuple(args.support),
            dtype=dtype,
            selector=args.selector,
            budget_s=args.budget,
            device=args.device,
            layers=args.layers,
            progress=progress,
        )
    table = Table(
        title=f"one decode-attention call, {args.shape}, calls cycling through per-layer caches; "
        f"read bandwidth measured now: {bandwidth:.1f} GB/s"
    )
    columns = ("N", "S", "layers", "sparse WS MB", "kernel", "dense ms", "sparse ms", "select ms", "attend ms")
    for name in (*columns, "speedup", "dense MB", "sparse MB", "sparse / bound", "dense / bound"):
        table.add_column(name, justify="right")

    def fits(mb: float, llc: float | None) -> str:
        return "*" if llc is not None and mb <= llc else ""

    for r in rows:
        table.add_row(
            str(r.context),
            str(r.support),
            str(r.layers) if r.layers == r.layers_requested else f"{r.layers} of {r.layers_requested}!",
            f"{r.working_set_mb:.1f}{fits(r.working_set_mb, r.llc_mb)}",
            r.kernel,
            f"{r.dense_ms:.3f}",
            f"{r.sparse_ms:.3f}",
            f"{r.select_ms:.3f}",
            f"{r.attend_ms:.3f}",
            f"{r.speedup:.1f}x",
            f"{r.bytes_dense / 1e6:.1f}",
            f"{r.bytes_sparse / 1e6:.2f}",
            f"{r.bound_ratio:.1f}x",
            f"{r.dense_bound_ratio:.1f}x",
        )
    console.print(table)
    for context, note in dict((r.context, r.layers_note) for r in rows if r.layers_note).items():
        console.print(f"[yellow]N = {context}: {note}; rows marked ! cycle through fewer layers than asked[/]")
    llc = next((r.llc_mb for r in rows if r.llc_mb is not None), None)
    console.print(
        "[dim]Calls cycle through the layers' caches (0, 1, ..., L - 1, 0, ...) as a decode step does; sparse WS = "
        "what the sparse calls read in one cycle"
        + (f" (* = fits in the {llc:.0f} MB last-level cache: partly warm even when cycling)" if llc else "")
        + ". bound = bytes one call must read / measured read bandwidth. Isolated operator timings say nothing about "
        "matched-quality or end-to-end speed.[/]"
    )
    if args.json:
        _write_result(
            args.json,
            clock,
            selector=_selector_record(args.selector),
            bandwidth_gbs=bandwidth,
            rows=op_rows_as_dicts(rows),
        )
    return 0


def _llama_engines(path, context: int) -> dict:
    """llama.cpp with and without flash attention, on torch's thread count (ours)."""
    import torch

    from ..experiments.baseline import LLAMA_CPP, LLAMA_CPP_FLASH, LlamaCpp

    threads = torch.get_num_threads()
    return {
        LLAMA_CPP: LlamaCpp(path, context, threads),
        LLAMA_CPP_FLASH: LlamaCpp(path, context, threads, flash_attn=True),
    }


def cmd_bench_e2e(args) -> int:
    from dataclasses import asdict

    from ..config import SparseConfig

    clock = _clock()
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
    if args.repeats < 1:
        raise SparseDecodeError(f"--repeats must be >= 1 (got {args.repeats})")
    check_whole_blocks([SparseConfig(support=s, selector=args.selector) for s in args.support])
    check_prompt_source(args)
    if args.compile:  # the backend (SPARSEDECODE_COMPILE_BACKEND) and switches, before the model loads
        from ..compiled.decoder import check_backend

        check_backend()
    if args.dense_dtype is not None and (args.batch is None or args.dense_dtype == args.dtype):
        raise SparseDecodeError(
            "--dense-dtype compares batched dense decoding in another dtype: give --batch and a dtype other than "
            f"--dtype {args.dtype}"
        )
    if args.batch is not None:
        if min(args.batch) < 1:
            raise SparseDecodeError("--batch values must be >= 1")
        if args.baseline != "none":
            raise SparseDecodeError("--baseline runs batch 1 only: drop --batch")
        if args.mode == "lossless":
            raise SparseDecodeError(
                "--mode lossless runs batch 1 only (per-sequence acceptance and rollback are not implemented): "
                "drop --batch"
            )
        return _bench_e2e_batch(args, clock)
    if args.baseline != "none":
        from ..experiments import baseline

        baseline.check_baseline(args.model)  # before any work
    model, tokenizer = load(args)
    from ..experiments.bench import bench_e2e
    from ..experiments.corpus import check_context_fits, prompt_ids

    check_context_fits(model, args.context, args.tokens)
    rows = []
    for context in args.context:
        ids = prompt_ids(tokenizer, args.corpus, context, args.prompt_index, args.tokens)
        engines = None
        if args.baseline != "none":
            engines = _llama_engines(baseline.gguf_of(args.model), context + args.tokens + 1)
        with progress_bars() as progress:
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
                    baseline=engines,
                )
            )
        for engine in (engines or {}).values():
            engine.close()  # llama.cpp's processes (models and caches) end before the next context
    _print_e2e(args, rows)
    if args.json:
        _write_result(args.json, clock, selector=_selector_record(args.selector), rows=[asdict(r) for r in rows])
    return 0


def _print_e2e(args, rows) -> None:
    """The table of ``bench e2e`` rows (llama.cpp's columns with ``--baseline``)."""
    baseline = args.baseline != "none"
    table = Table(
        title=f"end to end, {args.model} {args.dtype} on cpu: {args.tokens} greedy tokens after a dense prefill"
    )
    names = ["context", "mode", "KV cache", "S", "k", "accepted", "prefill s", "decode tok/s", "vs best dense"]
    names += ["vs llama.cpp", "MB/token", "bound tok/s"] if baseline else []
    for name in (*names, "same tokens", "compile s", "peak RSS MB"):
        table.add_column(name, justify="right")
    for r in rows:
        cells = [
            str(r.context),
            r.mode,
            r.cache,
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
        "leading tokens equal to dense greedy output; peak RSS is the process peak so far"
        + (
            "; vs llama.cpp = the faster llama.cpp mode's decode time over the row's; MB/token = weights + attention "
            "reads at the mean context, bound = read bandwidth / MB per token.[/]"
            if baseline
            else ".[/]"
        )
    )


def _bench_e2e_batch(args, clock: dict) -> int:
    from dataclasses import asdict

    model, tokenizer = load(args)
    from ..experiments.bench import bench_e2e_batch, check_batches_fit, over_best_dense
    from ..experiments.corpus import check_context_fits, prompt_count, prompt_ids

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
    rows = []
    runs = [(args.dtype, tuple(args.support))] + ([(args.dense_dtype, ())] if args.dense_dtype else [])
    for dtype, supports in runs:  # --dense-dtype: dense only, after every --dtype run, loaded when its turn comes
        run_model = model if dtype == args.dtype else load(argparse.Namespace(**{**vars(args), "dtype": dtype}))[0]
        for context in args.context:
            prompts = [
                prompt_ids(tokenizer, args.corpus, context, args.prompt_index + i, args.tokens) for i in range(largest)
            ]
            with progress_bars() as progress:
                rows.extend(
                    bench_e2e_batch(
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
    rows = over_best_dense(rows)  # over both dtypes' dense rows where --dense-dtype added some
    dtypes = args.dtype + (f" (dense also {args.dense_dtype})" if args.dense_dtype else "")
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
    if args.json:
        _write_result(args.json, clock, selector=_selector_record(args.selector), rows=[asdict(r) for r in rows])
    return 0

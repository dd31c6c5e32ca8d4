"""``sparsedecode bench op``: one decode-attention call on synthetic keys and values of a model's shape, torch SDPA
over every position against the sparse step, with the read bandwidth measured in the same run."""

from __future__ import annotations

import argparse
import re

from rich.table import Table

from ..errors import SparseDecodeError
from .arguments import at_least_one, file_arg, int_list, positive_seconds, selector_arg
from .bench_results import selector_record, start_clock, write_result
from .display import console, progress_bars
from .loading import check_whole_blocks, quiet_transformers
from .outputs import check_output_file, inputs_of
from .parser import DTYPES

__all__ = ["DEFAULT_CONTEXTS", "DEFAULT_SUPPORTS", "SHAPES", "add_op_parser", "cmd_bench_op"]

# From :mod:`sparsedecode.experiments.bench` (which imports torch), spelled out so that building the parser does
# not; a test keeps them equal.
SHAPES = ("llama3-8b", "qwen2-0.5b", "smollm2-135m")
DEFAULT_CONTEXTS = (2048, 8192, 32768, 131072)
DEFAULT_SUPPORTS = (97, 193, 769)


def _device(text: str) -> str:
    """``--device``: cpu, cuda or cuda:i (whether CUDA is there is asked later, with torch)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda[:i], got {text!r}")
    return text


def add_op_parser(benches) -> None:
    """``bench op`` and its options, under the ``bench`` group's subparsers ``benches``."""
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
        "--budget",
        type=positive_seconds,
        default=0.6,
        help="seconds of calls per timing, > 0 (at least 10 calls, at most 2000)",
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
    op.set_defaults(handler=cmd_bench_op)


def cmd_bench_op(args) -> int:
    """Check the arguments (before torch where they can be), time the calls, print the table, write ``--json``."""
    from ..config import SparseConfig

    clock = start_clock()
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
    console.print(
        f"bench op: shape {args.shape}, {args.dtype}, {_where(args.device)}; medians over repeated calls, dense and "
        "sparse measured side by side in this process"
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
    _print_op(args, rows, bandwidth)
    if args.json:
        write_result(
            args.json,
            clock,
            selector=selector_record(args.selector),
            bandwidth_gbs=bandwidth,
            rows=op_rows_as_dicts(rows),
        )
    return 0


def _where(device: str) -> str:
    """Where the calls run, for the line above the table: the GPU's name, or the CPU and its threads."""
    import torch

    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SparseDecodeError(f"--device {device}: torch sees no CUDA device here")
        return f"{torch.cuda.get_device_name(device)}, torch SDPA dense (its own backend choice)"
    if device == "cpu":
        return f"cpu, {torch.get_num_threads()} threads"
    raise SparseDecodeError(f"--device must be cpu or cuda[:i] (got {device!r})")


def _print_op(args, rows, bandwidth: float) -> None:
    """The table of ``bench op`` rows, the rows that cycle through fewer layers than asked, and what it means."""
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

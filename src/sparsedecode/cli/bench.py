"""``sparsedecode bench op | e2e | vllm``: one decode-attention call, and real-model decoding, dense vs sparse.

The ``bench`` group's parser; each benchmark lives in a module of its own (:mod:`.bench_op`, :mod:`.bench_e2e`,
:mod:`.bench_batch` for ``e2e --batch``) and what their result files share in :mod:`.bench_results`. The names
imported from here before the split (the commands, the shapes and defaults, :func:`recorded_model`) still are.
"""

from __future__ import annotations

from .bench_e2e import add_e2e_parser, cmd_bench_e2e
from .bench_op import DEFAULT_CONTEXTS, DEFAULT_SUPPORTS, SHAPES, add_op_parser, cmd_bench_op
from .bench_results import recorded_model
from .bench_vllm import add_vllm_parser, cmd_bench_vllm
from .parser import Parser

__all__ = [
    "DEFAULT_CONTEXTS",
    "DEFAULT_SUPPORTS",
    "SHAPES",
    "add_parsers",
    "cmd_bench_e2e",
    "cmd_bench_op",
    "cmd_bench_vllm",
    "recorded_model",
]


def add_parsers(sub) -> None:
    """``bench`` and its benchmarks ``op`` and ``e2e``, under the top-level subparsers ``sub``."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks: op (one decode-attention call), e2e (real model decoding), vllm (inside vLLM)",
        epilog="examples:\n"
        "  sparsedecode bench op --context 2048,32768 --support 193 --budget 0.2\n"
        "  sparsedecode bench e2e --context 2048 --support 193 --tokens 16 --repeats 1 --compile",
    )
    benches = bench.add_subparsers(dest="bench", required=True, parser_class=Parser)
    add_op_parser(benches)
    add_e2e_parser(benches)
    add_vllm_parser(benches)

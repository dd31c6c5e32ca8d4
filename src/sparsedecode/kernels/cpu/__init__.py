"""The sparse step's CPU kernel: ``csrc/sparse_step.c``, compiled at first use and called through ctypes.

Two parts: mean-pooled block selection over the cached centroids (with the short tail block averaged on the fly)
and attention over anchor + chosen blocks + window read in place from the KV cache, callable apart
(:func:`select_mean_pooled`, :func:`attend_support`) and together, one call per layer and step
(:func:`run_step`, what the attention step uses). They replace ~20 small torch operations whose fixed cost (a few
microseconds each) made the sparse step slower than dense SDPA below ~32K positions. A call large enough to pay
for it is split (KV heads, and ranges of blocks for selection) over up to ``torch.get_num_threads()`` threads:
torch's own OpenMP threads where torch runs on GNU libgomp (:data:`OPENMP`), else workers of its own.

For a batch, :mod:`.batch` serves every sparse sequence of a layer in one call, each with its own length, centroid
cache, blocks and reuse schedule, reading per sequence what the two single calls read.

What the C code assumes, all checked before it runs (:func:`refusal`, :func:`sparsedecode.kernels.check_inputs`
and the entry points below); where one does not hold, ``kernel="auto"`` uses torch and ``kernel="c"`` refuses:

* the library built here (a C compiler; :data:`BUILD_ERROR` says why not);
* CPU tensors, the query, keys and values of one dtype among :data:`DTYPES` (float32, bfloat16, float16), each
  element converted to float32 as it is loaded: scores, softmax and sums are float32, as on the torch path (which
  upcasts what it gathers); centroids float32 (as the cache keeps them), outputs float32;
* the value head dim equals the key head dim (one ``d`` for the logits and the output rows), and the query's
  head dim equals them too;
* each key and value row is ``d`` contiguous elements (head-dim stride 1); any head and position strides;
* query heads a multiple of KV heads (``H = kv * group``), the query ``(H, d)`` contiguous (copied if not);
* the cache holds at least the layout's ``n`` positions (the window reads up to ``n - 1``);
* ``blocks`` an ``(kv, b)`` int64 table (converted here); an index outside ``[0, n_blocks)`` is skipped by the
  C code, so no index can move a read outside the distant region;
* centroids ``(kv, >= n_full, d)`` float32 with the block stride 1 (the cache's transposed storage; copied to
  that layout if not);
* ``b <= n_blocks`` for selection (capped here).

A NaN or infinite selection score (a non-finite key in a scored block, or a non-finite query) is found inside the
call, while each tile of scores is in L1, and raises :class:`~sparsedecode.errors.SparseDecodeError` as the torch
path's score check does (:func:`check_status`); nothing is chosen from it.

The shared library is built with the system C compiler (``$CC``, else ``cc``) into
``$SPARSEDECODE_CACHE/kernels`` (default ``~/.cache/sparsedecode/kernels``), keyed by the sources, the flags and
the processor. Without a compiler, or if every build fails, :func:`library` returns ``None`` once (the reason in
:data:`BUILD_ERROR`) and the torch path is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...errors import NONFINITE_SCORES, SparseDecodeError
from ..common import check_inputs
from .compiling import compile_library

if TYPE_CHECKING:
    from ...layout import BlockLayout

SOURCE = Path(__file__).with_name("csrc") / "sparse_step.c"  # the translation unit; it includes the headers beside it
# read once, at import: the library built at first use must match this module's argtypes whatever changes on disk
_SOURCES = {path.name: path.read_bytes() for path in sorted(SOURCE.parent.glob("*.[ch]"))}
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-pthread", "-shared", "-fPIC", "-std=gnu99")
OPENMP_FLAGS = ("-fopenmp", "-DSPARSE_STEP_OPENMP")
"""Added where torch runs on GNU libgomp in this process (:func:`_shares_libgomp`): the kernel's parallel parts then
run on the threads of torch's own parallel regions (see ``parallel`` in ``sparse_step.c``)."""
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The dtypes the C code reads, and each one's code (``DTYPE_*`` in ``sparse_step.c``, every entry point's last
argument)."""
BUILD_ERROR: str | None = None
OPENMP = False
"""The library built shares torch's OpenMP threads (built with :data:`OPENMP_FLAGS`)."""
_LIBRARY: ctypes.CDLL | None = None
_TRIED = False
_LOCK = threading.Lock()

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def cache_dir() -> Path:
    """``kernels`` under the cache root :func:`sparsedecode.models.store.cache_dir` names, read here as it reads it
    (the kernels import nothing above the layout and the errors)."""
    root = os.environ.get("SPARSEDECODE_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "sparsedecode") / "kernels"


CPUINFO_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU architecture", "CPU variant", "CPU part")
"""The first processor's /proc/cpuinfo lines keying a ``-march=native`` build: its instruction sets, not just its name
(a hypervisor names CPUs alike, "Intel(R) Xeon(R) Processor"; aarch64 has no model name but ``Features``, its part)."""


def _processor() -> str:
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        first = ""
    named = [line for line in first.splitlines() if line.startswith(CPUINFO_FIELDS)]
    return "\n".join(named) or platform.processor()


def _key(flags: tuple[str, ...]) -> str:
    sources = b"".join(name.encode() + text for name, text in _SOURCES.items())
    text = sources + " ".join(flags).encode() + platform.machine().encode() + _processor().encode()
    return hashlib.sha256(text).hexdigest()[:16]


def _compile(compiler: str, flags: tuple[str, ...], target: Path) -> str | None:
    """Build the library with ``flags`` into ``target``: None, or the compiler's message when it fails."""

    def command(scratch: Path, built: Path) -> list[str]:
        return [compiler, *flags, str(scratch / SOURCE.name), "-o", str(built), "-lm"]

    return compile_library(_SOURCES, command, target, timeout=120)


def _shares_libgomp() -> bool:
    """torch's OpenMP runtime in this process is GNU libgomp under its usual name (``libgomp.so.1``), so a library
    linked with ``-fopenmp`` binds to the copy already loaded rather than loading a second runtime. Linux only."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return any(line.endswith("/libgomp.so.1") for line in maps.splitlines())


def _build() -> ctypes.CDLL:
    global OPENMP
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler found (set CC)")
    variants = [FLAGS, tuple(f for f in FLAGS if f != "-march=native")]  # not every compiler has -march=native
    if _shares_libgomp():
        variants = [flags + OPENMP_FLAGS for flags in variants] + variants
    for flags in variants:
        target = cache_dir() / f"sparse_step-{_key(flags)}.so"
        error = None if target.exists() else _compile(compiler, flags, target)
        if error is None:
            try:
                library = ctypes.CDLL(str(target))
                break
            except OSError as failed:  # built, but this process cannot load it (an OpenMP runtime it lacks)
                error = str(failed)
    else:
        raise OSError(f"{compiler} failed: {error}")
    OPENMP = OPENMP_FLAGS[0] in flags
    library.select_mean_pooled.argtypes = [_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64] + [_i64] * 7 + [_ptr, _i64]
    library.sparse_step.argtypes = (
        [_ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr] + [_i64] * 8 + [_f32, _i64, _ptr, _i64]
    )
    batch = [_ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr] + [_i64] * 6 + [_f32, _i64, _i64]
    library.sparse_step_batch.argtypes = batch
    library.prepared_step.argtypes = batch + [_i64] * 4 + [_ptr] * 4 + [_i64]  # sparse_step_batch's, then the state
    library.to_float32.argtypes = [_ptr, _i64, _i64, _ptr]
    library.to_float32.restype = None
    library.select_mean_pooled.restype = ctypes.c_int
    library.sparse_step.restype = library.sparse_step_batch.restype = library.prepared_step.restype = ctypes.c_int
    return library


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; ``None`` when it cannot be built here (see :data:`BUILD_ERROR`)."""
    global _LIBRARY, _TRIED, BUILD_ERROR
    if not _TRIED:
        with _LOCK:
            if not _TRIED:
                try:
                    _LIBRARY = _build()
                except (OSError, subprocess.SubprocessError) as error:
                    BUILD_ERROR = str(error)
                _TRIED = True
    return _LIBRARY


def refusal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None) -> str | None:
    """Why the C kernel cannot serve these tensors (``values=None``: selection alone), or ``None`` when it can.

    Shapes are checked by :func:`~sparsedecode.kernels.check_inputs`; this is what the C code adds to them. Runs
    at every step: cheap attribute reads only (a sparse tensor has no strides: ``stride()`` raises).
    """
    if not (q.is_cpu and keys.is_cpu and (values is None or values.is_cpu)):
        return f"it runs on CPU tensors (the cache is on {keys.device})"
    if keys.dtype not in DTYPES or q.dtype != keys.dtype or (values is not None and values.dtype != keys.dtype):
        got = f"query {q.dtype}, keys {keys.dtype}" + ("" if values is None else f", values {values.dtype}")
        return f"it takes float32, bfloat16 or float16, query, keys and values alike ({got.replace('torch.', '')})"
    d = keys.shape[-1]
    if values is not None and values.shape[-1] != d:
        return f"it needs the value head dim equal to the key head dim (keys {d}, values {values.shape[-1]})"
    if keys.stride()[-1] != 1 or (values is not None and values.stride()[-1] != 1):
        strides = f"keys {keys.stride()[-1]}" + ("" if values is None else f", values {values.stride()[-1]}")
        return f"it reads each key and value row as contiguous elements (head-dim strides: {strides})"
    if library() is None:
        return f"it did not build here ({BUILD_ERROR})"
    return None


def _require(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None, layout: BlockLayout) -> None:
    check_inputs(q, keys, values, layout)
    reason = refusal(q, keys, values)
    if reason is not None:
        raise SparseDecodeError(f"the C kernel cannot run on these tensors: {reason}")


def select_mean_pooled(
    q: torch.Tensor, keys: torch.Tensor, centroids: torch.Tensor, layout: BlockLayout, b: int
) -> torch.Tensor:
    """``(kv, b)`` int64 blocks, ascending: what ``top_blocks(mean_pooled_scores(...))`` picks.

    ``centroids`` is the cache's ``(kv, n_full, d)`` float32 view of its ``(kv, d, capacity)`` storage. Checks
    every assumption first (:class:`~sparsedecode.errors.SparseDecodeError` if one fails).
    """
    _require(q, keys, None, layout)
    return run_selection(q, keys, centroids, layout, b)


def attend_support(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor, layout: BlockLayout, scale: float
) -> torch.Tensor:
    """Attention over anchor + ``blocks`` + window, as :func:`sparsedecode.session.attend_support`: ``(H, d)``.

    Checks every assumption first (:class:`~sparsedecode.errors.SparseDecodeError` if one fails).
    """
    _require(q, keys, values, layout)
    return run_attention(q, keys, values, blocks, layout, scale)


def dtype_code(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor | None = None) -> int:
    """The C code's code (:data:`DTYPES`) for the dtype the query, keys and values share; raises
    :class:`SparseDecodeError` where they share none it reads (it would read elements of the wrong size)."""
    code = DTYPES.get(keys.dtype)
    if code is None or q.dtype != keys.dtype or (values is not None and values.dtype != keys.dtype):
        got = f"query {q.dtype}, keys {keys.dtype}" + ("" if values is None else f", values {values.dtype}")
        raise SparseDecodeError(f"the C kernel reads float32, bfloat16 or float16, all alike; got {got}")
    return code


NONFINITE = 2
"""The status of a C call whose selection met a NaN or infinite score (``sparse_step.c``); -1 is out of memory."""
NEEDS_STATISTICS = 3
"""``prepared_step``'s (and ``model_step``'s) status when rows selecting afresh lack the statistics of blocks
completed since: the caller completes them and calls again."""


def check_status(status: int) -> None:
    """Raise for a C call's non-zero status: non-finite selection scores (refused as
    :func:`~sparsedecode.validate.check_scores` refuses them on the torch path) or scratch memory that ran out."""
    if status == NONFINITE:
        raise SparseDecodeError(NONFINITE_SCORES)
    if status:
        raise MemoryError("sparse step kernel: out of memory for its scratch buffers")


def run_selection(
    q: torch.Tensor, keys: torch.Tensor, centroids: torch.Tensor, layout: BlockLayout, b: int
) -> torch.Tensor:
    """:func:`select_mean_pooled` on tensors the dispatch has checked (:func:`refusal` and shapes)."""
    kv_heads, d = keys.shape[0], keys.shape[-1]
    b = max(min(b, layout.n_blocks), 0)
    chosen = torch.empty(kv_heads, b, dtype=torch.int64)
    if b == 0:
        return chosen
    if not (
        centroids.dim() == 3
        and centroids.is_cpu
        and centroids.dtype == torch.float32
        and centroids.shape[0] == kv_heads
        and centroids.shape[1] >= layout.n_full
        and centroids.shape[2] == d
    ):
        raise SparseDecodeError(
            f"centroids must be float32 CPU ({kv_heads}, >= {layout.n_full}, {d}); got {tuple(centroids.shape)} "
            f"{centroids.dtype} on {centroids.device}"
        )
    if centroids.stride(1) != 1 and layout.n_full > 1:  # the C code walks the blocks of one dim contiguously
        centroids = centroids.transpose(1, 2).contiguous().transpose(1, 2)
    q = q.contiguous()
    status = library().select_mean_pooled(
        q.data_ptr(),
        centroids.data_ptr(),
        centroids.stride(0),
        centroids.stride(2),
        layout.n_full,
        keys.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        kv_heads,
        q.shape[0] // kv_heads,
        d,
        layout.distant_end,
        layout.block_size,
        b,
        torch.get_num_threads(),
        chosen.data_ptr(),
        dtype_code(q, keys),
    )
    check_status(status)
    return chosen


def run_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: torch.Tensor, layout: BlockLayout, scale: float
) -> torch.Tensor:
    """:func:`attend_support` on tensors the dispatch has checked (:func:`refusal` and shapes): the attend-only
    form of :func:`run_step` (the same C code, the same output to the bit)."""
    return run_step(q, keys, values, None, blocks, layout, 0, scale)[0]


def centroid_storage(
    centroids: torch.Tensor | None, kv_heads: int, d: int, n_full: int, where: str
) -> tuple[int, int, int]:
    """``(pointer, head stride, dim stride)`` of a centroid cache's ``(kv, d, capacity)`` float32 storage holding
    room for ``n_full`` blocks with the block stride 1, as the C selection reads it; zeros when ``n_full`` is 0
    (nothing is read). Raises :class:`SparseDecodeError` (prefixed by ``where``) for any other tensor."""
    if not n_full:
        return 0, 0, 0
    if not (
        centroids is not None
        and centroids.dim() == 3
        and centroids.shape[0] == kv_heads
        and centroids.shape[1] == d
        and centroids.shape[2] >= n_full
        and centroids.stride(2) == 1
        and centroids.dtype == torch.float32
        and centroids.is_cpu
    ):
        got = "None" if centroids is None else f"{tuple(centroids.shape)} {centroids.dtype}"
        raise SparseDecodeError(
            f"{where}centroid storage must be float32 CPU ({kv_heads}, {d}, >= {n_full}) with the block stride 1; "
            f"got {got}"
        )
    return centroids.data_ptr(), centroids.stride(0), centroids.stride(1)


def run_step(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    centroids: torch.Tensor | None,
    blocks: torch.Tensor | None,
    layout: BlockLayout,
    b: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sparse step of one sequence in one C call: ``(out (H, d) float32, blocks (kv, b) int64)``, whatever
    the dtype (:data:`DTYPES`) of the query, keys and values.

    With ``blocks=None`` it selects afresh (what :func:`run_selection` returns for ``b``, from ``centroids``: the
    cache's ``(kv, d, capacity)`` float32 storage, :meth:`~sparsedecode.selectors.statistics.BlockStatistics.storage`,
    holding at least the layout's ``n_full`` blocks), else it takes ``blocks`` as they are (``b`` unused); then
    attention over anchor + blocks + window, as :func:`attend_support`. One call instead of two saves the Python and
    ctypes work of the second (a few tens of microseconds per layer and step, most of a step's time below ~32K
    positions). For tensors the dispatch has checked (:func:`refusal` and shapes); the rest is checked here.
    """
    kv_heads, d = keys.shape[0], keys.shape[-1]
    fresh = blocks is None
    if fresh:
        b = max(min(b, layout.n_blocks), 0)
        blocks = torch.empty(kv_heads, b, dtype=torch.int64)
        n_full = layout.n_full if b else 0
        pointer, c_head, c_dim = centroid_storage(centroids, kv_heads, d, n_full, "")
    else:
        if blocks.dim() != 2 or blocks.shape[0] != kv_heads:
            raise SparseDecodeError(f"blocks must be ({kv_heads}, b), one row per KV head; got {tuple(blocks.shape)}")
        if blocks.dtype != torch.int64 or not blocks.is_cpu or not blocks.is_contiguous():
            blocks = blocks.to(device="cpu", dtype=torch.int64).contiguous()
        n_full, pointer, c_head, c_dim = 0, 0, 0, 0
    if not q.is_contiguous():
        q = q.contiguous()
    out = torch.empty(q.shape[0], d, dtype=torch.float32)
    distant_end = layout.distant_end
    status = library().sparse_step(
        q.data_ptr(),
        pointer,
        c_head,
        c_dim,
        n_full,
        keys.data_ptr(),
        keys.stride(0),
        keys.stride(1),
        values.data_ptr(),
        values.stride(0),
        values.stride(1),
        blocks.data_ptr(),
        blocks.shape[1],
        1 if fresh else 0,
        kv_heads,
        q.shape[0] // kv_heads,
        d,
        layout.n,
        distant_end,
        layout.block_size,
        scale,
        torch.get_num_threads(),
        out.data_ptr(),
        dtype_code(q, keys, values),
    )
    check_status(status)
    return out, blocks

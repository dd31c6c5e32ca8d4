"""The C kernel of the sparse step (float32, bfloat16 or float16 on the CPU, the default there): the same blocks as
the torch selection (ties included) and the same attention as gather + SDPA, and decoding that agrees with the torch
path."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import assert_attention_close, logits_tolerance, prompt, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_attention import greedy_loop

from sparsedecode import SparseConfig, SparseDecodeError, sparse_decoding
from sparsedecode.kernels import cpu
from sparsedecode.kernels.cpu import batch as cpu_batch
from sparsedecode.layout import BlockLayout
from sparsedecode.selectors import select_blocks
from sparsedecode.selectors.statistics import BlockStatistics
from sparsedecode.session import attend_support

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def built():
    assert cpu.library() is not None, cpu.BUILD_ERROR


def torch_selection(q, keys, layout, b):
    cfg = SparseConfig(support=1 + 64 + 16 * b, kernel="torch")
    return select_blocks(cfg, BlockStatistics(16), q, keys, layout, scale=keys.shape[-1] ** -0.5)


CASES = [
    # query heads, KV heads, head dim, context, blocks
    (14, 2, 64, 2048, 8),
    (14, 2, 64, 9000, 44),
    (32, 8, 128, 1500, 8),
    (4, 4, 16, 300, 3),
    (8, 1, 32, 200, 2),  # a short last block
    (4, 2, 16, 90, 4),  # fewer blocks than b
    (4, 2, 16, 40, 2),  # context inside the window
    (6, 2, 12, 300, 3),  # a head dim that is not a multiple of 8
    (6, 3, 24, 500, 5),  # one of 16 + 8
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_c_selection_and_attention_match_torch(case):
    query_heads, kv_heads, d, n, b = case
    generator = torch.Generator().manual_seed(n)
    layout = BlockLayout(n=n, window=64, block_size=16)
    keys = torch.randn(kv_heads, n + 5, d, generator=generator)  # spare capacity, as in a KV cache
    values = torch.randn(kv_heads, n + 5, d, generator=generator)
    q = 3 * torch.randn(query_heads, d, generator=generator)
    expected = torch_selection(q, keys, layout, b)
    centroids = BlockStatistics(16).update(keys, layout.n_full)
    chosen = cpu.select_mean_pooled(q, keys, centroids, layout, b)
    assert torch.equal(chosen, expected)
    out = cpu.attend_support(q, keys, values, chosen, layout, d**-0.5)
    reference = attend_support(q, keys, values, expected, layout, d**-0.5)
    assert_attention_close(out, reference, q, keys, values, d**-0.5)


@pytest.mark.parametrize("threads", [1, 2, 4])  # KV heads >= threads: one dispatch; fewer: the two calls in turn
@pytest.mark.parametrize("case", CASES + [(14, 2, 64, 70000, 8)], ids=lambda c: "-".join(map(str, c)))
def test_one_call_step_equals_selection_then_attention(case, threads):
    """``run_step`` (the whole step in one C call) gives the two calls' blocks and output to the bit when it selects
    afresh, and torch's attention when it reuses blocks given in any order, over one or several threads."""
    query_heads, kv_heads, d, n, b = case
    generator = torch.Generator().manual_seed(n + threads)
    layout = BlockLayout(n=n, window=64, block_size=16)
    keys = torch.randn(kv_heads, n + 5, d, generator=generator)
    values = torch.randn(kv_heads, n + 5, d, generator=generator)
    q = 3 * torch.randn(query_heads, d, generator=generator)
    cache = BlockStatistics(16)
    centroids = cache.update(keys, layout.n_full)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        chosen = cpu.select_mean_pooled(q, keys, centroids, layout, b)
        expected = cpu.attend_support(q, keys, values, chosen, layout, d**-0.5)
        out, blocks = cpu.run_step(q, keys, values, cache.storage(), None, layout, b, d**-0.5)
        assert torch.equal(blocks, chosen) and torch.equal(out, expected)
        reused = blocks.flip(1).to(torch.int32)  # blocks as given, in any order and integer type
        out, same = cpu.run_step(q, keys, values, None, reused, layout, b, d**-0.5)
        reference = attend_support(q, keys, values, reused.to(torch.int64), layout, d**-0.5)  # torch, not C
        assert_attention_close(out, reference, q, keys, values, d**-0.5)
        assert torch.equal(same, reused.to(torch.int64))
    finally:
        torch.set_num_threads(previous)


def test_one_call_step_refuses_centroids_of_another_shape():
    layout = BlockLayout(n=400, window=64, block_size=16)
    keys, values, q = torch.randn(2, 400, 16), torch.randn(2, 400, 16), torch.randn(4, 16)
    # none, room for fewer than the layout's 20 full blocks, (kv, blocks, d) instead of (kv, d, blocks), float64
    for storage in (None, torch.zeros(2, 16, 10), torch.zeros(2, 20, 16), torch.zeros(2, 16, 20, dtype=torch.float64)):
        with pytest.raises(SparseDecodeError, match="centroid storage"):
            cpu.run_step(q, keys, values, storage, None, layout, 4, 0.25)


def test_c_attention_masks_a_chosen_short_last_block():
    layout = BlockLayout(n=2048, window=64, block_size=16)  # 123 full blocks, then one of 15 positions
    generator = torch.Generator().manual_seed(7)
    keys, values = torch.randn(2, 2048, 64, generator=generator), torch.randn(2, 2048, 64, generator=generator)
    q = torch.randn(14, 64, generator=generator)
    blocks = torch.tensor([[3, 50, layout.n_blocks - 1], [0, 1, layout.n_blocks - 1]])
    out = cpu.attend_support(q, keys, values, blocks, layout, 0.125)
    reference = attend_support(q, keys, values, blocks, layout, 0.125)
    assert_attention_close(out, reference, q, keys, values, 0.125)


@given(
    st.integers(min_value=70, max_value=600),
    st.integers(min_value=1, max_value=12),
    st.integers(min_value=0, max_value=2**31 - 1),
    st.sampled_from((torch.float32, *HALF)),
)
def test_c_selection_breaks_ties_as_top_blocks(n, b, seed, dtype):
    """Keys of 0s and 1s make many blocks tie: the C kernel must keep the lowest-indexed ones, as top_blocks, in
    every dtype it reads (0 and 1 are exact in all)."""
    generator = torch.Generator().manual_seed(seed)
    layout = BlockLayout(n=n, window=64, block_size=16)
    keys = torch.randint(0, 2, (2, n, 8), generator=generator).to(dtype)
    keys[:, 1 : layout.distant_end] = keys[:, 1 : layout.distant_end : 16].repeat_interleave(16, 1)[
        :, : layout.distant_end - 1
    ]  # constant within a block, so the tail block's mean ties full blocks' exactly
    q = torch.ones(4, 8, dtype=dtype)
    centroids = BlockStatistics(16).update(keys, layout.n_full)
    chosen = cpu.select_mean_pooled(q, keys, centroids, layout, b)
    assert torch.equal(chosen, torch_selection(q, keys, layout, b))


def test_decoding_with_the_c_kernel_matches_torch(arch):
    model = tiny_model(arch)
    ids = prompt(200)
    results = {}
    for kernel in ("torch", "c"):
        with sparse_decoding(model, SparseConfig(support=97, kernel=kernel)) as session:
            results[kernel] = greedy_loop(model, ids, 30)
        assert session.sparse_steps == 30 * 2
    assert results["c"][0] == results["torch"][0]
    # C and torch sum the same attention in another order: float32 round-off apart
    tolerance = logits_tolerance(results["torch"][1], model, positions=230)
    assert torch.allclose(results["c"][1], results["torch"][1], atol=tolerance, rtol=0)


@pytest.mark.parametrize("selector", ["mean-pooled", "quest:grouping=mean-query"])
def test_a_sparse_step_is_one_c_call_per_layer(selector, monkeypatch):
    """Under kernel="auto" on float32 CPU tensors every sparse step of every layer is one ``run_step_batch`` call of
    one row (the mean-pooled selection inside it; a KV-level quest selects in torch first; per-query-head supports run
    in torch, tested apart), never the separate selection and
    attention."""
    model = tiny_model("llama")
    calls = {"step": 0, "apart": 0}
    run_step_batch = cpu_batch.run_step_batch

    def counted(q, keys, values, out, rows, *args):
        calls["step"] += 1
        assert len(rows) == 1, "a sequence alone is a batch of one row"
        return run_step_batch(q, keys, values, out, rows, *args)

    def apart(*args):
        calls["apart"] += 1
        raise AssertionError("the sparse step called the selection or attention kernel on its own")

    monkeypatch.setattr(cpu_batch, "run_step_batch", counted)
    monkeypatch.setattr(cpu, "run_selection", apart)
    monkeypatch.setattr(cpu, "run_attention", apart)
    with sparse_decoding(model, SparseConfig(support=97, reuse=2, selector=selector)) as session:
        greedy_loop(model, prompt(200), 10)
    assert session.sparse_steps > 0 and calls["apart"] == 0
    assert calls["step"] == session.sparse_steps


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("case", CASES + [(14, 2, 64, 70000, 8)], ids=lambda c: "-".join(map(str, c)))
def test_c_half_precision_selection_and_attention_match_torch(case, dtype):
    """bfloat16 and float16 caches: the torch path's blocks, and its attention over them within float32 round-off
    (both convert the same half-precision numbers to float32 exactly and then compute in float32, so they differ only
    by the order of their sums: assert_attention_close). The one C call gives the two calls' results to the bit."""
    query_heads, kv_heads, d, n, b = case
    generator = torch.Generator().manual_seed(n)
    layout = BlockLayout(n=n, window=64, block_size=16)
    keys = torch.randn(kv_heads, n + 5, d, generator=generator).to(dtype)
    values = torch.randn(kv_heads, n + 5, d, generator=generator).to(dtype)
    q = (3 * torch.randn(query_heads, d, generator=generator)).to(dtype)
    expected = torch_selection(q, keys, layout, b)
    cache = BlockStatistics(16)
    chosen = cpu.select_mean_pooled(q, keys, cache.update(keys, layout.n_full), layout, b)
    assert torch.equal(chosen, expected)
    out = cpu.attend_support(q, keys, values, chosen, layout, d**-0.5)
    assert out.dtype == torch.float32
    reference = attend_support(q, keys, values, expected, layout, d**-0.5)
    assert_attention_close(out, reference, q, keys, values, d**-0.5)
    whole, blocks = cpu.run_step(q, keys, values, cache.storage(), None, layout, b, d**-0.5)
    assert torch.equal(blocks, chosen) and torch.equal(whole, out)


@given(
    st.integers(min_value=70, max_value=600),
    st.integers(min_value=1, max_value=12),
    st.integers(min_value=0, max_value=2**31 - 1),
    st.sampled_from(HALF),
)
def test_c_half_precision_selection_equals_torch_on_exact_scores(n, b, seed, dtype):
    """Keys constant within each block, of -1, -1/2, 0, 1/2 and 1, and queries of small integers, in half precision:
    every score is a multiple of 1/64 below 2^6, which float32 holds exactly however its sum is ordered (and the torch
    path's scaling by 1/sqrt(16) is exact), so C and torch compute the very same scores, many of them tied. The C
    kernel must pick exactly top_blocks' blocks, the lowest index first among ties; attention over them as torch's
    within float32 round-off."""
    generator = torch.Generator().manual_seed(seed)
    layout = BlockLayout(n=n, window=64, block_size=16)
    keys = (torch.randint(-2, 3, (2, n, 16), generator=generator) / 2).to(dtype)
    keys[:, 1 : layout.distant_end] = keys[:, 1 : layout.distant_end : 16].repeat_interleave(16, 1)[
        :, : layout.distant_end - 1
    ]  # the tail block's mean is exact too
    values = torch.randn(2, n, 16, generator=generator).to(dtype)
    q = torch.randint(-2, 3, (4, 16), generator=generator).to(dtype)
    expected = torch_selection(q, keys, layout, b)
    centroids = BlockStatistics(16).update(keys, layout.n_full)
    chosen = cpu.select_mean_pooled(q, keys, centroids, layout, b)
    assert torch.equal(chosen, expected)
    out = cpu.attend_support(q, keys, values, chosen, layout, 0.25)
    assert_attention_close(out, attend_support(q, keys, values, expected, layout, 0.25), q, keys, values, 0.25)


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_decodes_in_c_as_torch(arch, dtype, monkeypatch):
    """A bfloat16 or float16 model's sparse steps run in C, one ``run_step_batch`` call per layer and step (never the
    torch path), and decode the torch path's tokens. At every step the C kernel's blocks are a fresh torch
    selection's (reuse 1) and its float32 output is torch's attention over them within float32 round-off."""
    model = tiny_model(arch, dtype=dtype)
    ids = prompt(200)
    with sparse_decoding(model, SparseConfig(support=97, kernel="torch")):
        expected = greedy_loop(model, ids, 30)[0]
    calls, checked = [], []
    run_step_batch = cpu_batch.run_step_batch

    def counted(q, keys, values, out, rows, *args):
        calls.append((q.dtype, out.dtype, len(rows)))
        return run_step_batch(q, keys, values, out, rows, *args)

    def check(view):
        keys, values, layout = view.keys[:, : view.layout.n], view.values[:, : view.layout.n], view.layout
        assert torch.equal(view.blocks, torch_selection(view.query, keys, layout, view.blocks.shape[1]))
        reference = attend_support(view.query, keys, values, view.blocks, layout, view.scaling)
        assert view.output.dtype == torch.float32
        assert_attention_close(view.output, reference, view.query, keys, values, view.scaling)
        checked.append(view.layer)

    monkeypatch.setattr(cpu_batch, "run_step_batch", counted)
    with sparse_decoding(model, SparseConfig(support=97)) as session:
        session.observers.append(check)
        tokens = greedy_loop(model, ids, 30)[0]
    assert session.sparse_steps == len(calls) == len(checked) == 30 * 2
    assert set(calls) == {(dtype, torch.float32, 1)}  # half-precision inputs, a float32 output
    assert tokens == expected


def _variant(tmp_path, variant: int) -> ctypes.CDLL | None:
    """The kernel built with ``-DSPARSE_STEP_HALF=variant`` (1 F16C, 2 _Float16, 3 integer arithmetic), or None
    where this compiler or processor cannot build it."""
    compiler = os.environ.get("CC") or "cc"
    target = tmp_path / f"variant{variant}.so"
    command = [compiler, *cpu.FLAGS, f"-DSPARSE_STEP_HALF={variant}", str(cpu.SOURCE), "-o", str(target), "-lm"]
    if subprocess.run(command, capture_output=True, timeout=120).returncode != 0:
        return None
    library = ctypes.CDLL(str(target))
    library.to_float32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return library


def test_every_half_precision_number_converts_exactly(tmp_path):
    """All 65536 bfloat16 and float16 bit patterns become the float32 torch makes of them (NaN for NaN), eight at a
    time and one at a time (65533 is not a multiple of 8), in the library built here and in every conversion
    variant this compiler builds (the portable one always)."""
    libraries = {"built": cpu.library(), **{v: _variant(tmp_path, v) for v in (1, 2, 3)}}
    assert libraries[3] is not None
    for dtype in HALF:
        halves = torch.arange(-(2**15), 2**15 - 3, dtype=torch.int32).to(torch.int16).view(dtype)
        expected = halves.float()
        for name, library in libraries.items():
            if library is None:
                continue
            got = torch.empty(halves.numel())
            library.to_float32(halves.data_ptr(), halves.numel(), cpu.DTYPES[dtype], got.data_ptr())
            same = (got.view(torch.int32) == expected.view(torch.int32)) | (got.isnan() & expected.isnan())
            assert bool(same.all()), f"{name}, {dtype}: {int((~same).sum())} differ"


def test_without_a_compiler_auto_falls_back_to_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu, "_TRIED", False)
    monkeypatch.setattr(cpu, "_LIBRARY", None)
    monkeypatch.setattr(cpu, "BUILD_ERROR", None)
    monkeypatch.setenv("SPARSEDECODE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    assert cpu.library() is None and "failed" in cpu.BUILD_ERROR
    model = tiny_model("llama")
    with sparse_decoding(model, SparseConfig(support=97)) as session:  # auto: torch, silently
        greedy_loop(model, prompt(180), 3)
    assert session.sparse_steps == 3 * 2
    with sparse_decoding(model, SparseConfig(support=97, kernel="c")), pytest.raises(SparseDecodeError, match="failed"):
        greedy_loop(model, prompt(180), 1)


X86 = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu sse2 avx2{}\n\nprocessor\t: 1\n"
ARM = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd{}\nCPU implementer\t: 0x41\nCPU part\t: {}\n"


@pytest.mark.parametrize(
    "cpuinfo",
    [(X86.format(""), X86.format(" avx512f")), (ARM.format("", "0xd0c"), ARM.format(" sve", "0xd40"))],
    ids=["x86-same-model-name", "aarch64"],
)
def test_the_built_library_is_keyed_by_the_processors_instruction_sets(monkeypatch, cpuinfo):
    """A ``-march=native`` library uses every instruction set of the CPU that built it, so a cache shared by machines
    (a home folder on a cluster, a container volume) must not hand it to a CPU without them: processors a hypervisor
    names alike ("Intel(R) Xeon(R) Processor", as on this project's machines) with other flags, or aarch64 ones, whose
    /proc/cpuinfo has no model name, got one key and so one library (an illegal instruction kills the process)."""
    keys = set()
    for text in cpuinfo:
        monkeypatch.setattr(cpu, "Path", lambda _path, text=text: type("Info", (), {"read_text": lambda self: text})())
        keys.add(cpu._key(cpu.FLAGS))
    assert len(keys) == 2


@pytest.mark.parametrize("case", [(14, 2, 64, 70000, 8), (32, 8, 128, 3000, 44)], ids=["select-split", "attend-split"])
def test_c_kernel_split_over_threads_matches_torch(case):
    """Large enough calls split the KV heads over threads: the result must not depend on it."""
    query_heads, kv_heads, d, n, b = case
    generator = torch.Generator().manual_seed(3)
    layout = BlockLayout(n=n, window=64, block_size=16)
    keys, values = torch.randn(kv_heads, n, d, generator=generator), torch.randn(kv_heads, n, d, generator=generator)
    q = torch.randn(query_heads, d, generator=generator)
    centroids = BlockStatistics(16).update(keys, layout.n_full)
    previous = torch.get_num_threads()
    outputs = []
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            chosen = cpu.select_mean_pooled(q, keys, centroids, layout, b)
            outputs.append((chosen, cpu.attend_support(q, keys, values, chosen, layout, d**-0.5)))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    assert torch.equal(outputs[0][0], torch_selection(q, keys, layout, b))
    reference = attend_support(q, keys, values, outputs[0][0], layout, d**-0.5)
    assert_attention_close(outputs[1][1], reference, q, keys, values, d**-0.5)


def test_c_kernel_from_concurrent_python_threads_matches_serial():
    """ctypes releases the GIL: calls from several Python threads share the kernel's workers (or run alone)."""
    from concurrent.futures import ThreadPoolExecutor

    generator = torch.Generator().manual_seed(5)
    layout = BlockLayout(n=70000, window=64, block_size=16)
    keys, values = torch.randn(2, 70000, 64, generator=generator), torch.randn(2, 70000, 64, generator=generator)
    centroids = BlockStatistics(16).update(keys, layout.n_full)
    queries = [torch.randn(14, 64, generator=generator) for _ in range(8)]

    def step(q):
        chosen = cpu.select_mean_pooled(q, keys, centroids, layout, 8)
        return chosen, cpu.attend_support(q, keys, values, chosen, layout, 0.125)

    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        serial = [step(q) for q in queries]
        with ThreadPoolExecutor(4) as pool:
            concurrent = list(pool.map(step, queries * 4))
    finally:
        torch.set_num_threads(previous)
    for (chosen, out), (expected_chosen, expected_out) in zip(concurrent, serial * 4):
        assert torch.equal(chosen, expected_chosen) and torch.equal(out, expected_out)


def test_the_kernel_runs_on_torchs_openmp_threads_where_torch_has_libgomp():
    """Where torch's OpenMP runtime is GNU libgomp (the Linux wheels), the kernel is built against it and binds to the
    copy torch loaded: one runtime in the process, whose threads serve both (sparsedecode.kernels.cpu.OPENMP)."""
    assert cpu.library() is not None, cpu.BUILD_ERROR
    assert cpu.OPENMP == cpu._shares_libgomp()
    maps = Path("/proc/self/maps")
    if maps.exists():
        runtimes = {line.split()[-1] for line in maps.read_text().splitlines() if "libgomp" in line}
        assert cpu.OPENMP == any(path.endswith("/libgomp.so.1") for path in runtimes)
        assert len(runtimes) <= 1, runtimes


def _select_in_child(keys, centroids, q, layout, expected, done):
    torch.set_num_threads(2)
    done.put(torch.equal(cpu.select_mean_pooled(q, keys, centroids, layout, 8), expected))


def test_c_kernel_after_fork_starts_its_own_workers():
    """A child forked after the parent's workers started has none of them: it must start its own, not hang."""
    import multiprocessing

    generator = torch.Generator().manual_seed(6)
    layout = BlockLayout(n=70000, window=64, block_size=16)
    keys, q = torch.randn(2, 70000, 64, generator=generator), torch.randn(14, 64, generator=generator)
    centroids = BlockStatistics(16).update(keys, layout.n_full)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        expected = cpu.select_mean_pooled(q, keys, centroids, layout, 8)  # the parent's workers now run
    finally:
        torch.set_num_threads(previous)
    context = multiprocessing.get_context("fork")
    done = context.Queue()
    child = context.Process(target=_select_in_child, args=(keys, centroids, q, layout, expected, done))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0 and done.get(timeout=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_kernel_attends_supports_per_query_head_as_torch_does(dtype):
    """Blocks per query head (quest's): the C kernel attends once per member of a KV group; the outputs equal the
    torch path's over the same blocks, to the dtype's round-off."""
    from sparsedecode.kernels.reference import attend_blocks_on
    from sparsedecode.layout import BlockLayout

    g = torch.Generator().manual_seed(5)
    kv, group, d, n = 2, 3, 16, 400
    shapes = ((kv * group, d), (kv, n, d), (kv, n, d))
    q, keys, values = (torch.randn(*shape, generator=g).to(dtype) for shape in shapes)
    layout = BlockLayout(n=n, window=32, block_size=8)
    blocks = torch.stack([torch.randperm(layout.n_blocks, generator=g)[:5].sort().values for _ in range(kv * group)])
    got = attend_blocks_on("c", q, keys, values, blocks, layout, d**-0.5)
    expected = attend_blocks_on("torch", q, keys, values, blocks, layout, d**-0.5)
    assert got.shape == (kv * group, d)
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert not torch.allclose(got.float()[0], got.float()[1])  # the heads of a group read other blocks


@pytest.mark.parametrize(
    "layout",
    [
        BlockLayout(n=0, window=4, block_size=4),  # read position 0 of an empty cache: a segmentation fault
        BlockLayout(n=8, window=2, block_size=0),  # a division by zero in the C code
        BlockLayout(n=8, window=-4, block_size=4),  # a window past the end: writes past the positions buffer
    ],
)
def test_a_layout_the_c_code_cannot_take_is_refused_before_it(layout):
    """Found by probing: these ended the process (SIGSEGV, SIGFPE) or wrote past a buffer, called directly."""
    q, keys = torch.randn(4, 16), torch.randn(2, max(layout.n, 1), 16)
    blocks = torch.zeros(2, 1, dtype=torch.long)
    with pytest.raises(SparseDecodeError, match="at least one"):
        cpu.attend_support(q, keys, keys, blocks, layout, 0.25)
    if layout.n == 0:  # a batch's row of no position is refused by its row table
        return
    batch_q = torch.randn(1, 4, 16)
    with pytest.raises(SparseDecodeError, match="at least one"):
        cpu_batch.sparse_step_batch(
            batch_q, keys[None], keys[None], torch.empty(1, 4, 16), [], layout.window, layout.block_size, 0.25
        )

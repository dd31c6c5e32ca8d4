"""One prepared check of the optional Triton path on a CUDA machine; writes JSON files into the folder given.

    PYTHONPATH=src python3 scripts/gpu_check.py OUTDIR [--quick] [--graphs-only | --batch-only | --compiled-only |
                                                     --per-head-only | --paged-only]

``--quick`` shrinks every stage (a dry run of the script itself; without CUDA it runs on the CPU, the kernel
through Triton's interpreter: set TRITON_INTERPRET=1).

1. Correctness: the Triton kernel against a float64 attention over the same support (anchor, chosen blocks,
   window), fresh random inputs per case, float32 / bfloat16 / float16 caches, several shapes and splits.
   Then the limits of ``sparsedecode.kernels``: the largest tiles the Triton kernels accept (they must compile and
   match), and tensors they refuse (``auto`` must run torch and match, ``kernel="triton"`` must raise).
2. A tiny random Qwen2 decoding on the GPU with the Triton kernel and with torch's gather + SDPA: same tokens.
3. ``bench op`` on the GPU (qwen2-0.5b and llama3-8b shapes, bfloat16): torch SDPA dense against the sparse step
   with each kernel (``cuda_median_time``: device events, L2 flushed before every call).
4. The same calls captured in CUDA graphs and replayed (``--graphs-only``: this stage alone).
5. End to end at 32K context on a model with qwen2.5-coder-0.5b's shapes and random weights (no weights can be
   fetched on such a machine; decode speed does not depend on the weights' values, acceptance does): dense vs
   sparse S = 193 with each kernel, and lossless k = 4.
6. Batched end to end (``--batch-only``: this stage alone): the same model, batch 1 / 8 / 32 at 32K, dense vs
   Triton sparse S = 193 (``bench_e2e_batch``: aggregate tokens/s, step latency, every sequence's tokens against
   its batch-1 run), the session's eager step (it synchronises with the host per layer).
7. Compiled end to end (``--compiled-only``: this stage alone): the whole decode step compiled with
   ``mode="reduce-overhead"`` (replayed from a CUDA graph; the sparse step host-free,
   ``sparsedecode.step.device``) over a static cache, dense vs sparse S = 193, at 32K: Qwen2.5-0.5B
   shapes at batch 1 and 8, llama3-8b shapes at batch 1, random weights; compile seconds, aggregate tokens/s, and
   whether sparse and dense agree with each sequence's eager tokens.
8. vLLM's pages (``--paged-only``: this stage alone, not in the full run): the plug-in's step
   (``sparsedecode.integrations.vllm.step.sparse_rows``) over pages in vLLM's CUDA layout (``(pages, 16, kv, d)``
   keys and values, shuffled block tables), batches of 1 / 8 / 32 sequences of up to 32K, S = 193 mean-pooled: the
   Triton page-list kernel against float64 attention over each row's own support, and the median milliseconds of a
   layer's call (selection + attention), of the attention alone, and of the same kernel over every position.

Each stage runs even if an earlier one failed; a summary is printed last.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from sparsedecode import SparseConfig, SparseDecodeError, kernels, sparse_decoding
from sparsedecode.experiments.bench import bench_e2e, bench_e2e_batch, bench_op, op_rows_as_dicts
from sparsedecode.experiments.environment import environment
from sparsedecode.kernels.triton.attention import support_attention
from sparsedecode.layout import BlockLayout, support_positions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUICK = "--quick" in sys.argv
QWEN_CODER_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
    tie_word_embeddings=False,
)


def reference(q, keys, values, blocks, layout, scale):
    """Float64 attention of every query head over its KV head's support positions."""
    index, valid = support_positions(blocks, layout)
    kv, d = keys.shape[0], keys.shape[-1]
    gather = index.unsqueeze(-1).expand(-1, -1, d)
    k, v = keys.gather(1, gather).double(), values.gather(1, gather).double()
    qg = q.double().view(kv, -1, d)
    logits = torch.bmm(qg, k.transpose(1, 2)) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    return torch.bmm(torch.softmax(logits, -1), v).reshape(q.shape)


def check_kernel() -> list[dict]:
    """Every case with fresh random inputs; the (possibly short) last distant block is always among the chosen."""
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
    cases = [
        (14, 2, 64, 131072, 8, None),
        (14, 2, 64, 2048, 8, 1),
        (14, 2, 64, 32768, 44, None),
        (32, 8, 128, 8192, 44, None),
        (32, 8, 128, 4096, 8, 3),
        (8, 1, 32, 500, 4, 2),
        (4, 2, 16, 20, 0, 2),
    ]
    if QUICK:
        cases = [(h, kv, d, min(n, 2048), b, splits) for h, kv, d, n, b, splits in cases]
        tolerance.pop(torch.bfloat16)  # Triton's CPU interpreter multiplies bfloat16 wrongly
    results = []
    generator = torch.Generator(device=DEVICE).manual_seed(1234)
    for dtype in tolerance:
        for query_heads, kv, d, n, b, splits in cases:
            layout = BlockLayout(n=n, window=64, block_size=16)
            keys = torch.randn(kv, n + 9, d, device=DEVICE, generator=generator).to(dtype)
            values = torch.randn(kv, n + 9, d, device=DEVICE, generator=generator).to(dtype)
            q = (3 * torch.randn(query_heads, d, device=DEVICE, generator=generator)).to(dtype)
            b = min(b, layout.n_blocks)
            scores = torch.rand(kv, layout.n_blocks, device=DEVICE, generator=generator)
            if layout.n_blocks:
                scores[:, -1] += 1.0  # always choose the (possibly short) last block
            blocks = scores.topk(b, dim=-1).indices.sort(dim=-1).values
            out = support_attention(q, keys, values, blocks, layout, d**-0.5, splits=splits)
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            expected = reference(q, keys, values, blocks, layout, d**-0.5)
            error = float((out.double() - expected).norm() / expected.norm())
            ok = bool(torch.isfinite(out).all()) and error < tolerance[dtype]
            results.append(
                dict(dtype=str(dtype), shape=[query_heads, kv, d], n=n, b=b, splits=splits, rel_error=error, ok=ok)
            )
    return results


def check_per_head() -> list[dict]:
    """Supports per query head (published Quest's): the Triton kernel attends once per member of a KV group
    (``attend_blocks_on``); against float64 attention of every query head over its own positions, with its
    selection made by the ``quest`` selector itself on the device."""
    from sparsedecode.kernels.reference import attend_blocks_on
    from sparsedecode.selectors import resolve_selector
    from sparsedecode.selectors.select import choose_blocks
    from sparsedecode.selectors.statistics import BlockStatistics

    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
    cases = [(14, 2, 64, 8192, 8), (32, 8, 128, 4096, 24), (28, 4, 128, 32768, 12), (8, 1, 32, 700, 4)]
    if QUICK:
        cases = [(h, kv, d, min(n, 2048), b) for h, kv, d, n, b in cases]
        tolerance.pop(torch.bfloat16)
    generator = torch.Generator(device=DEVICE).manual_seed(4321)
    quest = resolve_selector("quest")
    results = []
    for dtype in tolerance:
        for query_heads, kv, d, n, b in cases:
            layout = BlockLayout(n=n, window=64, block_size=16, scale=d**-0.5)
            keys = torch.randn(kv, n, d, device=DEVICE, generator=generator).to(dtype)
            values = torch.randn(kv, n, d, device=DEVICE, generator=generator).to(dtype)
            q = (3 * torch.randn(query_heads, d, device=DEVICE, generator=generator)).to(dtype)
            cache = BlockStatistics(16, quest.cached_statistics())
            blocks = choose_blocks(quest, b, cache, q, keys, layout, kernel="torch").blocks  # (H, b)
            out = attend_blocks_on("triton", q, keys, values, blocks, layout, d**-0.5)
            index, valid = support_positions(blocks, layout)
            heads = torch.arange(query_heads, device=DEVICE) // (query_heads // kv)
            k, v = keys[heads.unsqueeze(1), index].double(), values[heads.unsqueeze(1), index].double()
            logits = (torch.einsum("hd,hsd->hs", q.double(), k) * d**-0.5).masked_fill(~valid, float("-inf"))
            expected = torch.einsum("hs,hsd->hd", torch.softmax(logits, -1), v)
            error = float((out.double() - expected).norm() / expected.norm())
            ok = (
                bool(torch.isfinite(out).all()) and error < tolerance[dtype] and tuple(blocks.shape) == (query_heads, b)
            )
            results.append(dict(dtype=str(dtype), shape=[query_heads, kv, d], n=n, b=b, rel_error=error, ok=ok))
    return results


def reference_by_position(q, keys, values, blocks, layout, scale):
    """Float64 attention over each KV head's anchor, blocks (skipping indices outside the region) and window;
    values may be narrower or wider than keys."""
    kv, group, block = keys.shape[0], q.shape[0] // keys.shape[0], layout.block_size
    rows = []
    for h in range(kv):
        positions = [0]
        for j in blocks[h].tolist():
            if 0 <= j < layout.n_blocks:
                positions += range(1 + j * block, min(1 + (j + 1) * block, layout.distant_end))
        positions += range(layout.distant_end, layout.n)
        index = torch.tensor(positions, device=keys.device)
        k, v = keys[h, index].double(), values[h, index].double()
        rows.append(torch.softmax(q[h * group : (h + 1) * group].double() @ k.T * scale, -1) @ v)
    return torch.cat(rows)


def check_limits() -> list[dict]:
    """The largest tiles the Triton kernels accept must compile and match float64; refused tensors must run on
    torch under ``auto`` (and match) and raise under ``kernel="triton"``."""
    from sparsedecode.kernels.reference import attend_blocks
    from sparsedecode.selectors import select_blocks
    from sparsedecode.selectors.statistics import BlockStatistics

    generator = torch.Generator().manual_seed(99)
    accepted = [(256, 16, torch.float32), (256, 32, torch.bfloat16), (128, 64, torch.bfloat16), (64, 64, torch.float32)]
    accepted += [(128, 32, torch.float32), (16, 256, torch.float32)]
    refused = [
        ("head dim 96", dict(d=96, dtype=torch.bfloat16)),
        ("head dim 512", dict(d=512, dtype=torch.bfloat16)),
        ("value dim 64 != key dim 128", dict(d=128, dv=64, dtype=torch.bfloat16)),
        ("float64", dict(d=64, dtype=torch.float64)),
        ("value rows strided", dict(d=64, dtype=torch.bfloat16, value_stride=2)),
        ("tile 128 x 128 float32", dict(d=128, block=128, dtype=torch.float32)),
    ]
    if QUICK:
        accepted = accepted[-2:]
    n = 1024 if QUICK else 4096
    cases = [
        (f"accepted {d} x {block} {dtype}", dict(d=d, block=block, dtype=dtype), True) for d, block, dtype in accepted
    ]
    cases += [(name, spec, False) for name, spec in refused]
    results = []
    for name, spec, should_serve in cases:
        d, dv, block = spec["d"], spec.get("dv", spec["d"]), spec.get("block", 16)
        stride = spec.get("value_stride", 1)
        keys = torch.randn(2, n, d, generator=generator).to(DEVICE, spec["dtype"])
        values = torch.randn(2, n, dv * stride, generator=generator).to(DEVICE, spec["dtype"])[..., ::stride]
        q = (3 * torch.randn(8, d, generator=generator)).to(DEVICE, spec["dtype"])
        layout = BlockLayout(n=n, window=64, block_size=block)
        row = {"case": name, "should_serve": should_serve}
        try:
            row["auto_picks"] = kernels.attention_kernel("auto", q, keys, values, layout)
            row["refusal"] = kernels.refusals(q, keys, values, layout)["triton"]
            cfg = SparseConfig(support=1 + 64 + 4 * block, block_size=block)
            blocks = select_blocks(cfg, BlockStatistics(block), q, keys, layout, scale=d**-0.5)
            out = attend_blocks(cfg, q, keys, values, blocks, layout, d**-0.5)
            expected = reference_by_position(q, keys, values, blocks, layout, d**-0.5)
            row["rel_error"] = float((out.double() - expected).norm() / expected.norm())
            tolerance = 1e-5 if spec["dtype"] in (torch.float32, torch.float64) else 1e-2
            explicit_raises = None
            if not should_serve:
                try:
                    attend_blocks(
                        SparseConfig(support=cfg.support, block_size=block, kernel="triton"),
                        q,
                        keys,
                        values,
                        blocks,
                        layout,
                        d**-0.5,
                    )
                    explicit_raises = False
                except SparseDecodeError:
                    explicit_raises = True
            row["explicit_raises"] = explicit_raises
            served = row["auto_picks"] == "triton"
            on_gpu = DEVICE == "cuda"
            row["ok"] = (
                row["rel_error"] < tolerance
                and ((served == should_serve) if on_gpu else row["auto_picks"] != "triton")
                and (should_serve or explicit_raises)
            )
        except Exception as error:
            row["ok"], row["error"] = False, f"{type(error).__name__}: {str(error)[:300]}"
        results.append(row)
        print(("ok  " if row["ok"] else "BAD ") + json.dumps(row, default=str), flush=True)
    return results


def check_decoding() -> dict:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).to(DEVICE).eval().requires_grad_(False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    ids = torch.randint(1, 96, (1, 700), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    outputs = {}
    for kernel in ("torch", "triton"):
        with sparse_decoding(model, SparseConfig(support=97, kernel=kernel)) as session:
            outputs[kernel] = model.generate(ids, max_new_tokens=48, do_sample=False)[0, 700:].tolist()
        assert session.sparse_steps > 0
    return {"tokens_equal": outputs["torch"] == outputs["triton"], "tokens": outputs}


def graph_timings() -> list[dict]:
    """Each call captured once in a CUDA graph and timed by replaying it: what the kernels cost without the
    host-side launch overhead that dominates single calls at batch size 1 (same data and timer as ``bench op``)."""
    from functools import partial

    import torch.nn.functional as F

    from sparsedecode.experiments.bench import SHAPES, cuda_median_time, fresh_step
    from sparsedecode.selectors.statistics import BlockStatistics
    from sparsedecode.session import LayerState, SparseSession

    rows = []
    generator = torch.Generator().manual_seed(0)
    for shape in ("qwen2-0.5b", "llama3-8b"):
        query_heads, kv_heads, d = SHAPES[shape]
        for n in (2048, 32768) if QUICK else (2048, 8192, 32768, 131072):
            keys = torch.randn(1, kv_heads, n, d, generator=generator).to(DEVICE, torch.bfloat16)
            values = torch.randn(1, kv_heads, n, d, generator=generator).to(DEVICE, torch.bfloat16)
            query = torch.randn(1, query_heads, 1, d, generator=generator).to(DEVICE, torch.bfloat16)
            layout = BlockLayout(n=n, window=64, block_size=16)
            every = torch.arange(layout.n_blocks, device=DEVICE).expand(kv_heads, -1)
            packed = query.view(1, kv_heads, query_heads // kv_heads, d)
            calls = {
                "dense_sdpa": partial(F.scaled_dot_product_attention, packed, keys, values, scale=d**-0.5),
                "dense_triton_split_kv": partial(
                    support_attention, query[0, :, 0], keys[0], values[0], every, layout, d**-0.5
                ),
            }
            for support in (97, 193, 769):
                for kernel in ("triton", "torch"):
                    cfg = SparseConfig(support=support, kernel=kernel)
                    session = SparseSession(config=cfg, model=None)
                    state = LayerState(0, BlockStatistics(16))
                    state.centroids.update(keys[0], layout.n_full)
                    step = partial(fresh_step, session, state, query, keys, values, n, d**-0.5)
                    calls[f"sparse_{kernel}_S{support}"] = step
            row = {"shape": shape, "context": n}
            for name, call in calls.items():
                if "torch" in name:  # its top-k tie check synchronises with the host: not capturable
                    row[name + "_ms"] = cuda_median_time(call, budget_s=0.2) * 1e3
                    continue
                try:
                    call()  # warm up: compile, allocate
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        call()
                    row[name + "_graph_ms"] = cuda_median_time(graph.replay, budget_s=0.2) * 1e3
                except Exception as error:  # e.g. a host synchronisation inside the call: not capturable
                    row[name + "_graph_ms"] = None
                    row[name + "_error"] = f"{type(error).__name__}: {str(error)[:120]}"
                    torch.cuda.synchronize()
                row[name + "_ms"] = cuda_median_time(call, budget_s=0.2) * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def random_qwen_coder():
    """A model with qwen2.5-coder-0.5b's shapes and random weights on the device (2 layers with --quick)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shapes = {**QWEN_CODER_05B, "num_hidden_layers": 2} if QUICK else QWEN_CODER_05B
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    config = Qwen2Config(**shapes, attn_implementation="sdpa", dtype=dtype)
    with torch.device(DEVICE):
        return Qwen2ForCausalLM(config).to(dtype).eval().requires_grad_(False)


def batched_e2e(out_dir: Path) -> list[dict]:
    model = random_qwen_coder()
    context = 512 if QUICK else 32704
    batches = (1, 2) if QUICK else (1, 8, 32)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 150000, (1, context), generator=generator).to(DEVICE) for _ in range(max(batches))]
    kernel = "triton" if DEVICE == "cuda" else "torch"
    rows = bench_e2e_batch(
        model,
        "qwen2.5-coder-0.5b shapes, random weights",
        prompts,
        batches,
        (193,),
        tokens=32 if QUICK else 64,
        kernel=kernel,
        repeats=1 if QUICK else 2,
    )
    data = [asdict(r) for r in rows]
    (out_dir / "e2e-gpu-batch.json").write_text(json.dumps({"gpu": DEVICE, "rows": data}, indent=1))
    for r in data:
        print(json.dumps(r), flush=True)
    return data


def random_llama3_8b():
    """A model with llama3-8b's shapes and random weights on the device (2 layers with --quick)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    shapes = dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=2 if QUICK else 32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=65536,
        rope_parameters={"rope_theta": 500000.0, "rope_type": "default"},
    )
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    with torch.device(DEVICE):
        config = LlamaConfig(**shapes, attn_implementation="sdpa", dtype=dtype)
        return LlamaForCausalLM(config).to(dtype).eval().requires_grad_(False)


def compiled_e2e(out_dir: Path) -> list[dict]:
    """Stage 7: dense and sparse decoding, each a whole decode step compiled and replayed from CUDA graphs."""
    from sparsedecode.compiled.decoder import CompiledDecoder

    context, tokens = (512, 8) if QUICK else (32704, 64)
    cases = [("qwen2.5-coder-0.5b", random_qwen_coder, (1, 2) if QUICK else (1, 8))]
    cases.append(("llama3-8b", random_llama3_8b, (1,)))
    rows = []
    for name, build, batches in cases:
        model = build()
        for batch in batches:
            generator = torch.Generator().manual_seed(4)
            ids = torch.randint(1, 100000, (batch, context), generator=generator).to(DEVICE)
            dense = CompiledDecoder(model, None, batch=batch, max_len=context + tokens + 2, mode="reduce-overhead")
            decoders = {"dense": dense}
            for label in ("sparse S=193", "sparse S=193 fused"):  # the host-free step in the op, or traced inline
                decoders[label] = CompiledDecoder(
                    model, SparseConfig(support=193), batch=batch, max_len=context + tokens + 2, cache=dense.cache,
                    mode="reduce-overhead", form="traced" if label.endswith("fused") else None,
                )  # fmt: skip
            with dense.installed():
                first = dense.prefill(ids).argmax(dim=-1)
            outputs = {}
            for mode, decoder in decoders.items():
                try:
                    outputs[mode], row = _compiled_run(model, decoder, mode, first, context, tokens)
                except Exception as error:  # a mode that fails to compile or capture is reported; the others run
                    outputs[mode] = []
                    row = {"mode": mode, "error": f"{type(error).__name__}: {str(error)[:300]}", "decode_s": None}
                row.update(model=f"{name} shapes, random weights", context=context, batch=batch)
                rows.append(row)
                print(json.dumps(row), flush=True)
            for row in rows[-2:]:
                if row["decode_s"] and rows[-3]["decode_s"]:
                    row["speedup_vs_dense"] = rows[-3]["decode_s"] / row["decode_s"]
                row["leading_tokens_equal_to_dense"] = [
                    next((i for i, (a, b) in enumerate(zip(s, d)) if a != b), len(d))
                    for s, d in zip(outputs[row["mode"]], outputs["dense"])
                ]
        del model
        torch.cuda.empty_cache() if DEVICE == "cuda" else None
    (out_dir / "e2e-gpu-compiled.json").write_text(json.dumps({"gpu": DEVICE, "rows": rows}, indent=1))
    return rows


def _compiled_run(model, decoder, mode, first, context, tokens):
    """One mode of stage 7: compile (timed), then ``tokens`` steps from the shared prefilled cache."""
    from sparsedecode.decoding.loop import decode_tokens

    with decoder.installed():
        decoder.resume(context)
        compile_s = decoder.warm_up(first)
        decoder.resume(context)
        torch.cuda.synchronize() if DEVICE == "cuda" else None
        started = time.perf_counter()
        out, _ = decode_tokens(model, None, first.tolist(), tokens, step_fn=decoder.step)
        torch.cuda.synchronize() if DEVICE == "cuda" else None
        seconds = time.perf_counter() - started
    row = {"mode": mode, "compile_s": compile_s, "decode_s": seconds}
    row.update(aggregate_tokens_per_s=decoder.batch * tokens / seconds, **decoder.tally())
    return out, row


def check_paged() -> list[dict]:
    """Stage 8: the vLLM step over CUDA-layout pages (see the module)."""
    from sparsedecode.integrations.vllm.pages import PagedCache
    from sparsedecode.integrations.vllm.step import row_layout, row_support, sparse_rows, statistics_for
    from sparsedecode.kernels.triton.paged import paged_support_attention

    kv, heads, d, page = 2, 14, 64, 16
    cfg, scale = SparseConfig(support=193), d**-0.5
    context = 2048 if QUICK else 32768
    batches = (1, 3) if QUICK else (1, 8, 32)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
    if QUICK:
        tolerance.pop(torch.bfloat16)  # the interpreter multiplies bfloat16 wrongly
    generator = torch.Generator(device=DEVICE).manual_seed(77)
    results = []
    for dtype in tolerance:
        for batch in batches:
            lengths = [context - 37 * r for r in range(batch)]
            widths = [-(-n // page) for n in lengths]
            data = torch.randn(2, sum(widths) + 5, page, kv, d, device=DEVICE, generator=generator).to(dtype)
            cache = PagedCache.of_split(data[0], data[1])
            stats = statistics_for(cfg, cache)
            order = torch.randperm(data.shape[1], device=DEVICE, generator=generator).int()
            tables = torch.zeros(batch, max(widths), dtype=torch.int32, device=DEVICE)
            used = 0
            for r, (n, w) in enumerate(zip(lengths, widths)):
                tables[r, :w] = order[used : used + w]
                used += w
                slots = (
                    tables[r, torch.arange(n, device=DEVICE) // page].long() * page
                    + torch.arange(n, device=DEVICE) % page
                )
                stats.refresh(slots)
            queries = (2 * torch.randn(batch, heads, d, device=DEVICE, generator=generator)).to(dtype)
            out = sparse_rows(cfg, cache, stats, queries, tables, lengths, layer=0, scale=scale)
            errors = []
            for r, n in enumerate(lengths):
                index, valid = row_support(cfg, cache, stats, queries[r], tables[r], row_layout(cfg, n, 0, scale))
                keys, values = cache.gather(tables[r], index, torch.arange(kv, device=DEVICE))
                logits = torch.einsum("kgd,ksd->kgs", queries[r].view(kv, -1, d).double(), keys.double()) * scale
                logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
                expected = torch.einsum("kgs,ksd->kgd", torch.softmax(logits, -1), values.double()).reshape(heads, d)
                errors.append(float((out[r].double() - expected).norm() / expected.norm()))
            full = torch.stack([torch.arange(max(lengths), device=DEVICE).clamp(max=n - 1).expand(kv, -1)
                                for n in lengths])  # fmt: skip
            full_valid = torch.stack([(torch.arange(max(lengths), device=DEVICE) < n).expand(kv, -1) for n in lengths])
            supports = [row_support(cfg, cache, stats, queries[r], tables[r], row_layout(cfg, n, 0, scale))
                        for r, n in enumerate(lengths)]  # fmt: skip
            index, valid = torch.stack([i for i, _ in supports]), torch.stack([v for _, v in supports])
            keys = cache.keys.transpose(2, 3)
            timed = {
                "step_ms": partial(sparse_rows, cfg, cache, stats, queries, tables, lengths, layer=0, scale=scale),
                "attend_ms": partial(paged_support_attention, queries, keys, cache.values, tables, index, valid, scale),
                "every_position_ms": partial(
                    paged_support_attention, queries, keys, cache.values, tables, full, full_valid, scale
                ),  # fmt: skip
            }
            row = dict(dtype=str(dtype), batch=batch, context=context, rel_error=max(errors))
            for name, call in timed.items():
                row[name] = _median_ms(call, repeats=3 if QUICK else 20)
            row["ok"] = bool(torch.isfinite(out).all()) and max(errors) < tolerance[dtype]
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def _median_ms(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - started))
    return sorted(times)[len(times) // 2]


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else None
    summary: dict[str, object] = {"machine": environment(), "gpu": gpu}
    print(summary, flush=True)
    failures: list[str] = []  # a failed stage, a case out of tolerance, tokens that differ: the exit status says so

    def verdict() -> int:
        print("FAILED: " + "; ".join(failures) if failures else "every stage and case ok", flush=True)
        return 1 if failures else 0

    def bad(name, rows) -> None:
        failures.extend(f"{name}: a case not as expected" for r in rows if not r["ok"])

    def stage(name, fn):
        started = time.perf_counter()
        try:
            value = fn()
            summary[name] = "ok"
            return value
        except Exception:  # a failed stage is reported and the next one still runs
            failures.append(f"stage {name}")
            summary[name] = "failed: " + traceback.format_exc(limit=4)[-1500:]
            print(summary[name], flush=True)
            return None
        finally:
            print(f"[{name}] {time.perf_counter() - started:.1f} s", flush=True)

    if "--graphs-only" in sys.argv:  # a later, shorter check: only the CUDA-graph timings
        graphs = stage("graphs", graph_timings)
        if graphs is not None:
            (out_dir / "op-gpu-graphs.json").write_text(json.dumps({"gpu": gpu, "rows": graphs}, indent=1))
        print(summary.get("graphs"))
        return verdict()
    if "--compiled-only" in sys.argv:  # the compiled end-to-end stage alone
        stage("compiled e2e", lambda: compiled_e2e(out_dir))
        print(summary.get("compiled e2e"))
        return verdict()
    if "--per-head-only" in sys.argv:  # supports per query head (published Quest) through the Triton kernel
        rows = stage("per-head", check_per_head) or []
        (out_dir / "per-head-check.json").write_text(json.dumps(rows, indent=1))
        for r in rows:
            print(("ok  " if r["ok"] else "BAD ") + json.dumps(r), flush=True)
        print(summary.get("per-head"), f"{sum(r['ok'] for r in rows)}/{len(rows)} cases within tolerance")
        bad("per-head", rows)
        return verdict()
    if "--paged-only" in sys.argv:  # vLLM's pages through the Triton page-list kernel
        rows = stage("paged", check_paged) or []
        (out_dir / "paged-check.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))
        print(summary.get("paged"), f"{sum(r['ok'] for r in rows)}/{len(rows)} cases within tolerance")
        bad("paged", rows)
        return verdict()
    if "--batch-only" in sys.argv:  # the batched end-to-end stage alone
        stage("batch e2e", lambda: batched_e2e(out_dir))
        print(summary.get("batch e2e"))
        return verdict()
    kernel = stage("kernel", check_kernel)
    if kernel is not None:
        (out_dir / "kernel-check.json").write_text(json.dumps(kernel, indent=1))
        summary["kernel"] = f"{sum(r['ok'] for r in kernel)}/{len(kernel)} cases within tolerance"
        bad("kernel", kernel)
        for r in kernel:
            print(("ok  " if r["ok"] else "BAD ") + json.dumps(r), flush=True)
    limits = stage("limits", check_limits)
    if limits is not None:
        (out_dir / "kernel-limits.json").write_text(json.dumps(limits, indent=1, default=str))
        summary["limits"] = f"{sum(r['ok'] for r in limits)}/{len(limits)} limit cases as expected"
        bad("limits", limits)
    decoding = stage("decoding", check_decoding)
    if decoding is not None:
        summary["decoding"] = f"triton tokens == torch tokens: {decoding['tokens_equal']}"
        if not decoding["tokens_equal"]:
            failures.append("decoding: Triton's tokens differ from torch's")

    op_tables = []
    for shape in ("qwen2-0.5b", "llama3-8b"):

        def op(shape=shape):
            contexts = (2048,) if QUICK else (2048, 8192, 32768, 131072)
            dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
            rows, bandwidth = bench_op(shape, contexts, dtype=dtype, device=DEVICE, budget_s=0.05 if QUICK else 0.4)
            data = {"machine": environment(), "gpu": gpu, "bandwidth_gbs": bandwidth}
            data["rows"] = op_rows_as_dicts(rows)
            (out_dir / f"op-gpu-{shape}.json").write_text(json.dumps(data, indent=1))
            return rows, bandwidth

        result = stage(f"op {shape}", op)
        if result is not None:
            op_tables.append((shape, *result))

    graphs = stage("graphs", graph_timings)
    if graphs is not None:
        (out_dir / "op-gpu-graphs.json").write_text(json.dumps({"gpu": gpu, "rows": graphs}, indent=1))

    def e2e():
        model = random_qwen_coder()
        rows = []
        context = 512 if QUICK else 32704
        ids = torch.randint(1, 150000, (1, context), generator=torch.Generator().manual_seed(2)).to(DEVICE)
        kernels = (("triton", (4,)), ("torch", ())) if DEVICE == "cuda" else (("torch", (4,)),)
        for kernel_name, lossless in kernels:
            rows += bench_e2e(
                model,
                "qwen2.5-coder-0.5b shapes, random weights",
                ids,
                (193,),
                tokens=64,
                lossless=lossless,
                kernel=kernel_name,
            )
        (out_dir / "e2e-gpu.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
        return rows

    e2e_rows = stage("e2e", e2e)
    stage("batch e2e", lambda: batched_e2e(out_dir))
    stage("compiled e2e", lambda: compiled_e2e(out_dir))

    print("\n== summary ==")
    for key, value in summary.items():
        if key != "machine":
            print(f"{key}: {value}")
    for shape, rows, bandwidth in op_tables:
        print(
            f"\nop {shape}, {rows[0].dtype}, read bandwidth {bandwidth:.0f} GB/s "
            "(ms; speedup = dense / sparse whole step; dense-tr = the Triton kernel over every position)"
        )
        print("N       S    kernel  dense   dense-tr sparse  select  attend  speedup  bound")
        for r in rows:
            print(
                f"{r.context:<7} {r.support:<4} {r.kernel:<7} {r.dense_ms:.4f}  {r.dense_triton_ms or 0:.4f}  "
                f"{r.sparse_ms:.4f}  {r.select_ms:.4f}  {r.attend_ms:.4f}  {r.speedup:5.2f}x  {r.bound_ratio:5.1f}x"
            )
    if e2e_rows:
        print("\ne2e (random weights): mode kernel S k  decode tok/s  vs best dense  equal-to-dense  prefill s")
        for r in e2e_rows:
            print(
                f"{r.mode:<9} {r.kernel or '-':<7} {r.support or '-'} {r.draft_tokens or '-'}  "
                f"{r.decode_tokens_per_s:8.1f}  {r.speedup_vs_best_dense:5.2f}x  {r.tokens_equal_to_dense}/{r.tokens}"
                f"  {r.prefill_s:.2f}"
            )
    return verdict()


if __name__ == "__main__":
    raise SystemExit(main())

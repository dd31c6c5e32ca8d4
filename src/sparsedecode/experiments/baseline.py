"""``bench e2e --baseline llama.cpp``: llama.cpp's dense decoding of the GGUF a model alias came from, the same prompt
token ids, the same thread count, in the same run as our modes; and what each mode must read per token.

llama.cpp comes from the optional extra ``llamacpp`` (llama-cpp-python, built from its source distribution; see
docs/benchmarks.md for the flags). It is imported only here, when the baseline is asked for. Token ids are handed
to it as they are: the alias's tokenizer is the GGUF's own vocabulary, so both engines see one sequence.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SparseDecodeError

INSTALL = (
    'pip install "sparsedecode[llamacpp]" (llama-cpp-python from source; on x86-64 set CMAKE_ARGS="-DGGML_NATIVE=OFF '
    '-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON", adding -DGGML_AVX512=ON only where the CPU has avx512f: such a '
    "build dies with an illegal instruction on an AVX2-only CPU; docs/setup.md, per CPU family)"
)


def check_baseline(model_name: str) -> None:
    """Before any work: ``model_name`` is an alias with a GGUF source, and llama-cpp-python is installed."""
    from ..models.aliases import ALIASES

    if model_name not in ALIASES:
        raise SparseDecodeError(
            f"--baseline llama.cpp decodes the GGUF a built-in alias came from; {model_name!r} is not one "
            f"(aliases: {', '.join(sorted(ALIASES))})"
        )
    _llama_class()


def gguf_of(model_name: str) -> Path:
    """The GGUF file the alias ``model_name`` was converted from (fetched and checked like the alias itself)."""
    from ..models.aliases import ALIASES
    from ..models.store import ensure_gguf

    return ensure_gguf(ALIASES[model_name])


def _llama_class():
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SparseDecodeError(f"--baseline llama.cpp needs llama-cpp-python: {INSTALL}") from None
    return Llama


def ended(exitcode: int | None, path: Path) -> str:
    """Why llama.cpp's process ended: an illegal instruction (signal 4) is a build for CPU features this CPU lacks."""
    import signal

    if exitcode == -signal.SIGILL:
        from .environment import cpu_record

        flags = ", ".join(cpu_record()["cpu_flags"] or ()) or "unknown"
        return (
            f"llama.cpp's process died of an illegal instruction (signal 4) with {path.name}: llama-cpp-python was "
            "built for CPU features this CPU lacks (an AVX-512 or native build on an AVX2-only CPU, say; this CPU "
            f"has: {flags}); reinstall it with the build flags of this CPU family (docs/setup.md)"
        )
    return f"llama.cpp's process ended ({exitcode}) decoding {path}"


@dataclass
class LlamaCpp:
    """One llama.cpp model in a process of its own (forked here, so it loads the ``llama_cpp`` this process would):
    :meth:`decode` runs a dense prefill of the prompt, then greedy tokens, timed in that process. In this process
    llama.cpp's worker threads, which keep polling for work after a decode, took a core from the modes timed after
    it (about 7% of their speed on a 2-core machine); apart, each engine has the cores while it runs."""

    path: Path
    context: int
    threads: int
    flash_attn: bool = False

    def __post_init__(self) -> None:
        import multiprocessing

        _llama_class()  # refused here, in one line, where llama-cpp-python is missing
        fork = multiprocessing.get_context("fork")
        self._pipe, theirs = fork.Pipe()
        settings = (str(self.path), self.context, self.threads, self.flash_attn)
        self._process = fork.Process(target=_serve, args=(theirs, settings), daemon=True)
        self._process.start()
        theirs.close()
        self._answer()  # loaded

    def _answer(self):
        try:
            answer = self._pipe.recv()
        except EOFError:
            self._process.join(timeout=5)
            raise SparseDecodeError(ended(self._process.exitcode, self.path)) from None
        if isinstance(answer, str):
            raise SparseDecodeError(f"llama.cpp: {answer}")
        return answer

    def decode(self, prompt: list[int], tokens: int) -> tuple[float, float, list[int]]:
        """``(prefill_s, decode_s, tokens)``: the prompt evaluated from an empty cache, then ``tokens`` greedy
        steps; token 0 comes from the prefill, as in our modes, and ``decode_s`` times the ``tokens`` steps after
        it (the last one's logits included)."""
        self._pipe.send((list(prompt), tokens))
        return self._answer()

    def close(self) -> None:
        """End the engine's process (also when this object goes)."""
        if self._process.is_alive():
            self._pipe.send(None)
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()

    def __del__(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None and process.is_alive():
            process.kill()


def _serve(pipe, settings) -> None:
    """The engine's process: load the model, then answer ``(prompt, tokens)`` requests until ``None``."""
    path, context, threads, flash_attn = settings
    try:
        model = _llama_class()(
            model_path=path,
            n_ctx=context,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            flash_attn=flash_attn,
            verbose=False,
        )
    except Exception as error:  # any failure to load is said in the parent, in one line
        pipe.send(f"cannot load {path}: {error}")
        return
    pipe.send(True)
    while (request := pipe.recv()) is not None:
        prompt, tokens = request
        model.reset()
        started = time.perf_counter()
        model.eval(prompt)
        out = [int(model.sample(temp=0.0))]  # temperature 0: llama.cpp's greedy sampler (the argmax)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(tokens):
            model.eval([out[-1]])
            out.append(int(model.sample(temp=0.0)))
        pipe.send((prefill_s, time.perf_counter() - started, out[1:]))
    pipe.close()


def attention_bytes(config, n: int, support: int | None, element: int, block_size: int = 16) -> int:
    """Bytes attention reads per token at ``n`` positions: every key and value (``support=None``: dense), or the
    support's keys and values plus the float32 block centroids selection scores (one per ``block_size`` keys)."""
    from .bench_measures import kv_cache_bytes

    if support is None or n <= support:
        return kv_cache_bytes(config, 1, n, element)
    centroids = kv_cache_bytes(config, 1, n // block_size, 4) // 2  # keys only: one float32 mean per block
    return kv_cache_bytes(config, 1, support, element) + centroids


LLAMA_CPP = "llama.cpp"
LLAMA_CPP_FLASH = "llama.cpp, flash attention"


def baseline_modes(
    engines: dict[str, LlamaCpp], prompt_ids: torch.Tensor, tokens: int, prefills: dict, progress=None
) -> dict:
    """``bench_e2e`` modes for llama.cpp engines (``{cache label: engine}``): each a function ``(stage) ->
    (decode seconds, tokens)``; every run's prefill seconds go to ``prefills[label]``; ``progress(stage, done,
    total)`` hears when each run (llama.cpp's prefill and tokens) begins and ends."""
    prompt = [int(t) for t in prompt_ids.reshape(-1).tolist()]

    def run(label: str, stage: str):
        stage = f"{stage}, prefill and decode"
        if progress:
            progress(stage, 0, tokens)
        prefill_s, decode_s, out = engines[label].decode(prompt, tokens)
        if progress:
            progress(stage, tokens, tokens)
        prefills.setdefault(label, []).append(prefill_s)
        return decode_s, out

    return {("dense", label, None, None): (lambda stage, label=label: run(label, stage)) for label in engines}


def annotate(rows: list, model: torch.nn.Module, engines: dict[str, LlamaCpp], prefills: dict, bandwidth_gbs: float):
    """Each row's ratio to llama.cpp's faster dense mode (``vs_llama_cpp``: its decode seconds over the row's), the
    bytes a token reads (weights + attention at the run's mean context) and the bound that puts on tokens/s;
    llama.cpp's rows get their own prefill time and their GGUF's weight types (``weights``)."""
    import statistics

    from ..models.quantized import weight_bytes
    from ..models.weights import gguf_decode_bytes, gguf_types

    reference = min((r for r in rows if r.cache in engines), key=lambda r: r.decode_s, default=None)  # its faster
    element = next(model.parameters()).element_size()
    weights = weight_bytes(model)
    for row in rows:
        n = row.context + row.tokens // 2
        if row.cache in engines:
            row.prefill_s = statistics.median(prefills[row.cache])
            row.weights = gguf_types(engines[row.cache].path)
            read = gguf_decode_bytes(engines[row.cache].path) + attention_bytes(model.config, n, None, 2)
        else:
            read = weights + attention_bytes(model.config, n, row.support if row.mode == "sparse" else None, element)
        row.bytes_per_token_mb = read / 1e6
        row.bound_tokens_per_s = bandwidth_gbs * 1e9 / read
        if reference is not None:
            row.vs_llama_cpp = reference.decode_s / row.decode_s

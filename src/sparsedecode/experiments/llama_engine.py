"""llama.cpp's engine for ``bench e2e --baseline llama.cpp`` in a process of its own (llama-cpp-python, the optional
extra ``llamacpp``, imported only when the baseline is asked for). This module imports no torch: the engine's process
is started afresh (``spawn``), so it loads llama.cpp and nothing of the parent's state.

Why not ``fork``: a forked child inherits the parent's OpenMP runtime as it was. Where llama.cpp is built with OpenMP
(its default wherever the compiler has it) its threads bind to the OpenMP library already loaded, torch's; once torch
has run a parallel region on two or more threads, the child's first parallel region waits at a barrier for threads
that were not forked, for ever (seen: ``bench e2e --baseline llama.cpp`` on two threads hung at llama.cpp's first
decode, the child in ``gomp_team_barrier_wait_end``). One thread worked only because torch then starts no pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SparseDecodeError

INSTALL = (
    'pip install "sparsedecode[llamacpp]" (llama-cpp-python from source; on x86-64 set CMAKE_ARGS="-DGGML_NATIVE=OFF '
    '-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON", adding -DGGML_AVX512=ON only where the CPU has avx512f: such a '
    "build dies with an illegal instruction on an AVX2-only CPU; docs/setup.md, per CPU family)"
)


def llama_class():
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
    """One llama.cpp model in a process of its own (started afresh with this interpreter and ``sys.path``, so it
    imports the ``llama_cpp`` this process would; see the module on why not forked): :meth:`decode` runs a dense
    prefill of the prompt, then greedy tokens, timed in that process (as for any process started afresh, a script that
    makes one needs Python's ``if __name__ == "__main__":`` guard; the command line has it). In this process
    llama.cpp's worker threads, which keep polling for work after a decode, took a core from the modes timed after
    it (about 7% of their speed on a 2-core machine); apart, each engine has the cores while it runs."""

    path: Path
    context: int
    threads: int
    flash_attn: bool = False

    def __post_init__(self) -> None:
        import multiprocessing

        llama_class()  # refused here, in one line, where llama-cpp-python is missing
        spawn = multiprocessing.get_context("spawn")
        self._pipe, theirs = spawn.Pipe()
        settings = (str(self.path), self.context, self.threads, self.flash_attn)
        self._process = spawn.Process(target=_serve, args=(theirs, settings), daemon=True)
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
        steps; token 0 (in ``tokens``, then the ``tokens`` steps' own) comes from the prefill, as in our modes, and
        ``decode_s`` times the ``tokens`` steps after it (the last one's logits included)."""
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
        model = llama_class()(
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
        pipe.send((prefill_s, time.perf_counter() - started, out))
    pipe.close()

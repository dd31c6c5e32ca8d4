"""One vLLM engine's side of ``sparsedecode bench vllm``, run inside the vLLM environment:

    python -m sparsedecode.integrations.vllm.bench JOB.json

``JOB`` holds the model folder, dtype, the prompts (token ids, as many as the largest batch), the batch sizes, the
tokens to decode, the repeats and the spec (``null``: vLLM dense). For each batch the engine runs the batch's prompts
to ``1 + tokens`` tokens, ``repeats`` times. The whole batch is prefilled in one forward (the scheduler's token
budget holds every prompt), so every sequence's first token comes from the same step and the decode steps follow
together; the decode time is vLLM's own record of the batch's last token minus its first (engine timestamps), the
median over the repeats. The prefix cache is off, so each run prefills afresh. Prints one ``RESULT`` JSON line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def timed(llm, prompts, tokens: int):
    """``(seconds in all, decode seconds, tokens)`` of running ``prompts`` together to ``tokens`` greedy tokens each;
    the decode seconds from vLLM's timestamps: the batch's last token minus its first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    firsts = [o.metrics.first_token_ts for o in outs]
    decode = max(o.metrics.last_token_ts for o in outs) - max(firsts)
    if max(firsts) - min(firsts) > 0.5 * decode / max(tokens - 1, 1):
        raise RuntimeError("the batch's prompts were not prefilled in one step: raise batched_tokens")
    return seconds, decode, [list(o.outputs[0].token_ids) for o in outs]


def run(job: dict) -> dict:
    from vllm import LLM

    extra = {"additional_config": {"sparsedecode": job["spec"]}} if job["spec"] else {}
    context = max(len(p) for p in job["prompts"])
    budget = max(job["batches"]) * (context + 16)
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=context + job["tokens"] + 1, enforce_eager=True,
              enable_prefix_caching=False, max_num_seqs=max(job["batches"]), seed=0, disable_log_stats=False,
              max_num_batched_tokens=budget, enable_chunked_prefill=False, **extra)  # fmt: skip
    timed(llm, job["prompts"][:1], 4)  # warm-up
    rows = []
    for batch in job["batches"]:
        prompts = job["prompts"][:batch]
        fulls, decodes, tokens = [], [], None
        for _ in range(job["repeats"]):
            seconds, decode, tokens = timed(llm, prompts, 1 + job["tokens"])
            fulls.append(seconds)
            decodes.append(decode)
        full, decode = statistics.median(fulls), statistics.median(decodes)
        rows.append({"batch": batch, "context": context, "prefill_s": full - decode, "run_s": full,
                     "decode_s": decode, "decode_tokens_per_s": batch * job["tokens"] / decode,
                     "tokens": tokens})  # fmt: skip
    return {"rows": rows}


def main() -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with open(sys.argv[1]) as f:
        job = json.load(f)
    print("RESULT " + json.dumps(run(job)), flush=True)


if __name__ == "__main__":
    main()
